/* bf16 linear layer on CPU (the --dtype bf16 mode): y = x . W^T (+ bias) (+ residual) with W
 * stored in bf16, x rounded to bf16 (nearest even) once per call, products summed in fp32, and
 * y, the bias and the residual in fp32: only the GEMM's inputs are narrowed, never the residual
 * stream, so each layer adds a relative error of the size of one bf16 rounding of its inputs.
 *
 * Packed layout (kernels/cpu/ops.py pack_bf16_weight): W [N, K] becomes
 * [ceil(N / 16)][Kp / 2][16][2] bf16, Kp = K rounded up to 32, zero-padded past N and K: per
 * block of 16 output columns, per pair of k, the 16 columns' (k, k + 1) pairs. That is at once
 * the operand of AVX512-BF16's VDPBF16PS (one 64-byte load feeds 16 columns x 2 k) and, 16 pairs
 * at a time, an AMX B tile in its pair layout (16 rows of 64 bytes), so one copy serves both.
 *
 * Two paths over the same layout and the same bf16 inputs:
 *   * vector (AVX512-BF16; Intel from Cooper Lake, AMD Zen 4): a row tile of up to 4 rows keeps
 *     its accumulators in registers while one block's weights stream past; the weights are
 *     read once per row tile (from DRAM for the first, from L2 for the others): half the bytes
 *     of the fp32 kernel's stream;
 *   * AMX tiles (Intel Sapphire Rapids on): from amx_min_rows rows (kernels/cpu/ops.py: every
 *     row count, faster than the vector path even for 1 row: docs/precision.md), chunks of 4 column
 *     blocks against 16-row tiles of x, 32 k per TDPBF16PS. Where AMX is absent (or Linux
 *     refuses the tile state) the vector path takes every row count.
 * The two sum in different orders (fp32 either way), so they are close, not bit-identical; a
 * row's result does not depend on the other rows of the call (greedy output is the same alone
 * and batched for a given path; batching may change the path, as with the quantized kernels).
 *
 * Built with the other sources into one library by kernels/cpu/library.py.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PG_BF16 1
#include <immintrin.h>
#endif
#if defined(PG_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PG_BF16_AMX 1
#endif

#define COLS 16
#define GROUP 32     /* k per AMX tile product (16 pairs) */
#define VEC_ROWS 4   /* rows per register tile of the vector path */
#define CHAINS 4     /* independent sums per row on the vector path (k pair j goes to j % 4) */
#define AMX_CHUNK 4  /* column blocks per A tile load on AMX (4 C tiles + A + 2 B = 7 of 8) */
#define PREFETCH_BYTES 4096

int pg_amx_available(void); /* linear_amx.c */

/* 1 where this build has AVX512-BF16: the --dtype bf16 mode runs natively here. */
int pg_linear_bf16_preferred(void) {
#if defined(PG_BF16)
    return 1;
#else
    return 0;
#endif
}

#if defined(PG_BF16)

/* Rows [r0, r1) of x (fp32, rows at ldx) as bf16 rows of Kp (nearest even; zero past K and
 * from M on: the padding of the last AMX tile). */
static void round_rows(const float *x, int64_t ldx, int r0, int r1, int M, int K, int Kp,
                       uint16_t *xb) {
    for (int r = r0; r < r1; ++r) {
        uint16_t *dst = xb + (int64_t)r * Kp;
        if (r >= M) {
            memset(dst, 0, (size_t)Kp * sizeof(uint16_t));
            continue;
        }
        const float *src = x + (int64_t)r * ldx;
        for (int k = 0; k < Kp; k += 16) {
            const int left = K - k;
            const __mmask16 mask = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + k));
            _mm256_storeu_si256((__m256i *)(dst + k), (__m256i)v);
        }
    }
}

/* y rows [0, R) x columns [0, ncols) = acc (+ bias) (+ residual). */
static inline void store_rows(const __m512 *acc, int R, int ncols, const float *bias,
                              const float *residual, int64_t ld_res, float *y, int64_t ldy) {
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
    const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        __m512 v = _mm512_add_ps(acc[r], b);
        if (residual != NULL)
            v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, residual + r * ld_res), v);
        _mm512_mask_storeu_ps(y + r * ldy, mask, v);
    }
}

