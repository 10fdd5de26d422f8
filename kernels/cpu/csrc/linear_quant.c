/* Weight-only quantized linear layer on CPU: y = x . W^T (+ bias) (+ residual), W in ggml's
 * Q4_0 / Q4_1 / Q8_0 blocks, repacked for streaming; x, y and the accumulation in fp32.
 *
 * Why: a decode step reads every weight of the model once, from DRAM (linear.c: 540 MB of fp32
 * per SmolLM2 step). The GGUF's own blocks are 0.5625 (Q4_0), 0.625 (Q4_1) and 1.0625 (Q8_0)
 * bytes per weight, so the same step streams ~96 MB; the weights are expanded to fp32 in
 * vector registers right before their FMAs and never written anywhere.
 *
 * Exactness: every weight is the value gguf's dequantize gives, bit for bit (the fidelity
 * tests compare against transformers on those values): Q8_0 d * q and Q4_0 d * (q - 8) are
 * exact products in fp32 (an fp16 d times a small integer); Q4_1 fma(q, d, m) rounds once,
 * like d * q + m, since d * q is exact. Summation order is the fp32 kernel's (linear.c): one
 * accumulator per output, k = 0, 1, ..., K - 1, so an output does not depend on the batch it
 * runs in, nor on which of the two paths below computes it.
 *
 * Packed layout (kernels/cpu/ops.py packs it): W [N, K] becomes [ceil(N / 16)][K / 32]
 * groups of 16 output columns x 32 k, zero-padded past N. One group:
 *   Q4_0 (288 B): d[16] fp16 | q[16][16] bytes, byte j*16 + c: k = 2j (low nibble), 2j + 1
 *   Q4_1 (320 B): d[16] fp16 | m[16] fp16 | q as Q4_0
 *   Q8_0 (544 B): d[16] fp16 | q[32][16] int8, byte k*16 + c
 * so a column block is one contiguous stream and each k-step reads 16 adjacent columns.
 *
 * Two paths:
 *   * rows <= scratch_min_rows (16, kernels/cpu/ops.py; decode): registers only. A tile
 *     is R rows x NB column blocks (NB > 1 for few rows, so that at least ~8 independent
 *     FMA chains hide the FMA latency: one row of one block is a single dependent chain of
 *     K FMAs).
 *   * more rows (prefill): each thread dequantizes one column block at a time into a
 *     K x 16 fp32 scratch tile (K * 64 bytes: 36 KB at K = 576, L1/L2-resident) and runs
 *     linear.c's pg_linear_f32 over it for all row tiles: prefill is compute-bound, the
 *     dequantization is paid once per block, and no second fp32 copy of W is ever kept.
 *
 * Few rows are DRAM-bound and gain the ~5x smaller stream; from 16 rows the step is FMA-bound
 * and the expansion costs 7 vector ops per 32 weights (zero-extend, and, shift, 2 converts,
 * 2 FMAs for d * q + m) beside the 32 FMAs of a 16-row tile: ~20% more work on ports 0 and 5,
 * which the FMAs use too on Intel cores (cores with separate integer/convert pipes should
 * hide more of it). The FMAs themselves (fp32 activations, exact fp32 weights) cannot be
 * fewer, and the scratch path is no faster there (it pays the expansion plus a store and a
 * reload per 16 weights), so rows 17-64 run somewhat behind fp32; from a few hundred rows the
 * expansion, once per block, vanishes. The figures per row count and for the whole model are
 * in docs/benchmarks.md (benchmarks/linear.py, benchmarks/model.py --fp32-baseline).
 * The prefetch distance (1 KB into L2, ~3 groups ahead) could not be told apart from none on a
 * loaded machine; it is kept as linear.c's measurements favour one, and is worth re-measuring
 * on a quiet machine.
 * Not used: torch's _weight_int4pack_mm_for_cpu takes fp32 scale/zero per group for fp32
 * inputs but computes (q - 8) * s + z with its own rounding (off by up to 1 ulp of the weight
 * on an identity input), and a Q4_1 zero would be m + 8d, itself rounded: not the dequantized
 * values. _weight_int8pack_mm has one scale per output channel, not per 32 weights.
 *
 * Where the CPU has AMX-BF16, kernels/cpu/ops.py runs linear_amx.c instead from
 * QUANT_AMX_MIN_ROWS (12) rows: as accurate, not bit-identical, and faster from there on.
 *
 * Built with the other sources into one library by kernels/cpu/library.py.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "quant_groups.h"

/* bytes of one packed group (16 columns x 32 k) of `qtype`, 0 when not handled */
int pg_quant_group_bytes(int qtype) { return quant_group_bytes(qtype); }

