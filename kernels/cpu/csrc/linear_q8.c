/* Quantized linear layer with int8 activations (the --dtype q8 mode, docs/precision.md):
 * y = x . W^T (+ bias) (+ residual), W in ggml Q4_0 / Q4_1 / Q8_0 blocks, each row of x
 * quantized once per call to int8 in blocks of 32 (llama.cpp's q8_0 / q8_1 activations), the
 * products of a block summed exactly in int32 with AVX512-VNNI (VPDPBUSD: u8 x s8 -> s32),
 * then scaled by d_w * d_x and summed over blocks in fp32; bias, residual and y in fp32.
 *
 * Why: linear_quant.c expands every weight to fp32 and runs 32 FMAs per 16 columns x 32 k and
 * row; here one VPDPBUSD does 16 columns x 4 k, so a block of 32 k costs 8 of them (plus 2
 * per 16 columns to scale and add), and the stream stays the GGUF's bytes.
 *
 * Activations (quantize_rows): per row, per 32 k: amax = max |x|, d = amax * (1 / 127),
 * q = round-half-even(x * (127 / amax)) in [-127, 127] (0 where amax is 0), s = sum of q.
 * d stays fp32 (llama.cpp rounds it to fp16). kernels/cpu/ops.py's torch reference computes
 * the same q bit for bit (the explicit reciprocal constant keeps -ffast-math from changing d).
 *
 * Per block of 32 k, column c, row r, with Q = the weight quants and q the row's:
 *   Q4_0: w = d_w (Q - 8), Q in 0..15:  d_w d_x (sum Q q - 8 s)
 *   Q8_0: w = d_w Q, Q in -128..127, stored as U = Q + 128:  d_w d_x (sum U q - 128 s)
 *   Q4_1: w = d_w Q + m_w:  d_w d_x sum Q q + m_w (d_x s)
 * The integer parts are exact (|sum| < 2^21); VPDPBUSD takes u8 weights, so Q8_0's are
 * offset by 128 at load instead of llama.cpp's sign trick (abs / sign per vector per call).
 *
 * Packed layout (kernels/cpu/ops.py pack_q8_weight): W [N, K] becomes [ceil(N / 16)][K / 32]
 * groups of 16 columns x 32 k, zero past N, the same group bytes as linear_quant.c's:
 *   Q4_0 (288 B): d[16] fp16 | 4 x 64 B:  vector p, byte 4c + b = Q[c][4p + b] | Q[c][16 + 4p + b] << 4
 *   Q4_1 (320 B): d[16] fp16 | m[16] fp16 | as Q4_0
 *   Q8_0 (544 B): d[16] fp16 | 8 x 64 B:  vector p, byte 4c + b = Q[c][4p + b] + 128
 * Repacked at load, not linear_quant.c's layout: VPDPBUSD sums 4 consecutive bytes of a 32-bit
 * lane into that lane, so each column's 4 consecutive k must share a dword; linear_quant.c puts
 * the 16 columns of one k side by side, which would need a byte transpose per 64 bytes. For Q4
 * the vector's bytes are the GGUF's own nibble bytes (byte j holds k = j and j + 16), reordered.
 *
 * One path for every row count: a row's sums are the same ops in the same order whatever the
 * other rows of the call, so a row's output is bit-identical alone and batched, in a prefill
 * and in a decode step. Work is split over column blocks; a tile is R rows x NB blocks (R * NB
 * <= 8 int32 + 8 fp32 accumulators in registers), chunks of 4 blocks reused by every row tile.
 *
 * Built with the other sources into one library by kernels/cpu/library.py; a stub answering -1
 * where the build lacks AVX512-VNNI / AVX512-BW (the mode is then refused, never emulated).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PG_Q8 1
#include <immintrin.h>
#endif

#include "quant_groups.h"

#define TILE_ROWS 4
#define CHUNK 4 /* column blocks a thread's row tiles share (~20-60 KB, L1/L2) */
#define PREFETCH_BYTES 1024


/* 1 where this build has AVX512-VNNI and AVX512-BW: the --dtype q8 mode runs here. */
int pg_linear_q8_preferred(void) {
#if defined(PG_Q8)
    return 1;
#else
    return 0;
#endif
}

#if defined(PG_Q8)