/* R rows (a compile-time constant where inlined) of one column block: per k pair, one 64-byte
 * weight load and R VDPBF16PS against the rows' (k, k + 1) pairs broadcast. One chain of
 * dependent dot products per row would be bound by the instruction's latency, not by the
 * weight stream: CHAINS chains per row, summed at the end. NOTE: the same CHAINS for every R,
 * so a row's sum never depends on how many rows share its tile (alone vs batched). */
static inline __attribute__((always_inline)) void vec_tile(const int R, const uint16_t *xb,
                                                           int Kp, const uint16_t *wp,
                                                           __m512 *out) {
    const int CH = CHAINS;
    __m512 acc[CHAINS * VEC_ROWS];
    for (int i = 0; i < CH * R; ++i) acc[i] = _mm512_setzero_ps();
    for (int j0 = 0; j0 < Kp / 2; j0 += CH) {
        __builtin_prefetch(
            (const void *)((uintptr_t)(wp + (int64_t)j0 * 2 * COLS) + PREFETCH_BYTES), 0, 2);
        for (int c = 0; c < CH; ++c) {
            const int j = j0 + c;
            const __m512i w = _mm512_loadu_si512((const void *)(wp + (int64_t)j * 2 * COLS));
            for (int r = 0; r < R; ++r) {
                int32_t pair;
                memcpy(&pair, xb + (int64_t)r * Kp + 2 * j, sizeof(pair));
                acc[c * R + r] = _mm512_dpbf16_ps(acc[c * R + r],
                                                  (__m512bh)_mm512_set1_epi32(pair), (__m512bh)w);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        __m512 sum = acc[r];
        for (int c = 1; c < CH; ++c) sum = _mm512_add_ps(sum, acc[c * R + r]);
        out[r] = sum;
    }
}

static void vec_tile_dispatch(int R, const uint16_t *xb, int Kp, const uint16_t *wp, __m512 *out) {
    switch (R) {
#define PG_ROWS(r) \
    case r: vec_tile(r, xb, Kp, wp, out); break;
        PG_ROWS(1) PG_ROWS(2) PG_ROWS(3) PG_ROWS(4)
#undef PG_ROWS
        default: break;
    }
}

/* Column blocks [first, last) for every row, on the vector path. */
static void vec_blocks(const uint16_t *xb, const uint16_t *packed, int Kp, int first, int last,
                       const float *bias, const float *residual, int64_t ld_res, float *y,
                       int64_t ldy, int M, int N) {
    __m512 acc[VEC_ROWS];
    for (int b = first; b < last; ++b) {
        const uint16_t *wp = packed + (int64_t)b * Kp * COLS;
        const int col = b * COLS, ncols = N - col < COLS ? N - col : COLS;
        for (int m0 = 0; m0 < M; m0 += VEC_ROWS) {
            const int rows = M - m0 < VEC_ROWS ? M - m0 : VEC_ROWS;
            vec_tile_dispatch(rows, xb + (int64_t)m0 * Kp, Kp, wp, acc);
            store_rows(acc, rows, ncols, bias != NULL ? bias + col : NULL,
                       residual != NULL ? residual + m0 * ld_res + col : NULL, ld_res,
                       y + m0 * ldy + col, ldy);
        }
    }
}

#endif /* PG_BF16 */

#if defined(PG_BF16_AMX)

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) bf16_tile_config;

/* tiles 0-3: accumulators of the chunk's blocks; 4: A (x rows); 5, 6: B (alternating) */
static void configure_tiles(int rows) {
    bf16_tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 7; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t >= 5 ? GROUP / 2 : rows;
    }
    /* NOTE: GCC declares ldtilecfg's operand as 8 bytes: without the barrier the stores of the
     * other 56 may be dropped as dead (as in linear_amx.c) */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

#define PG_PRODUCT(C, BT, n)                                                              \
    do {                                                                                  \
        _tile_loadd(BT, packed + ((int64_t)(b0 + (n)) * Kp + (int64_t)g * GROUP) * COLS, 64); \
        _tile_dpbf16ps(C, 4, BT);                                                         \
    } while (0)

/* Column blocks [first, last) for every row tile of 16 rows, on AMX tiles. */
static void amx_blocks(const uint16_t *xb, const uint16_t *packed, int Kp, int first, int last,
                       const float *bias, const float *residual, int64_t ld_res, float *y,
                       int64_t ldy, int M, int N) {
    float c[AMX_CHUNK][16 * COLS] __attribute__((aligned(64)));
    __m512 acc[16];
    const int groups = Kp / GROUP;
    configure_tiles(16);
    /* the chunk's weights (4 x Kp x 32 bytes) stay in L2 across the row tiles */
    for (int b0 = first; b0 < last; b0 += AMX_CHUNK) {
        const int nb = last - b0 < AMX_CHUNK ? last - b0 : AMX_CHUNK;
        for (int m0 = 0; m0 < M; m0 += 16) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int g = 0; g < groups; ++g) {
                _tile_loadd(4, xb + (int64_t)m0 * Kp + g * GROUP, Kp * sizeof(uint16_t));
                PG_PRODUCT(0, 5, 0);
                if (nb > 1) PG_PRODUCT(1, 6, 1);
                if (nb > 2) PG_PRODUCT(2, 5, 2);
                if (nb > 3) PG_PRODUCT(3, 6, 3);
            }
            _tile_stored(0, c[0], COLS * sizeof(float));
            _tile_stored(1, c[1], COLS * sizeof(float));
            _tile_stored(2, c[2], COLS * sizeof(float));
            _tile_stored(3, c[3], COLS * sizeof(float));
            const int rows = M - m0 < 16 ? M - m0 : 16;
            for (int n = 0; n < nb; ++n) {
                const int col = (b0 + n) * COLS, ncols = N - col < COLS ? N - col : COLS;
                for (int r = 0; r < rows; ++r) acc[r] = _mm512_load_ps(c[n] + r * COLS);
                store_rows(acc, rows, ncols, bias != NULL ? bias + col : NULL,
                           residual != NULL ? residual + m0 * ld_res + col : NULL, ld_res,
                           y + m0 * ldy + col, ldy);
            }
        }
    }
    _tile_release();
}