/* 1 where this build has AVX-512 (the only build of the matrix kernels; see linear.c's
 * pg_linear_preferred). Elsewhere callers dequantize and use their fp32 path. */
int pg_linear_quant_preferred(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* IEEE half -> float, exact (subnormals, inf, nan included); portable scalar code for the
 * row gather, which touches few values. */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float value;
    memcpy(&value, &bits, sizeof(value));
    return value;
}

/* One quantized weight of a packed column block, at column c (< 16) and row k. */
static inline float packed_value(int qtype, const uint8_t *block, int c, int k) {
    const uint8_t *gp = block + (int64_t)(k / GROUP) * pg_quant_group_bytes(qtype);
    uint16_t bits;
    memcpy(&bits, gp + 2 * c, sizeof(bits));
    const float d = half_to_float(bits);
    const int kk = k % GROUP;
    if (qtype == PG_Q8_0) return d * (float)(int8_t)gp[2 * COLS + kk * COLS + c];
    const uint8_t *qs = gp + (qtype == PG_Q4_1 ? 4 * COLS : 2 * COLS);
    const uint8_t byte = qs[(kk / 2) * COLS + c];
    const int q = kk % 2 ? byte >> 4 : byte & 0xf;
    if (qtype == PG_Q4_0) return d * (float)(q - 8);
    memcpy(&bits, gp + 2 * COLS + 2 * c, sizeof(bits));
    return __builtin_fmaf((float)q, d, half_to_float(bits));
}

/*
 * Rows `ids` of W (an embedding table stored as the packed weight of its tied LM head):
 * out[t, :] = W[ids[t], :], dequantized exactly. Returns the first bad id's index + 1, or 0;
 * nothing is written when an id is outside [0, N).
 */
int64_t pg_quant_rows_f32(int qtype, const uint8_t *packed, int64_t N, int K, const int64_t *ids,
                          int64_t num_ids, float *out, int64_t ldo, int num_threads) {
    for (int64_t t = 0; t < num_ids; ++t)
        if (ids[t] < 0 || ids[t] >= N) return t + 1;
    const int64_t block_bytes = (int64_t)(K / GROUP) * pg_quant_group_bytes(qtype);
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_ids > 8)
    for (int64_t t = 0; t < num_ids; ++t) {
        const uint8_t *block = packed + (ids[t] / COLS) * block_bytes;
        const int c = (int)(ids[t] % COLS);
        for (int k = 0; k < K; ++k) out[t * ldo + k] = packed_value(qtype, block, c, k);
    }
    return 0;
}

#if defined(__AVX512F__)

void pg_linear_f32(const float *x, int64_t ldx, const float *packed, const float *bias,
                   const float *residual, int64_t ld_res, float *y, int64_t ldy, int M, int N,
                   int K, int num_threads); /* linear.c */

/* Prefetch distance along each block's stream (bytes, into L2). */
#define PREFETCH_BYTES 1024

static inline const void *ahead(const uint8_t *p) {
    return (const void *)((uintptr_t)p + PREFETCH_BYTES);
}

/* scale (d) and offset of a Q4 group: Q4_1 stores m; Q4_0's d * (q - 8) is fma(q, d, -8d),
 * exact since -8d and the result are representable */
static inline void q4_scales(const uint8_t *gp, int has_min, __m512 *d, __m512 *m) {
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gp));
    *m = has_min ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp + 2 * COLS)))
                 : _mm512_mul_ps(*d, _mm512_set1_ps(-8.0f));
}

/* the 16 column values of k = 2j (lo) and 2j + 1 (hi) */
static inline void q4_pair(const uint8_t *qs, int j, __m512 d, __m512 m, __m512 *lo, __m512 *hi) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + j * COLS)));
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xf))), d, m);
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d, m);
}

static inline __m512 q8_value(const uint8_t *qs, int k, __m512 d) {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + k * COLS)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
}

/* R rows x NB column blocks (R * NB <= 16 accumulators), always inlined where R and NB are
 * compile-time constants (the switch below) so the accumulators live in registers.
 * out[n * R + r]: row r of block n. */
