/* fp32 linear layer on CPU: y = x . W^T (+ bias) (+ residual), W packed for streaming.
 *
 * Why: a decode step multiplies a few rows by every weight of the model, so the weights stream
 * from DRAM once per step and the GEMM must compute while they arrive. This kernel keeps
 * 16 rows x 16 columns of accumulators in vector registers fed by one contiguous weight
 * stream with a software prefetch (see PREFETCH_STEPS); streamed from DRAM it beats oneDNN's
 * packed sgemm on a decode step (without the prefetch it did not), and with the weights in
 * cache it matches oneDNN for prefill and beats it for few rows (docs/benchmarks.md), so it
 * replaces oneDNN for every fp32 CPU linear instead of keeping a second weight copy.
 *
 * Packed layout: W [N, K] becomes [ceil(N / 16)][K][16]: block b holds output columns
 * 16b..16b+15, k-major, zero-padded past N (kernels/cpu/ops.py packs it).
 *
 * Built with paged_decode.c and cpu_ops.c into one library by kernels/cpu/library.py.
 */
#include <stdint.h>
#include <string.h>

#define COLS 16

/* The weight stream is requested PREFETCH_STEPS k-steps (8 KB) ahead into L2 (prefetcht1):
 * one DRAM latency at the rate a 16-row tile consumes weights is ~2 KB, and the hardware
 * stream prefetcher alone leaves the FMAs waiting. Past a block's end it runs into the next
 * block, usually this thread's next one (static schedule); at the end of a thread's range or
 * of the buffer, and when more row tiles re-read the block, those requests are wasted (a
 * prefetch never faults; the address is formed as an integer, see ahead()). 8 KB into L2 was
 * the best of the distances tried (1 KB into L1 with prefetchnta was the first version; the
 * sweep is in docs/benchmarks.md). */
#define PREFETCH_STEPS 128

/* The weight row PREFETCH_STEPS k-steps after row k, possibly past the end of the buffer:
 * integer arithmetic, since a pointer that far out of its object is undefined in C. */
static inline const void *ahead(const float *wp, int k) {
    return (const void *)((uintptr_t)wp + ((uintptr_t)k + PREFETCH_STEPS) * COLS * sizeof(float));
}

/* 1 where this build has 32 vector registers of 16 floats (AVX-512): the 16 named
 * accumulators of a tile stay in registers. Elsewhere GCC splits each into 2-4 narrower
 * registers and spills, so callers keep their vendor GEMM (oneDNN) instead. */