/* Quantized rows of x: q [M][K] int8, and per row and block d (fp32), s (int32), d * s. */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int32_t *s;
    int groups;
} QRows;

static void quantize_row(const float *x, int K, int8_t *q, float *d, int32_t *s, float *ds) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i inf_bits = _mm512_set1_epi32(0x7f800000);
    for (int g = 0; g < K / GROUP; ++g) {
        const __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
        const __m512 abs_a = _mm512_andnot_ps(sign, a), abs_b = _mm512_andnot_ps(sign, b);
        /* NOTE: an inf or NaN input makes the block's scale NaN, so the row's outputs are NaN
         * as the fp32 path's would be, never finite garbage (the bits are compared as
         * integers: -ffast-math assumes finite floats) */
        const __mmask16 bad = _mm512_cmpge_epu32_mask(_mm512_castps_si512(abs_a), inf_bits) |
                              _mm512_cmpge_epu32_mask(_mm512_castps_si512(abs_b), inf_bits);
        const float amax = bad ? 0.0f : _mm512_reduce_max_ps(_mm512_max_ps(abs_a, abs_b));
        /* a builtin division: -ffast-math may not turn it into a reciprocal (the reference
         * in kernels/cpu/ops.py divides exactly) */
        const float inv =
            amax > 0.0f ? _mm_cvtss_f32(_mm_div_ss(_mm_set_ss(127.0f), _mm_set_ss(amax))) : 0.0f;
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)), round);
        const __m512i qb = _mm512_cvt_roundps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)), round);
        _mm_storeu_si128((__m128i *)(q + g * GROUP), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(q + g * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
        d[g] = bad ? _mm_cvtss_f32(_mm_castsi128_ps(_mm_set1_epi32(0x7fc00000)))
                   : amax * (1.0f / 127.0f);
        s[g] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
        ds[g] = d[g] * (float)s[g];
    }
}

static int quantize_rows(const float *x, int64_t ldx, int M, int K, int num_threads, QRows *out) {
    const int groups = K / GROUP;
    out->groups = groups;
    out->q = malloc((size_t)M * K + 64);
    out->d = malloc((size_t)M * groups * sizeof(float));
    out->ds = malloc((size_t)M * groups * sizeof(float));
    out->s = malloc((size_t)M * groups * sizeof(int32_t));
    if (!out->q || !out->d || !out->ds || !out->s) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M > 4)
    for (int r = 0; r < M; ++r)
        quantize_row(x + r * ldx, K, out->q + (int64_t)r * K, out->d + (int64_t)r * groups,
                     out->s + (int64_t)r * groups, out->ds + (int64_t)r * groups);
    return 0;
}

static void free_rows(QRows *rows) {
    free(rows->q), free(rows->d), free(rows->ds), free(rows->s);
}

static inline __m512i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof(v));
    return _mm512_set1_epi32(v);
}

/* R rows (from row m0 of xr) x NB column blocks, every group; always inlined where R and NB
 * are compile-time constants so the accumulators stay in registers. out[n * R + r]. */
static inline __attribute__((always_inline)) void q8_tile(
    const int qtype, const int R, const int NB, const QRows *xr, int m0, int K,
    const uint8_t *wp, int64_t block_bytes, __m512 *out) {
    const int gb = quant_group_bytes(qtype), groups = xr->groups;
    const int quant_offset = qtype == PG_Q4_1 ? 4 * COLS : 2 * COLS;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < R * NB; ++i) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        const int8_t *xg = xr->q + (int64_t)m0 * K + g * GROUP;
        const uint8_t *gp[4];
        __m512i isum[8];