static inline __attribute__((always_inline)) void quant_tile(
    const int qtype, const int R, const int NB, const float *x, int64_t ldx, const uint8_t *wp,
    int64_t block_bytes, int K, __m512 *out) {
    const int gb = pg_quant_group_bytes(qtype);
    const int has_min = qtype == PG_Q4_1;
    __m512 acc[16];
#pragma GCC unroll 16
    for (int i = 0; i < R * NB; ++i) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < K / GROUP; ++g) {
        const float *xg = x + g * GROUP;
        if (qtype == PG_Q8_0) {
            __m512 d[4];
            const uint8_t *qs[4];
#pragma GCC unroll 4
            for (int n = 0; n < NB; ++n) {
                const uint8_t *gp = wp + n * block_bytes + (int64_t)g * gb;
                d[n] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gp));
                qs[n] = gp + 2 * COLS;
#pragma GCC unroll 9
                for (int line = 0; line < gb; line += 64)
                    __builtin_prefetch(ahead(gp + line), 0, 2);
            }
            for (int k = 0; k < GROUP; ++k) {
#pragma GCC unroll 4
                for (int n = 0; n < NB; ++n) {
                    const __m512 w = q8_value(qs[n], k, d[n]);
#pragma GCC unroll 16
                    for (int r = 0; r < R; ++r)
                        acc[n * R + r] =
                            _mm512_fmadd_ps(_mm512_set1_ps(xg[r * ldx + k]), w, acc[n * R + r]);
                }
            }
        } else {
            __m512 d[4], m[4];
            const uint8_t *qs[4];
#pragma GCC unroll 4
            for (int n = 0; n < NB; ++n) {
                const uint8_t *gp = wp + n * block_bytes + (int64_t)g * gb;
                q4_scales(gp, has_min, &d[n], &m[n]);
                qs[n] = gp + (has_min ? 4 : 2) * COLS;
#pragma GCC unroll 5
                for (int line = 0; line < gb; line += 64)
                    __builtin_prefetch(ahead(gp + line), 0, 2);
            }
            for (int j = 0; j < GROUP / 2; ++j) {
#pragma GCC unroll 4
                for (int n = 0; n < NB; ++n) {
                    __m512 lo, hi;
                    q4_pair(qs[n], j, d[n], m[n], &lo, &hi);
#pragma GCC unroll 16
                    for (int r = 0; r < R; ++r)
                        acc[n * R + r] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * ldx + 2 * j]), lo,
                                                         acc[n * R + r]);
#pragma GCC unroll 16
                    for (int r = 0; r < R; ++r)
                        acc[n * R + r] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * ldx + 2 * j + 1]),
                                                         hi, acc[n * R + r]);
                }
            }
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R * NB; ++i) out[i] = acc[i];
}

/* Column blocks per tile for R rows: enough independent accumulators (R * NB >= ~8) to keep
 * both FMA pipes busy through the 4-cycle FMA latency. */
static inline int blocks_per_tile(int rows) { return rows <= 2 ? 4 : rows <= 7 ? 2 : 1; }

static void tile_dispatch(int qtype, int rows, int nb, const float *x, int64_t ldx,
                          const uint8_t *wp, int64_t block_bytes, int K, __m512 *out) {
#define PG_TILE(q, r, n) \
    if (qtype == q && rows == r && nb == n) { \
        quant_tile(q, r, n, x, ldx, wp, block_bytes, K, out); \
        return; \
    }
#define PG_TILES_R(r, n) PG_TILE(PG_Q4_0, r, n) PG_TILE(PG_Q4_1, r, n) PG_TILE(PG_Q8_0, r, n)
    /* every (rows, blocks_per_tile(rows)) and (rows, 1) for a thread's last blocks */
    PG_TILES_R(1, 4) PG_TILES_R(2, 4) PG_TILES_R(3, 2) PG_TILES_R(4, 2) PG_TILES_R(5, 2)
    PG_TILES_R(6, 2) PG_TILES_R(7, 2)
    PG_TILES_R(1, 1) PG_TILES_R(2, 1) PG_TILES_R(3, 1) PG_TILES_R(4, 1) PG_TILES_R(5, 1)
    PG_TILES_R(6, 1) PG_TILES_R(7, 1) PG_TILES_R(8, 1) PG_TILES_R(9, 1) PG_TILES_R(10, 1)
    PG_TILES_R(11, 1) PG_TILES_R(12, 1) PG_TILES_R(13, 1) PG_TILES_R(14, 1) PG_TILES_R(15, 1)
    PG_TILES_R(16, 1)
#undef PG_TILES_R
#undef PG_TILE
}