#undef PG_PRODUCT

#endif /* PG_BF16_AMX */

/*
 * x:        [M, K] fp32 rows at ldx (dense within a row)
 * packed:   [ceil(N / 16), Kp / 2, 16, 2] bf16 (see above)
 * bias:     [N] or NULL; residual: [M, N] rows at ld_res, or NULL (y = residual + x W^T)
 * y:        [M, N] fp32 rows at ldy (may be residual itself)
 * amx_min_rows: from this many rows, AMX tiles where available.
 * Work is split over column blocks, one contiguous range per thread. Returns 0, or -1 (nothing
 * written) where this build has no AVX512-BF16 or the workspace cannot be allocated.
 */
int pg_linear_bf16(const float *x, int64_t ldx, const uint16_t *packed, const float *bias,
                   const float *residual, int64_t ld_res, float *y, int64_t ldy, int M, int N,
                   int K, int amx_min_rows, int num_threads) {
#if defined(PG_BF16)
    const int blocks = (N + COLS - 1) / COLS, Kp = (K + GROUP - 1) / GROUP * GROUP;
    if (M < 0 || K < 1) return -1;
    if (blocks == 0 || M == 0) return 0;
    int amx = 0;
#if defined(PG_BF16_AMX)
    amx = M >= amx_min_rows && pg_amx_available();
#else
    (void)amx_min_rows;
#endif
    const int padded = amx ? (M + 15) / 16 * 16 : M;
    /* allocated before anything is written: y may be the residual itself */
    uint16_t *xb = aligned_alloc(64, ((size_t)padded * Kp * sizeof(uint16_t) + 63) / 64 * 64);
    if (xb == NULL) return -1;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > blocks) num_threads = blocks;
#pragma omp parallel num_threads(num_threads)
    {
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        round_rows(x, ldx, (int)((int64_t)padded * t / threads),
                   (int)((int64_t)padded * (t + 1) / threads), M, K, Kp, xb);
#pragma omp barrier
        const int first = (int)((int64_t)blocks * t / threads);
        const int last = (int)((int64_t)blocks * (t + 1) / threads);
#if defined(PG_BF16_AMX)
        if (amx && first < last)
            amx_blocks(xb, packed, Kp, first, last, bias, residual, ld_res, y, ldy, M, N);
        else
#endif
            vec_blocks(xb, packed, Kp, first, last, bias, residual, ld_res, y, ldy, M, N);
    }
    free(xb);
    return 0;
#else
    (void)x, (void)ldx, (void)packed, (void)bias, (void)residual, (void)ld_res, (void)y;
    (void)ldy, (void)M, (void)N, (void)K, (void)amx_min_rows, (void)num_threads;
    return -1;
#endif
}