#pragma GCC unroll 8
        for (int i = 0; i < R * NB; ++i) isum[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) {
            gp[n] = wp + n * block_bytes + (int64_t)g * gb;
#pragma GCC unroll 9
            for (int line = 0; line < gb; line += 64)
                __builtin_prefetch((const void *)((uintptr_t)gp[n] + PREFETCH_BYTES + line), 0, 2);
        }
        if (qtype == PG_Q8_0) {
#pragma GCC unroll 8
            for (int p = 0; p < 8; ++p) {
#pragma GCC unroll 4
                for (int n = 0; n < NB; ++n) {
                    const __m512i w = _mm512_loadu_si512(gp[n] + quant_offset + 64 * p);
#pragma GCC unroll 4
                    for (int r = 0; r < R; ++r)
                        isum[n * R + r] = _mm512_dpbusd_epi32(isum[n * R + r], w,
                                                              broadcast4(xg + r * K + 4 * p));
                }
            }
        } else {
#pragma GCC unroll 4
            for (int p = 0; p < 4; ++p) {
#pragma GCC unroll 4
                for (int n = 0; n < NB; ++n) {
                    const __m512i v = _mm512_loadu_si512(gp[n] + quant_offset + 64 * p);
                    const __m512i lo = _mm512_and_si512(v, low);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 4
                    for (int r = 0; r < R; ++r) {
                        isum[n * R + r] = _mm512_dpbusd_epi32(isum[n * R + r], lo,
                                                              broadcast4(xg + r * K + 4 * p));
                        isum[n * R + r] = _mm512_dpbusd_epi32(
                            isum[n * R + r], hi, broadcast4(xg + r * K + 16 + 4 * p));
                    }
                }
            }
        }
#pragma GCC unroll 4
        for (int n = 0; n < NB; ++n) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gp[n]));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const int64_t at = (int64_t)(m0 + r) * groups + g;
                const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xr->d[at]));
                __m512i sum = isum[n * R + r];
                if (qtype != PG_Q4_1)
                    sum = _mm512_sub_epi32(
                        sum, _mm512_set1_epi32((qtype == PG_Q4_0 ? 8 : 128) * xr->s[at]));
                acc[n * R + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[n * R + r]);
                if (qtype == PG_Q4_1) {
                    const __m512 mw =
                        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp[n] + 2 * COLS)));
                    acc[n * R + r] =
                        _mm512_fmadd_ps(mw, _mm512_set1_ps(xr->ds[at]), acc[n * R + r]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R * NB; ++i) out[i] = acc[i];
}

/* blocks per tile for R rows: R * NB <= 8 independent VPDPBUSD chains */
static inline int blocks_per_tile(int rows) { return rows <= 2 ? 4 : 2; }

static void tile_dispatch(int qtype, int rows, int nb, const QRows *xr, int m0, int K,
                          const uint8_t *wp, int64_t block_bytes, __m512 *out) {
#define PG_TILE(q, r, n) \
    if (qtype == q && rows == r && nb == n) { \
        q8_tile(q, r, n, xr, m0, K, wp, block_bytes, out); \
        return; \
    }
#define PG_TILES_R(r, n) PG_TILE(PG_Q4_0, r, n) PG_TILE(PG_Q4_1, r, n) PG_TILE(PG_Q8_0, r, n)
    PG_TILES_R(1, 4) PG_TILES_R(2, 4) PG_TILES_R(3, 2) PG_TILES_R(4, 2)
    PG_TILES_R(1, 1) PG_TILES_R(2, 1) PG_TILES_R(3, 1) PG_TILES_R(4, 1)
#undef PG_TILES_R
#undef PG_TILE
}


/* Column blocks [first, last) for every row: chunks of CHUNK blocks, row tiles of TILE_ROWS. */
static void q8_blocks(int qtype, const QRows *xr, const uint8_t *packed, int64_t block_bytes,
                      const float *bias, const float *residual, int64_t ld_res, float *y,
                      int64_t ldy, int M, int N, int K, int first, int last) {
    for (int b0 = first; b0 < last; b0 += CHUNK) {
        const int b1 = last - b0 < CHUNK ? last : b0 + CHUNK;
        for (int m0 = 0; m0 < M; m0 += TILE_ROWS) {
            const int rows = M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS;
            const int per_tile = blocks_per_tile(rows);
            for (int b = b0; b < b1;) {
                const int nb = b1 - b >= per_tile ? per_tile : 1;
                __m512 acc[8];
                tile_dispatch(qtype, rows, nb, xr, m0, K, packed + b * block_bytes, block_bytes,
                              acc);
                for (int n = 0; n < nb; ++n, ++b) {
                    const int col = b * COLS;
                    const int ncols = N - col < COLS ? N - col : COLS;
                    store_tile(acc + n * rows, rows, ncols, bias != NULL ? bias + col : NULL,
                               residual != NULL ? residual + m0 * ld_res + col : NULL, ld_res,
                               y + m0 * ldy + col, ldy);
                }
            }
        }
    }
}

#endif /* PG_Q8 */

