/* MXFP4 linear layer on CPU: y = x . W^T (+ bias), W in OCP microscaling FP4 blocks (gpt-oss's
 * expert weights), x, y and the accumulation in fp32.
 *
 * Why: gpt-oss ships its experts (over 90% of its parameters) as MXFP4, 4.25 bits per weight.
 * Expanded to fp32 at load, gpt-oss-20b's experts alone would take ~75 GB and every decode step
 * would stream 7.5x the bytes. Here the blocks stay as they are in memory and are expanded to
 * fp32 in vector registers right before their FMAs, never written anywhere.
 *
 * Format (one block = 32 consecutive k of one output row):
 *   scale: one e8m0 byte e, the power of two 2^(e - 127) (e = 0: 2^-127, as ggml);
 *   16 bytes of e2m1 nibbles, byte j = value j (low nibble) | value j + 16 (high nibble), as
 *   ggml's block_mxfp4 orders them (HF's ``*_blocks`` pair values 2j, 2j + 1 in byte j: the
 *   loader reorders them once, kernels/torch_cpu/mxfp4.py);
 *   e2m1 nibble s eem: (-1)^s * {0, 0.5, 1, 1.5, 2, 3, 4, 6}[eem].
 * Layout: nibbles [N][K / 32][16] bytes, scales [N][K / 32] bytes (row n's blocks contiguous).
 *
 * Exactness: every weight is e2m1 * 2^(e - 127), exact in fp32 (3 significant bits times a
 * power of two, in range for every e but 255, which is inf as in ggml), the value gguf's and
 * transformers' dequantizers give. The activations are NOT quantized: x stays fp32, so the
 * only difference from "dequantize, then an fp32 matmul" is the fp32 summation order (a
 * 16-lane (AVX-512), 8-lane (AVX2) or sequential (C) accumulator over k, then one horizontal
 * sum): |error| <= ~K * 2^-24 * sum_k |x_k w_k| (the bound tests/kernels/test_linear_mxfp4.py
 * checks). A row's output is the same sequence of operations whatever the other rows of the
 * call, so a token's output is bit-identical alone and batched, in a prefill and a decode step.
 *
 * Three paths, all built where the compiler targets them (-march=native), chosen by `path`:
 * AVX-512 (a 16-entry VPERMPS table lookup per 16 nibbles), AVX2 (an 8-entry VPERMPS on the
 * magnitude, the sign bit moved into place: 8 nibbles), and plain C (a table lookup). Zen 4
 * and Sapphire Rapids run AVX-512; an AVX2-only host the second; anything else the third.
 *
 * Tiles: AVX-512 runs up to 4 rows x 4 output columns (16 zmm accumulators, 8 decoded weight
 * vectors), the block decoded once per tile and used by every row; work is split over output
 * columns, the whole K per column (no split-K: the order of a column's sums stays fixed).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PG_MX_AVX2 1
#endif
#if defined(__AVX512F__)
#define PG_MX_AVX512 1
#endif

#define MX_BLOCK 32
#define MX_BYTES 16
#define MX_ROWS 4 /* activation rows per tile */
#define MX_COLS 4 /* output columns per AVX-512 tile */

enum { MX_PATH_BEST = 0, MX_PATH_C = 1, MX_PATH_AVX2 = 2, MX_PATH_AVX512 = 3 };

/* e2m1 values, indexed by the nibble */
static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline float e8m0_scale(uint8_t e) {
    const uint32_t bits = e == 0 ? 0x00400000u : (uint32_t)e << 23;
    float scale;
    memcpy(&scale, &bits, sizeof(scale));
    return scale;
}

/* The best path this build has (3 AVX-512, 2 AVX2, 1 plain C). */
int pg_linear_mxfp4_best(void) {
#if defined(PG_MX_AVX512)
    return MX_PATH_AVX512;
#elif defined(PG_MX_AVX2)
    return MX_PATH_AVX2;
#else
    return MX_PATH_C;
#endif
}