int pg_linear_preferred(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

typedef float v16 __attribute__((vector_size(COLS * sizeof(float))));

/* Stores one 16-row x 16-column accumulator tile: columns [0, ncols) of rows [0, nrows). */
static inline void store_tile(const v16 *acc, int nrows, int ncols, const float *bias,
                              const float *residual, int64_t ld_res, float *y, int64_t ldy) {
    for (int m = 0; m < nrows; ++m) {
        float row[COLS];
        memcpy(row, &acc[m], sizeof(row));
        float *dst = y + m * ldy;
        const float *res = residual != NULL ? residual + m * ld_res : NULL;
        for (int c = 0; c < ncols; ++c) {
            float v = row[c];
            if (bias != NULL) v += bias[c];
            if (res != NULL) v = res[c] + v;
            dst[c] = v;
        }
    }
}

/* `rows` rows (1..15) of one column block. Always inlined into call sites where `rows` is a
 * compile-time constant (the switch below), so the accumulator array is unrolled into
 * registers; the weight stream is prefetched as in tile_16_rows. */
static inline __attribute__((always_inline)) void tile_rows(const int rows, const float *x,
                                                            int64_t ldx, const float *wp, int K,
                                                            v16 *out) {
    v16 acc[16];
    for (int m = 0; m < rows; ++m) acc[m] = (v16){0};
    for (int k = 0; k < K; ++k) {
        v16 w;
        memcpy(&w, wp + (int64_t)k * COLS, sizeof(w));
        __builtin_prefetch(ahead(wp, k), 0, 2);
        for (int m = 0; m < rows; ++m) acc[m] += x[m * ldx + k] * w;
    }
    for (int m = 0; m < rows; ++m) out[m] = acc[m];
}

/* 16 full rows: the 16 accumulators are named so they stay in registers. */
static inline void tile_16_rows(const float *x, int64_t ldx, const float *wp, int K, v16 *out) {
    v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    v16 a8 = {0}, a9 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0}, a14 = {0}, a15 = {0};
    for (int k = 0; k < K; ++k) {
        v16 w;
        memcpy(&w, wp + (int64_t)k * COLS, sizeof(w));
        __builtin_prefetch(ahead(wp, k), 0, 2);
#define PG_FMA(i) a##i += x[(i) * ldx + k] * w;
        PG_FMA(0) PG_FMA(1) PG_FMA(2) PG_FMA(3) PG_FMA(4) PG_FMA(5) PG_FMA(6) PG_FMA(7)
        PG_FMA(8) PG_FMA(9) PG_FMA(10) PG_FMA(11) PG_FMA(12) PG_FMA(13) PG_FMA(14) PG_FMA(15)
#undef PG_FMA
    }
    out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3, out[4] = a4, out[5] = a5;
    out[6] = a6, out[7] = a7, out[8] = a8, out[9] = a9, out[10] = a10, out[11] = a11;
    out[12] = a12, out[13] = a13, out[14] = a14, out[15] = a15;
}

static void tile_few_rows(int rows, const float *x, int64_t ldx, const float *wp, int K, v16 *out) {
    switch (rows) {
#define PG_ROWS(r) \
    case r: tile_rows(r, x, ldx, wp, K, out); break;
        PG_ROWS(1) PG_ROWS(2) PG_ROWS(3) PG_ROWS(4) PG_ROWS(5) PG_ROWS(6) PG_ROWS(7) PG_ROWS(8)
        PG_ROWS(9) PG_ROWS(10) PG_ROWS(11) PG_ROWS(12) PG_ROWS(13) PG_ROWS(14) PG_ROWS(15)
#undef PG_ROWS
        default: break;
    }
}

/*
 * x:        [M, K] rows at ldx (row-major, dense within a row)
 * packed:   [ceil(N / 16), K, 16] (see above)
 * bias:     [N] or NULL; residual: [M, N] rows at ld_res, or NULL (y = residual + x W^T)
 * y:        [M, N] rows at ldy (may be residual itself)
 * Work is split over column blocks (each thread streams its own part of the weights once).
 */
void pg_linear_f32(const float *x, int64_t ldx, const float *packed, const float *bias,
                   const float *residual, int64_t ld_res, float *y, int64_t ldy, int M, int N,
                   int K, int num_threads) {
    const int blocks = (N + COLS - 1) / COLS;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int b = 0; b < blocks; ++b) {
        const float *wp = packed + (int64_t)b * K * COLS;
        const int col = b * COLS;
        const int ncols = N - col < COLS ? N - col : COLS;
        const float *bias_b = bias != NULL ? bias + col : NULL;
        v16 acc[16];
        for (int m0 = 0; m0 < M; m0 += 16) {
            const int nrows = M - m0 < 16 ? M - m0 : 16;
            /* NOTE: full tiles inline, with named accumulators: through the row-count switch
             * (even its 16-row case) prefill ran measurably slower (docs/benchmarks.md) */
            if (nrows == 16)
                tile_16_rows(x + m0 * ldx, ldx, wp, K, acc);
            else
                tile_few_rows(nrows, x + m0 * ldx, ldx, wp, K, acc);
            store_tile(acc, nrows, ncols, bias_b,
                       residual != NULL ? residual + m0 * ld_res + col : NULL, ld_res,
                       y + m0 * ldy + col, ldy);
        }
    }
}