/*
 * x:        [M, K] fp32 rows at ldx (dense within a row); K a multiple of 32
 * packed:   [ceil(N / 16), K / 32, group bytes] (see above)
 * bias:     [N] or NULL; residual: [M, N] rows at ld_res, or NULL (y = residual + x W^T)
 * y:        [M, N] rows at ldy (may be residual itself)
 * Returns 0; -1 (nothing written) when this build lacks AVX512-VNNI, the type is unknown or
 * K is not a multiple of 32; -2 when the activation buffers could not be allocated.
 */
int pg_linear_q8(int qtype, const float *x, int64_t ldx, const uint8_t *packed, const float *bias,
                 const float *residual, int64_t ld_res, float *y, int64_t ldy, int M, int N, int K,
                 int num_threads) {
#if defined(PG_Q8)
    if (quant_group_bytes(qtype) == 0 || K % GROUP) return -1;
    const int blocks = (N + COLS - 1) / COLS;
    const int64_t block_bytes = (int64_t)(K / GROUP) * quant_group_bytes(qtype);
    if (num_threads < 1) num_threads = 1;
    if (blocks == 0 || M == 0) return 0;
    QRows xr;
    if (quantize_rows(x, ldx, M, K, num_threads, &xr) != 0) {
        free_rows(&xr);
        return -2;
    }
    const int threads_used = num_threads > blocks ? blocks : num_threads;
#pragma omp parallel num_threads(threads_used)
    {
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int first = (int)((int64_t)blocks * t / threads);
        const int last = (int)((int64_t)blocks * (t + 1) / threads);
        q8_blocks(qtype, &xr, packed, block_bytes, bias, residual, ld_res, y, ldy, M, N, K, first,
                  last);
    }
    free_rows(&xr);
    return 0;
#else
    (void)qtype, (void)x, (void)ldx, (void)packed, (void)bias, (void)residual, (void)ld_res;
    (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
#endif
}

/*
 * Rows `ids` of W in this layout (the embedding table tied to a q8 LM head), dequantized
 * exactly as gguf does (no activation quantization: a gather, not a product). Returns the
 * first bad id's index + 1, -1 where this build has no kernel, or 0.
 */
int64_t pg_q8_rows_f32(int qtype, const uint8_t *packed, int64_t N, int K, const int64_t *ids,
                       int64_t num_ids, float *out, int64_t ldo, int num_threads) {
#if defined(PG_Q8)
    if (quant_group_bytes(qtype) == 0 || K % GROUP) return -1;
    for (int64_t t = 0; t < num_ids; ++t)
        if (ids[t] < 0 || ids[t] >= N) return t + 1;
    const int gb = quant_group_bytes(qtype);
    const int64_t block_bytes = (int64_t)(K / GROUP) * gb;
    const int quant_offset = qtype == PG_Q4_1 ? 4 * COLS : 2 * COLS;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (num_ids > 8)
    for (int64_t t = 0; t < num_ids; ++t) {
        const uint8_t *block = packed + (ids[t] / COLS) * block_bytes;
        const int c = (int)(ids[t] % COLS);
        for (int k = 0; k < K; ++k) {
            const uint8_t *gp = block + (int64_t)(k / GROUP) * gb;
            uint16_t bits;
            memcpy(&bits, gp + 2 * c, sizeof(bits));
            const float d = _cvtsh_ss(bits);
            const int kk = k % GROUP;
            float value;
            if (qtype == PG_Q8_0) {
                const int u = gp[quant_offset + (kk / 4) * 64 + 4 * c + kk % 4];
                value = d * (float)(u - 128);
            } else {
                const int j = kk % 16;
                const uint8_t byte = gp[quant_offset + (j / 4) * 64 + 4 * c + j % 4];
                const int q = kk < 16 ? byte & 0xf : byte >> 4;
                if (qtype == PG_Q4_0) {
                    value = d * (float)(q - 8);
                } else {
                    memcpy(&bits, gp + 2 * COLS + 2 * c, sizeof(bits));
                    value = __builtin_fmaf((float)q, d, _cvtsh_ss(bits));
                }
            }
            out[t * ldo + k] = value;
        }
    }
    return 0;
#else
    (void)qtype, (void)packed, (void)N, (void)K, (void)ids, (void)num_ids, (void)out, (void)ldo;
    (void)num_threads;
    return -1;
#endif
}