typedef struct {
    const float *x;
    int64_t ldx;
    const uint8_t *nibbles, *scales;
    const float *bias;
    float *y;
    int64_t ldy;
    int M, N, K;
} MxArgs;

static inline float add_bias(const MxArgs *a, int n, float sum) {
    return a->bias != NULL ? sum + a->bias[n] : sum;
}

/* ---- plain C -------------------------------------------------------------------------- */

static void column_c(const MxArgs *a, int n) {
    const int groups = a->K / MX_BLOCK;
    const uint8_t *q = a->nibbles + (int64_t)n * groups * MX_BYTES;
    const uint8_t *e = a->scales + (int64_t)n * groups;
    for (int m = 0; m < a->M; ++m) {
        const float *x = a->x + m * a->ldx;
        float sum = 0.0f;
        for (int g = 0; g < groups; ++g) {
            const float scale = e8m0_scale(e[g]);
            const uint8_t *b = q + g * MX_BYTES;
            const float *xg = x + g * MX_BLOCK;
            for (int j = 0; j < MX_BYTES; ++j) sum += xg[j] * (E2M1[b[j] & 15] * scale);
            for (int j = 0; j < MX_BYTES; ++j) sum += xg[16 + j] * (E2M1[b[j] >> 4] * scale);
        }
        a->y[m * a->ldy + n] = add_bias(a, n, sum);
    }
}

/* ---- AVX2 ----------------------------------------------------------------------------- */
#if defined(PG_MX_AVX2)

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* 8 nibbles (dwords) -> 8 weights: VPERMPS reads the low 3 bits (the magnitude), bit 3 is the
 * sign, moved to bit 31 */
static inline __m256 decode8(__m256i nib, __m256 magnitudes, __m256 scale) {
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(nib, _mm256_set1_epi32(8)), 28);
    const __m256 w = _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, nib),
                                   _mm256_castsi256_ps(sign));
    return _mm256_mul_ps(w, scale);
}

/* rows [m0, m0 + R) of column n */
static inline __attribute__((always_inline)) void tile_avx2(const MxArgs *a, int R, int m0,
                                                            int n) {
    const int groups = a->K / MX_BLOCK;
    const uint8_t *q = a->nibbles + (int64_t)n * groups * MX_BYTES;
    const uint8_t *e = a->scales + (int64_t)n * groups;
    const __m256 magnitudes = _mm256_loadu_ps(E2M1);
    __m256 acc[MX_ROWS];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        const __m256 scale = _mm256_set1_ps(e8m0_scale(e[g]));
        for (int half = 0; half < 2; ++half) { /* bytes 0-7, then 8-15 */
            const __m256i b = _mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const __m128i *)(q + g * MX_BYTES + 8 * half)));
            const __m256 lo = decode8(b, magnitudes, scale);
            const __m256 hi = decode8(_mm256_srli_epi32(b, 4), magnitudes, scale);
            for (int r = 0; r < R; ++r) {
                const float *xg = a->x + (m0 + r) * a->ldx + g * MX_BLOCK + 8 * half;
                acc[r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(xg), acc[r]);
                acc[r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(xg + 16), acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) a->y[(m0 + r) * a->ldy + n] = add_bias(a, n, hsum256(acc[r]));
}

static void column_avx2(const MxArgs *a, int n) {
    int m = 0;
    for (; m + MX_ROWS <= a->M; m += MX_ROWS) tile_avx2(a, MX_ROWS, m, n);
    switch (a->M - m) {
        case 3: tile_avx2(a, 3, m, n); break;
        case 2: tile_avx2(a, 2, m, n); break;
        case 1: tile_avx2(a, 1, m, n); break;
        default: break;
    }
}
#endif

/* ---- AVX-512 -------------------------------------------------------------------------- */
#if defined(PG_MX_AVX512)