/* Column block -> fp32 [K][16] (linear.c's packed layout), same values as the tiles use. */
static void dequantize_block(int qtype, const uint8_t *wp, int K, float *scratch) {
    const int gb = pg_quant_group_bytes(qtype);
    for (int g = 0; g < K / GROUP; ++g) {
        const uint8_t *gp = wp + (int64_t)g * gb;
        float *dst = scratch + (int64_t)g * GROUP * COLS;
        if (qtype == PG_Q8_0) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gp));
            for (int k = 0; k < GROUP; ++k)
                _mm512_store_ps(dst + k * COLS, q8_value(gp + 2 * COLS, k, d));
        } else {
            const int has_min = qtype == PG_Q4_1;
            __m512 d, m, lo, hi;
            q4_scales(gp, has_min, &d, &m);
            for (int j = 0; j < GROUP / 2; ++j) {
                q4_pair(gp + (has_min ? 4 : 2) * COLS, j, d, m, &lo, &hi);
                _mm512_store_ps(dst + 2 * j * COLS, lo);
                _mm512_store_ps(dst + (2 * j + 1) * COLS, hi);
            }
        }
    }
}

#endif /* __AVX512F__ */

/*
 * x:        [M, K] rows at ldx (row-major, dense within a row); K a multiple of 32
 * packed:   [ceil(N / 16), K / 32, group bytes] (see above)
 * bias:     [N] or NULL; residual: [M, N] rows at ld_res, or NULL (y = residual + x W^T)
 * y:        [M, N] rows at ldy (may be residual itself)
 * scratch_min_rows: more rows than this take the dequantize-to-scratch path
 * Work is split over column blocks, one contiguous range per thread. Returns 0, or -1 when
 * this build has no kernel (not AVX-512) or the type is unknown (nothing written).
 */
int pg_linear_quant_f32(int qtype, const float *x, int64_t ldx, const uint8_t *packed,
                        const float *bias, const float *residual, int64_t ld_res, float *y,
                        int64_t ldy, int M, int N, int K, int scratch_min_rows, int num_threads) {
#if defined(__AVX512F__)
    if (pg_quant_group_bytes(qtype) == 0 || K % GROUP) return -1;
    const int blocks = (N + COLS - 1) / COLS;
    const int64_t block_bytes = (int64_t)(K / GROUP) * pg_quant_group_bytes(qtype);
    if (num_threads < 1) num_threads = 1;
    if (blocks == 0) return 0;
    if (num_threads > blocks) num_threads = blocks;
#pragma omp parallel num_threads(num_threads)
    {
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int first = (int)((int64_t)blocks * t / threads);
        const int last = (int)((int64_t)blocks * (t + 1) / threads);
        /* NOTE: without its scratch tile (allocation failed) a thread takes the register path */
        float *scratch =
            M > scratch_min_rows ? aligned_alloc(64, (size_t)K * COLS * sizeof(float)) : NULL;
        if (scratch != NULL) {
            for (int b = first; b < last; ++b) {
                const int col = b * COLS;
                const int ncols = N - col < COLS ? N - col : COLS;
                dequantize_block(qtype, packed + b * block_bytes, K, scratch);
                pg_linear_f32(x, ldx, scratch, bias != NULL ? bias + col : NULL,
                              residual != NULL ? residual + col : NULL, ld_res, y + col, ldy, M,
                              ncols, K, 1);
            }
            free(scratch);
        } else {
            /* up to 4 blocks (~10-40 KB) at a time are reused, from L1/L2, by every row tile */
            for (int b0 = first; b0 < last; b0 += 4) {
                const int b1 = last - b0 < 4 ? last : b0 + 4;
                for (int m0 = 0; m0 < M; m0 += 16) {
                    const int rows = M - m0 < 16 ? M - m0 : 16;
                    const int per_tile = blocks_per_tile(rows);
                    for (int b = b0; b < b1;) {
                        const int nb = b1 - b >= per_tile ? per_tile : 1;
                        __m512 acc[16];
                        tile_dispatch(qtype, rows, nb, x + m0 * ldx, ldx, packed + b * block_bytes,
                                      block_bytes, K, acc);
                        for (int n = 0; n < nb; ++n, ++b) {
                            const int col = b * COLS;
                            const int ncols = N - col < COLS ? N - col : COLS;
                            store_tile(acc + n * rows, rows, ncols,
                                       bias != NULL ? bias + col : NULL,
                                       residual != NULL ? residual + m0 * ld_res + col : NULL,
                                       ld_res, y + m0 * ldy + col, ldy);
                        }
                    }
                }
            }
        }
    }
    return 0;
#else
    (void)qtype, (void)x, (void)ldx, (void)packed, (void)bias, (void)residual, (void)ld_res;
    (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)scratch_min_rows, (void)num_threads;
    return -1;
#endif
}