/* rows [m0, m0 + R) x columns [n0, n0 + C): each block decoded once, used by the R rows */
static inline __attribute__((always_inline)) void tile_avx512(const MxArgs *a, int R, int C,
                                                              int m0, int n0) {
    const int groups = a->K / MX_BLOCK;
    const __m512 table = _mm512_loadu_ps(E2M1);
    __m512 acc[MX_ROWS * MX_COLS];
    for (int i = 0; i < R * C; ++i) acc[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m512 lo[MX_COLS], hi[MX_COLS];
        for (int c = 0; c < C; ++c) {
            const int64_t block = (int64_t)(n0 + c) * groups + g;
            const __m512 scale = _mm512_set1_ps(e8m0_scale(a->scales[block]));
            const __m512i b = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(a->nibbles + block * MX_BYTES)));
            /* VPERMPS reads the low 4 bits of each index: the low nibble needs no mask */
            lo[c] = _mm512_mul_ps(_mm512_permutexvar_ps(b, table), scale);
            hi[c] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), scale);
        }
        for (int r = 0; r < R; ++r) {
            const float *xg = a->x + (m0 + r) * a->ldx + g * MX_BLOCK;
            const __m512 x_lo = _mm512_loadu_ps(xg), x_hi = _mm512_loadu_ps(xg + 16);
            for (int c = 0; c < C; ++c) {
                acc[r * C + c] = _mm512_fmadd_ps(lo[c], x_lo, acc[r * C + c]);
                acc[r * C + c] = _mm512_fmadd_ps(hi[c], x_hi, acc[r * C + c]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
            a->y[(m0 + r) * a->ldy + n0 + c] =
                add_bias(a, n0 + c, _mm512_reduce_add_ps(acc[r * C + c]));
}

/* columns [n0, n0 + C) for every row; C is a constant at each call (inlined) */
static inline __attribute__((always_inline)) void row_tiles(const MxArgs *a, int C, int n0) {
    int m = 0;
    for (; m + MX_ROWS <= a->M; m += MX_ROWS) tile_avx512(a, MX_ROWS, C, m, n0);
    switch (a->M - m) {
        case 3: tile_avx512(a, 3, C, m, n0); break;
        case 2: tile_avx512(a, 2, C, m, n0); break;
        case 1: tile_avx512(a, 1, C, m, n0); break;
        default: break;
    }
}

static void columns_avx512(const MxArgs *a, int n0) {
    if (n0 + MX_COLS <= a->N)
        row_tiles(a, MX_COLS, n0);
    else
        for (int n = n0; n < a->N; ++n) row_tiles(a, 1, n);
}
#endif

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) . W^T (+ bias [N]), W as above.
 * path: 0 the best this build has, 1 plain C, 2 AVX2, 3 AVX-512.
 * Returns 0, -1 when K is not a multiple of 32 or a size is negative, -2 when this build lacks
 * the path asked for. */
int pg_linear_mxfp4(const float *x, int64_t ldx, const uint8_t *nibbles, const uint8_t *scales,
                    const float *bias, float *y, int64_t ldy, int M, int N, int K, int path,
                    int num_threads) {
    if (K % MX_BLOCK != 0 || M < 0 || N < 0 || K < 0) return -1;
    if (path == MX_PATH_BEST) path = pg_linear_mxfp4_best();
    if (path > pg_linear_mxfp4_best() || path < MX_PATH_C) return -2;
    const MxArgs args = {x, ldx, nibbles, scales, bias, y, ldy, M, N, K};
    const MxArgs *a = &args;
    /* a tiny layer is not worth waking the thread pool */
    const int parallel = (int64_t)M * N * K >= (1 << 18);
    if (path == MX_PATH_C) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
        for (int n = 0; n < N; ++n) column_c(a, n);
    }
#if defined(PG_MX_AVX2)
    else if (path == MX_PATH_AVX2) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
        for (int n = 0; n < N; ++n) column_avx2(a, n);
    }
#endif
#if defined(PG_MX_AVX512)
    else if (path == MX_PATH_AVX512) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (parallel)
        for (int n0 = 0; n0 < N; n0 += MX_COLS) columns_avx512(a, n0);
    }
#endif
    return 0;
}
