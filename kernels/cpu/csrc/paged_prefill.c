/* Paged prefill attention on CPU, fp32: the n new query rows of one sequence attend causally
 * (aligned to the lower right: row i sits at position ctx_len - n + i) to the sequence's
 * context, K/V read in place from its pages. Covers a first prefill (ctx_len == n), a chunk
 * after earlier chunks and a suffix after a cached prefix alike. A sliding layer (window > 0):
 * row i sees positions (pos - window, pos] only; the pages before the first row's window are
 * never read.
 *
 * Why: the torch path gathers the context into a dense buffer and runs SDPA's CPU flash
 * kernel, whose GEMM blocks are thin at head dim 64 (docs/benchmarks.md); this
 * kernel keeps the G query heads of a KV head together as the rows of one tile, so each K/V
 * row loaded serves G x 32 query rows, and computes 16 keys per vector.
 *
 * Spans. The keys are cut into spans of SPAN_KEYS at absolute positions. A row's result is
 * the merge, in span order, of one partial per span (an online softmax over the span's 16-key
 * blocks from a fresh state: running max, sum, unnormalised output). So a row's arithmetic
 * depends only on its position and its keys: not on how the prompt was chunked, how many rows
 * came with it, or the thread count. Work items are (KV head, block of ROWS_PER_ITEM query
 * positions); when there are few of them (a short chunk deep into a long context: the chunk
 * beside decodes) the spans of an item become items of their own, their partials are kept
 * and merged in a second pass, with the same arithmetic as an item that merges as it goes.
 *
 * In a span, key blocks of 16 go by: the block's K rows are transposed into kt[D][16] (16x16
 * register transposes where AVX-512 is there), so a query row's 16 scores are D vector FMAs
 * with the query element broadcast; a tile of TILE_ROWS rows keeps its scores in registers,
 * folds them into the running softmax (masked only where the block crosses a row's position
 * or window edge), and then takes each V vector loaded once for all the tile's rows.
 *
 * Layout (kernels/layout.py): k_cache, v_cache [num_pages, page_size, Hkv, D] contiguous, fp32
 * or bf16 (kv_bf16): a key block's bf16 K and V rows are widened exactly (zero-extend, shift
 * left 16) once per block, K while it is transposed, V into an fp32 block buffer, so the tiles
 * below run the fp32 code unchanged and the conversion is amortised over all the item's rows
 * (docs/benchmarks.md).
 * AMX (Sapphire Rapids on; bf16 pages by default, see prefill_amx): the same spans, blocks and
 * online softmax, with Q K^T and P V as AMX-BF16 tile products over exact bf16 pieces of the
 * fp32 operands (prefill_span_amx): 1.4-1.5x the FMA path on long chunks. Items are then 64
 * positions, their rows padded to whole 16-row tiles.
 * Built with the other kernels/cpu/csrc files into one library by kernels/cpu/library.py; the torch
 * path (SDPA) is the oracle in the tests.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kv_rows.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define PG_PREFILL_AMX 1
int pg_amx_available(void); /* linear_amx.c */
#endif

#define KEYS 16          /* keys per vector of scores */
#define VECS 2           /* vectors of scores per key block */
#define BLOCK (KEYS * VECS) /* keys per block */
#define ROWS_PER_ITEM 32 /* query positions per work item (twice that on AMX tiles) */
#define AMX_ITEM_PAD 16  /* rows of an AMX tile: an item's rows are padded to it */
#define TILE_ROWS 4      /* query rows whose scores and outputs are in registers together */
#define SPAN_KEYS 512    /* keys per span (a multiple of KEYS) */
#define ITEMS_PER_THREAD 4 /* fewer (head, row block) items than this per thread: split spans */
#define PREFILL_MAX_GROUP 16
#define PREFILL_MAX_HEAD_DIM 256

_Static_assert(sizeof(vkeys) == KEYS * sizeof(float), "KEYS is one vkeys");
_Static_assert(SPAN_KEYS % BLOCK == 0, "spans are whole key blocks");

typedef int32_t vlanes __attribute__((vector_size(KEYS * sizeof(int32_t))));

int pg_prefill_limits(int *max_group, int *max_head_dim) {
    *max_group = PREFILL_MAX_GROUP;
    *max_head_dim = PREFILL_MAX_HEAD_DIM;
    return 0;
}

static inline vkeys splat(float x) { return (vkeys){0} + x; }

static inline float lanes_max(vkeys v) {
#if defined(__AVX512F__)
    __m512 x;
    memcpy(&x, &v, sizeof(x));
    return _mm512_reduce_max_ps(x);
#else
    float m = v[0];
    for (int j = 1; j < KEYS; ++j) m = v[j] > m ? v[j] : m;
    return m;
#endif
}

static inline float lanes_sum(vkeys v) {
#if defined(__AVX512F__)
    __m512 x;
    memcpy(&x, &v, sizeof(x));
    return _mm512_reduce_add_ps(x);
#else
    float s = 0.0f;
    for (int j = 0; j < KEYS; ++j) s += v[j];
    return s;
#endif
}

/* exp of 16 arguments <= 0 (a score less its row's max): 2^n * e^r with |r| <= ln2 / 2, e^r
 * by its Taylor polynomial to degree 7 (relative error below 1e-8 there, under fp32
 * rounding); arguments below -87 (e^-87 is near FLT_MIN) give 0. A NaN stays NaN: it is found
 * by its bits (-ffast-math folds a float self-comparison away, and may turn the clamp into a
 * max that drops it). */
static inline vkeys exp_lanes(vkeys x) {
    const vlanes bits = (vlanes)x;
    const vlanes nan = (bits & 0x7fffffff) > 0x7f800000;
    const vlanes under = x < splat(-87.0f);
    x = (vkeys)(((vlanes)x & ~under) | ((vlanes)splat(-87.0f) & under));
    const vkeys t = x * 1.44269504088896341f;
    const vlanes n = __builtin_convertvector(t - 0.5f, vlanes); /* round to nearest, t <= 0 */
    const vkeys nf = __builtin_convertvector(n, vkeys);
    const vkeys r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;
    vkeys p = splat(1.0f / 5040.0f);
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vlanes scaled = (vlanes)p + (n << 23);
    return (vkeys)((scaled & ~under & ~nan) | (bits & nan));
}

#if defined(__AVX512F__)
/* r[c] <- column c of the 16x16 block whose rows are r[0..15]: in-lane unpacks of pairs and
 * quads, then two rounds of 128-bit lane shuffles. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    /* u[4g + k], 128-bit lane L: column 4L + k of rows 4g .. 4g + 3 */
    for (int g = 0; g < 4; ++g) {
        const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int k = 0; k < 4; ++k) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x44);
        const __m512 w0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xEE);
        const __m512 v1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x44);
        const __m512 w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xEE);
        r[k] = _mm512_shuffle_f32x4(v0, v1, 0x88);
        r[4 + k] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
        r[8 + k] = _mm512_shuffle_f32x4(w0, w1, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(w0, w1, 0xDD);
    }
}

static inline __m512 load_row16(const void *row, int64_t at, const int bf16) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + at));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + at);
}
#endif

/* kt[d][j] = K row j, element d, for the block's nkeys rows (zero past them). */
static inline __attribute__((always_inline)) void transpose_keys(
    float *kt, const void *const krow[KEYS], int nkeys, const int head_dim, const int bf16) {
#if defined(__AVX512F__)
    for (int c = 0; c < head_dim; c += KEYS) {
        __m512 r[KEYS];
        for (int j = 0; j < KEYS; ++j)
            r[j] = j < nkeys ? load_row16(krow[j], c, bf16) : _mm512_setzero_ps();
        transpose16(r);
        for (int d = 0; d < KEYS; ++d) _mm512_storeu_ps(kt + (size_t)(c + d) * KEYS, r[d]);
    }
#else
    for (int j = 0; j < KEYS; ++j)
        for (int d = 0; d < head_dim; ++d)
            kt[d * KEYS + j] = j < nkeys ? kv_elem(krow[j], d, bf16) : 0.0f;
#endif
}

/* A span's partial for an item's rows: an online softmax over keys k0 .. k1 from a fresh
 * state, into o (unnormalised, [padded_rows][D]), m (running max) and l (sum). q holds the
 * rows' scaled queries (zero padding rows); row r sits at position first_pos + r / group.
 * Keys go by in blocks of VECS x 16: each row's scores of a block are VECS vectors, so a
 * broadcast query element feeds VECS FMAs, and the block's max, rescale and sum are paid once. */
static inline __attribute__((always_inline)) void prefill_span(
    const int group, const int head_dim, const int bf16, const paged_kv *kv, int h,
    const float *q, int rows, int padded_rows, int first_pos, int k0, int k1, int window,
    float *o, float *m, float *l, float *kt, float *vb) {
    const int chunks = head_dim / KEYS;
    memset(o, 0, sizeof(float) * (size_t)padded_rows * head_dim);
    for (int r = 0; r < padded_rows; ++r) {
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
    }
    vlanes lane;
    for (int j = 0; j < KEYS; ++j) lane[j] = j;
    for (int t0 = k0; t0 <= k1; t0 += BLOCK) {
        const int nkeys = k1 + 1 - t0 < BLOCK ? k1 + 1 - t0 : BLOCK;
        const float *vrow[BLOCK];
        const void *krow[BLOCK];
        for (int j = 0; j < nkeys; ++j) {
            krow[j] = kv_row(kv, kv->k_cache, t0 + j, h, head_dim);
            const void *v = kv_row(kv, kv->v_cache, t0 + j, h, head_dim);
            if (bf16) {
                float *row = vb + (size_t)j * head_dim;
                for (int d = 0; d < head_dim; ++d) row[d] = kv_elem(v, d, 1);
                vrow[j] = row;
            } else {
                vrow[j] = (const float *)v;
            }
        }
        /* kt: VECS transposed [D][16] blocks */
        for (int b = 0; b < VECS; ++b) {
            const int in_vec = nkeys - b * KEYS;
            transpose_keys(kt + (size_t)b * head_dim * KEYS, krow + b * KEYS,
                           in_vec < 0 ? 0 : in_vec, head_dim, bf16);
        }
        for (int r = 0; r < padded_rows; r += TILE_ROWS) {
            vkeys sc[TILE_ROWS][VECS];
            for (int i = 0; i < TILE_ROWS; ++i)
                for (int b = 0; b < VECS; ++b) sc[i][b] = (vkeys){0};
            const float *q0 = q + (size_t)r * head_dim;
            for (int d = 0; d < head_dim; ++d) {
                vkeys kd[VECS];
                for (int b = 0; b < VECS; ++b)
                    kd[b] = load_keys(kt + (size_t)b * head_dim * KEYS + d * KEYS);
                for (int i = 0; i < TILE_ROWS; ++i) {
                    const float qd = q0[i * head_dim + d];
                    for (int b = 0; b < VECS; ++b) sc[i][b] += qd * kd[b];
                }
            }
            /* every row of the tile sees every key of the block: no mask (padding rows too:
             * their outputs are never read) */
            const int low_pos = first_pos + r / group;
            const int high_pos = first_pos + (r + TILE_ROWS - 1) / group;
            const int whole = nkeys == BLOCK && t0 + BLOCK - 1 <= low_pos &&
                              (window <= 0 || high_pos - window < t0);
            float p[TILE_ROWS][BLOCK], alpha[TILE_ROWS];
            int most_visible = whole ? BLOCK : 0;
            for (int i = 0; i < TILE_ROWS; ++i) {
                vkeys x[VECS];
                vlanes span[VECS];
                for (int b = 0; b < VECS; ++b) {
                    x[b] = sc[i][b];
                    span[b] = (vlanes){0} - 1;
                }
                if (!whole) {
                    /* keys j in [seen, visible) of the block: up to the row's position, from
                     * its window's start; none for the padding rows */
                    const int pos = r + i < rows ? first_pos + (r + i) / group : -1;
                    const int visible = pos - t0 + 1 < nkeys ? pos - t0 + 1 : nkeys;
                    const int seen = window > 0 ? pos - window + 1 - t0 : 0;
                    most_visible = visible > most_visible ? visible : most_visible;
                    for (int b = 0; b < VECS; ++b) {
                        span[b] = (lane + b * KEYS >= seen) & (lane + b * KEYS < visible);
                        x[b] = (vkeys)(((vlanes)x[b] & span[b]) |
                                       ((vlanes)splat(-FLT_MAX) & ~span[b]));
                    }
                }
                vkeys most = x[0];
                for (int b = 1; b < VECS; ++b) {
                    const vlanes keep = most > x[b];
                    most = (vkeys)(((vlanes)most & keep) | ((vlanes)x[b] & ~keep));
                }
                const float block_max = lanes_max(most);
                const float mb = block_max > m[r + i] ? block_max : m[r + i];
                alpha[i] = expf(m[r + i] - mb);
                /* lanes outside the row's span get an argument of -1e30 (weight 0) after
                 * the max, so a NaN score in the span still propagates */
                vkeys sum = (vkeys){0};
                for (int b = 0; b < VECS; ++b) {
                    vkeys arg = sc[i][b] - mb;
                    if (!whole)
                        arg = (vkeys)(((vlanes)arg & span[b]) | ((vlanes)splat(-1e30f) & ~span[b]));
                    const vkeys e = exp_lanes(arg);
                    store_keys(p[i] + b * KEYS, e);
                    sum += e;
                }
                m[r + i] = mb;
                l[r + i] = l[r + i] * alpha[i] + lanes_sum(sum);
            }
            for (int c0 = 0; c0 < chunks; c0 += 4) {
                const int cn = chunks - c0 < 4 ? chunks - c0 : 4;
                vkeys acc[TILE_ROWS][4];
                for (int i = 0; i < TILE_ROWS; ++i)
                    for (int c = 0; c < cn; ++c)
                        acc[i][c] = load_keys(o + (size_t)(r + i) * head_dim + (c0 + c) * KEYS) *
                                    alpha[i];
                for (int j = 0; j < most_visible; ++j) {
                    vkeys vv[4];
                    for (int c = 0; c < cn; ++c) vv[c] = load_keys(vrow[j] + (c0 + c) * KEYS);
                    for (int i = 0; i < TILE_ROWS; ++i)
                        for (int c = 0; c < cn; ++c) acc[i][c] += p[i][j] * vv[c];
                }
                for (int i = 0; i < TILE_ROWS; ++i)
                    for (int c = 0; c < cn; ++c)
                        store_keys(o + (size_t)(r + i) * head_dim + (c0 + c) * KEYS, acc[i][c]);
            }
        }
    }
}

#if defined(PG_PREFILL_AMX)
/* ---- AMX-BF16 tiles (Intel Sapphire Rapids on; pg_amx_available() says the kernel allows it).
 *
 * The same spans, blocks of 32 keys, online softmax and merge as prefill_span, with the two
 * products on tiles: scores S = Q K^T for 16 rows x 32 keys, then O += P V for 16 rows x D.
 * Tiles multiply bf16 pairs into fp32 sums, so each fp32 operand goes in as PIECES bf16 terms
 * whose sum is the value exactly (x = hi + mid + lo, each the nearest bf16 of what is left: 3 x 8
 * significant bits hold fp32's 24). A product of two such sums is the sum of the piece
 * products; the ones of significance below 2^-24 of the leading term (mid x lo, lo x mid, lo x
 * lo) are left out, so every score and output sums products exact to fp32's precision, in a
 * fixed order per row: a row's bits still depend only on its position and its keys.
 * bf16 pages hold one piece per K / V element (exact), and the pieces a fp32 page would add
 * are the ones left at zero there, in the same order: fp32 pages holding bf16 values give the
 * bf16 pages' bits. Tiles: 0-3 the output accumulators (16 columns each), 4-5 the scores of
 * the two 16-key halves, 6 an A operand, 7 a B operand; all 16 rows x 64 bytes. */
#define PIECES 3
#define AMX_ROWS 16

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) prefill_tile_config;

static void prefill_tiles_configure(void) {
    prefill_tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = AMX_ROWS;
    }
    /* NOTE: GCC declares ldtilecfg's operand as 8 bytes: the barrier keeps the other stores */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

static inline __m512 widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* x as PIECES bf16 vectors (nearest even each) whose sum is x. */
static inline void split_pieces(__m512 x, __m256i out[PIECES]) {
    for (int p = 0; p < PIECES; ++p) {
        const __m256bh h = _mm512_cvtneps_pbh(x);
        memcpy(&out[p], &h, sizeof(out[p]));
        if (p + 1 < PIECES) x = _mm512_sub_ps(x, widen_bf16(out[p]));
    }
}

/* 32 elements from `at` of a K/V row as bf16 pieces, in pairs: out[p] lane i = elements
 * (at + 2i, at + 2i + 1) of piece p. bf16 rows have one piece; the others are zero. */
static inline void row_pairs(const void *row, int64_t at, const int bf16, __m512i out[PIECES]) {
    if (bf16) {
        out[0] = _mm512_loadu_si512((const uint16_t *)row + at);
        for (int p = 1; p < PIECES; ++p) out[p] = _mm512_setzero_si512();
        return;
    }
    __m256i lo[PIECES], hi[PIECES];
    split_pieces(_mm512_loadu_ps((const float *)row + at), lo);
    split_pieces(_mm512_loadu_ps((const float *)row + at + 16), hi);
    for (int p = 0; p < PIECES; ++p)
        out[p] = _mm512_inserti64x4(_mm512_castsi256_si512(lo[p]), hi[p], 1);
}

/* 16 elements from `at` of a V row as bf16 pieces widened to 32-bit lanes (low half). */
static inline void row_lanes(const void *row, int64_t at, const int bf16, __m512i out[PIECES]) {
    if (bf16) {
        out[0] = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + at)));
        for (int p = 1; p < PIECES; ++p) out[p] = _mm512_setzero_si512();
        return;
    }
    __m256i h[PIECES];
    split_pieces(_mm512_loadu_ps((const float *)row + at), h);
    for (int p = 0; p < PIECES; ++p) out[p] = _mm512_cvtepu16_epi32(h[p]);
}

/* The block's K as B tiles: kb[p][half][c] = 16 rows (pairs of d in [32c, 32c + 32)) x 16
 * keys of the half, piece p; keys past nkeys zero. */
static inline __attribute__((always_inline)) void k_tiles(uint32_t *kb, const void *const krow[BLOCK],
                                                          int nkeys, const int head_dim,
                                                          const int bf16, const int kp) {
    const int kchunks = head_dim / 32;
    for (int half = 0; half < VECS; ++half)
        for (int c = 0; c < kchunks; ++c) {
            __m512 r[PIECES][KEYS];
            for (int j = 0; j < KEYS; ++j) {
                __m512i pairs[PIECES];
                const int key = half * KEYS + j;
                if (key < nkeys) {
                    row_pairs(krow[key], (int64_t)c * 32, bf16, pairs);
                } else {
                    for (int p = 0; p < PIECES; ++p) pairs[p] = _mm512_setzero_si512();
                }
                for (int p = 0; p < kp; ++p) r[p][j] = _mm512_castsi512_ps(pairs[p]);
            }
            for (int p = 0; p < kp; ++p) {
                transpose16(r[p]);
                uint32_t *dst = kb + (((size_t)p * VECS + half) * kchunks + c) * 256;
                for (int d = 0; d < KEYS; ++d) _mm512_store_ps((float *)dst + d * 16, r[p][d]);
            }
        }
}

/* The block's V as B tiles: vt[p][c] = 16 rows (pairs of keys 2i, 2i + 1) x 16 columns (d in
 * [16c, 16c + 16)), piece p; keys past nkeys zero. */
static inline __attribute__((always_inline)) void v_tiles(uint32_t *vt, const void *const vrow[BLOCK],
                                                          int nkeys, const int head_dim,
                                                          const int bf16, const int vp) {
    const int vchunks = head_dim / 16;
    for (int i = 0; i < BLOCK / 2; ++i)
        for (int c = 0; c < vchunks; ++c) {
            __m512i even[PIECES], odd[PIECES];
            for (int p = 0; p < PIECES; ++p) even[p] = odd[p] = _mm512_setzero_si512();
            if (2 * i < nkeys) row_lanes(vrow[2 * i], (int64_t)c * 16, bf16, even);
            if (2 * i + 1 < nkeys) row_lanes(vrow[2 * i + 1], (int64_t)c * 16, bf16, odd);
            for (int p = 0; p < vp; ++p)
                _mm512_store_si512(vt + (((size_t)p * vchunks + c) * 16 + i) * 16,
                                   _mm512_or_si512(even[p], _mm512_slli_epi32(odd[p], 16)));
        }
}

/* Scores of rows r0 .. r0 + 15 against the block into s [16][32]: products of Q piece qp and
 * K piece kp with qp + kp < PIECES, K's leading piece first (see above). */
static inline __attribute__((always_inline)) void amx_scores(const uint16_t *qp, size_t q_piece,
                                                             const uint32_t *kb, int r0,
                                                             const int head_dim, const int kp,
                                                             float *s) {
    const int kchunks = head_dim / 32;
    _tile_zero(4);
    _tile_zero(5);
    for (int k = 0; k < kp; ++k)
        for (int p = 0; p + k < PIECES; ++p)
            for (int c = 0; c < kchunks; ++c) {
                _tile_loadd(6, qp + p * q_piece + (size_t)r0 * head_dim + c * 32,
                            head_dim * sizeof(uint16_t));
                _tile_loadd(7, kb + (((size_t)k * VECS + 0) * kchunks + c) * 256, 64);
                _tile_dpbf16ps(4, 6, 7);
                _tile_loadd(7, kb + (((size_t)k * VECS + 1) * kchunks + c) * 256, 64);
                _tile_dpbf16ps(5, 6, 7);
            }
    _tile_stored(4, s, BLOCK * sizeof(float));
    _tile_stored(5, s + KEYS, BLOCK * sizeof(float));
}

/* o rows r0 .. r0 + 15 (already rescaled) += P V, P's pieces in pp [PIECES][16][32]. */
static inline __attribute__((always_inline)) void amx_outputs(float *o, const uint16_t *pp,
                                                              const uint32_t *vt, int r0,
                                                              const int head_dim, const int vp) {
    const int vchunks = head_dim / 16;
    const int64_t ld = head_dim * sizeof(float);
    for (int c0 = 0; c0 < vchunks; c0 += 4) {
        const int cn = vchunks - c0 < 4 ? vchunks - c0 : 4;
        float *base = o + (size_t)r0 * head_dim + c0 * 16;
        _tile_loadd(0, base, ld);
        if (cn > 1) _tile_loadd(1, base + 16, ld);
        if (cn > 2) _tile_loadd(2, base + 32, ld);
        if (cn > 3) _tile_loadd(3, base + 48, ld);
        for (int v = 0; v < vp; ++v)
            for (int p = 0; p + v < PIECES; ++p) {
                const uint32_t *vb = vt + ((size_t)v * vchunks + c0) * 256;
                _tile_loadd(6, pp + (size_t)p * AMX_ROWS * BLOCK, BLOCK * sizeof(uint16_t));
                _tile_loadd(7, vb, 64);
                _tile_dpbf16ps(0, 6, 7);
                if (cn > 1) {
                    _tile_loadd(7, vb + 256, 64);
                    _tile_dpbf16ps(1, 6, 7);
                }
                if (cn > 2) {
                    _tile_loadd(7, vb + 512, 64);
                    _tile_dpbf16ps(2, 6, 7);
                }
                if (cn > 3) {
                    _tile_loadd(7, vb + 768, 64);
                    _tile_dpbf16ps(3, 6, 7);
                }
            }
        _tile_stored(0, base, ld);
        if (cn > 1) _tile_stored(1, base + 16, ld);
        if (cn > 2) _tile_stored(2, base + 32, ld);
        if (cn > 3) _tile_stored(3, base + 48, ld);
    }
}

/* The online softmax of rows r0 .. r0 + 15 over the block's scores s [16][32] (prefill_span's
 * arithmetic: masks, running max, exp, sums); P's pieces into pp, the rows of o rescaled. */
static inline __attribute__((always_inline)) void amx_softmax(
    const int group, const int head_dim, const float *s, int r0, int rows, int first_pos, int t0,
    int nkeys, int window, float *o, float *m, float *lsum, uint16_t *pp) {
    vlanes lane;
    for (int j = 0; j < KEYS; ++j) lane[j] = j;
    const int low_pos = first_pos + r0 / group;
    const int high_pos = first_pos + (r0 + AMX_ROWS - 1) / group;
    const int whole = nkeys == BLOCK && t0 + BLOCK - 1 <= low_pos && r0 + AMX_ROWS <= rows &&
                      (window <= 0 || high_pos - window < t0);
    for (int i = 0; i < AMX_ROWS; ++i) {
        const int r = r0 + i;
        vkeys x[VECS], sc[VECS];
        vlanes span[VECS];
        for (int b = 0; b < VECS; ++b) {
            sc[b] = x[b] = load_keys(s + i * BLOCK + b * KEYS);
            span[b] = (vlanes){0} - 1;
        }
        if (!whole) {
            const int pos = r < rows ? first_pos + r / group : -1;
            const int visible = pos - t0 + 1 < nkeys ? pos - t0 + 1 : nkeys;
            const int seen = window > 0 ? pos - window + 1 - t0 : 0;
            for (int b = 0; b < VECS; ++b) {
                span[b] = (lane + b * KEYS >= seen) & (lane + b * KEYS < visible);
                x[b] = (vkeys)(((vlanes)x[b] & span[b]) | ((vlanes)splat(-FLT_MAX) & ~span[b]));
            }
        }
        vkeys most = x[0];
        for (int b = 1; b < VECS; ++b) {
            const vlanes keep = most > x[b];
            most = (vkeys)(((vlanes)most & keep) | ((vlanes)x[b] & ~keep));
        }
        const float block_max = lanes_max(most);
        const int grows = block_max > m[r];
        const float mb = grows ? block_max : m[r];
        vkeys sum = (vkeys){0};
        for (int b = 0; b < VECS; ++b) {
            vkeys arg = sc[b] - mb;
            if (!whole)
                arg = (vkeys)(((vlanes)arg & span[b]) | ((vlanes)splat(-1e30f) & ~span[b]));
            const vkeys e = exp_lanes(arg);
            sum += e;
            __m512 ev;
            memcpy(&ev, &e, sizeof(ev));
            __m256i pieces[PIECES];
            split_pieces(ev, pieces);
            for (int p = 0; p < PIECES; ++p)
                _mm256_store_si256((__m256i *)(pp + ((size_t)p * AMX_ROWS + i) * BLOCK + b * KEYS),
                                   pieces[p]);
        }
        /* the row's sum as 16 lanes (summed across at the span's end); o and the sum are
         * rescaled only when the running max grows (alpha = 1 otherwise: the same bits) */
        float *lrow = lsum + (size_t)r * KEYS;
        if (grows) {
            const float alpha = expf(m[r] - mb);
            m[r] = mb;
            store_keys(lrow, load_keys(lrow) * alpha + sum);
            float *orow = o + (size_t)r * head_dim;
            for (int d = 0; d < head_dim; d += KEYS)
                store_keys(orow + d, load_keys(orow + d) * alpha);
        } else {
            store_keys(lrow, load_keys(lrow) + sum);
        }
    }
}

/* Scratch of an AMX span, bytes: Q pieces [PIECES][R][D] bf16, K tiles, V tiles, scores
 * [16][32], P pieces [PIECES][16][32] bf16. */
static inline size_t amx_scratch_bytes(int padded_rows, int head_dim) {
    return (size_t)PIECES * padded_rows * head_dim * 2 + (size_t)PIECES * VECS * head_dim * 16 * 4 +
           (size_t)PIECES * head_dim * 16 * 4 + AMX_ROWS * BLOCK * 4 +
           (size_t)PIECES * AMX_ROWS * BLOCK * 2 + (size_t)padded_rows * KEYS * 4;
}

/* prefill_span on tiles: q holds the rows' scaled fp32 queries (padded_rows a multiple of 16).
 * Compiled once, not per (group, head dim): the tiles take the sizes at run time. */
static __attribute__((noinline)) void prefill_span_amx(
    int group, int head_dim, int bf16, const paged_kv *kv, int h, const float *q, int rows,
    int padded_rows, int first_pos, int k0, int k1, int window, float *o, float *m, float *l,
    uint8_t *scratch) {
    const size_t q_piece = (size_t)padded_rows * head_dim;
    uint16_t *qp = (uint16_t *)scratch;
    uint32_t *kb = (uint32_t *)(qp + PIECES * q_piece);
    uint32_t *vt = kb + (size_t)PIECES * VECS * head_dim * 16;
    float *s = (float *)(vt + (size_t)PIECES * head_dim * 16);
    uint16_t *pp = (uint16_t *)(s + AMX_ROWS * BLOCK);
    float *lsum = (float *)(pp + PIECES * AMX_ROWS * BLOCK); /* [R][16]: each row's sum lanes */
    const int pieces = bf16 ? 1 : PIECES;
    for (size_t e = 0; e < q_piece; e += 16) {
        __m256i h16[PIECES];
        split_pieces(_mm512_loadu_ps(q + e), h16);
        for (int p = 0; p < PIECES; ++p) _mm256_storeu_si256((__m256i *)(qp + p * q_piece + e), h16[p]);
    }
    memset(o, 0, sizeof(float) * q_piece);
    memset(lsum, 0, sizeof(float) * (size_t)padded_rows * KEYS);
    for (int r = 0; r < padded_rows; ++r) m[r] = -FLT_MAX;
    prefill_tiles_configure();
    for (int t0 = k0; t0 <= k1; t0 += BLOCK) {
        const int nkeys = k1 + 1 - t0 < BLOCK ? k1 + 1 - t0 : BLOCK;
        const void *krow[BLOCK], *vrow[BLOCK];
        for (int j = 0; j < nkeys; ++j) {
            krow[j] = kv_row(kv, kv->k_cache, t0 + j, h, head_dim);
            vrow[j] = kv_row(kv, kv->v_cache, t0 + j, h, head_dim);
        }
        k_tiles(kb, krow, nkeys, head_dim, bf16, pieces);
        v_tiles(vt, vrow, nkeys, head_dim, bf16, pieces);
        for (int r0 = 0; r0 < padded_rows; r0 += AMX_ROWS) {
            amx_scores(qp, q_piece, kb, r0, head_dim, pieces, s);
            amx_softmax(group, head_dim, s, r0, rows, first_pos, t0, nkeys, window, o, m, lsum,
                        pp);
            amx_outputs(o, pp, vt, r0, head_dim, pieces);
        }
    }
    _tile_release();
    for (int r = 0; r < padded_rows; ++r) l[r] = lanes_sum(load_keys(lsum + (size_t)r * KEYS));
}
#endif /* PG_PREFILL_AMX */

/* Fold a span's partial (po, pm, pl) into a row's running state (o, m, l). */
static inline void merge_partial(int head_dim, float *o, float *m, float *l, const float *po,
                                 float pm, float pl) {
    const float mn = pm > *m ? pm : *m;
    const float a = expf(*m - mn), b = expf(pm - mn);
    for (int d = 0; d < head_dim; ++d) o[d] = o[d] * a + po[d] * b;
    *l = *l * a + pl * b;
    *m = mn;
}

/* An item's geometry: its rows, its positions, its spans. */
typedef struct {
    int i0, positions, rows, padded_rows, first_pos, first_key, last_pos, first_span, spans;
} item_rows;

static inline item_rows item_geometry(int b, int group, int ctx_len, int n_rows, int window,
                                      int row_pad) {
    item_rows g;
    const int per_item = row_pad == AMX_ITEM_PAD ? 2 * ROWS_PER_ITEM : ROWS_PER_ITEM;
    g.i0 = b * per_item;
    g.positions = n_rows - g.i0 < per_item ? n_rows - g.i0 : per_item;
    g.rows = g.positions * group;
    g.padded_rows = (g.rows + row_pad - 1) / row_pad * row_pad;
    g.first_pos = ctx_len - n_rows + g.i0;
    g.last_pos = g.first_pos + g.positions - 1;
    /* the first key any of the item's rows sees */
    g.first_key = window > 0 && g.first_pos >= window ? g.first_pos - window + 1 : 0;
    g.first_span = g.first_key / SPAN_KEYS;
    g.spans = g.last_pos / SPAN_KEYS - g.first_span + 1;
    return g;
}

/* Floats of a span's scratch: q [R][D], kt VECS x [D][KEYS], vb [BLOCK][D]. */
static inline size_t scratch_floats(int padded_rows, int head_dim) {
    const size_t n = (size_t)padded_rows * head_dim + 2 * (size_t)head_dim * BLOCK;
    return (n + 15) / 16 * 16; /* aligned_alloc takes whole multiples of the alignment */
}

/* The item's rows' scaled queries into q (zero padding rows). */
static inline void scaled_queries(float *q, const item_rows *g, int group, int head_dim,
                                  const float *query, int64_t q_row_stride, int h, float scale) {
    memset(q, 0, sizeof(float) * (size_t)g->padded_rows * head_dim);
    for (int r = 0; r < g->rows; ++r) {
        const float *src = query + (int64_t)(g->i0 + r / group) * q_row_stride +
                           (int64_t)(h * group + r % group) * head_dim;
        for (int d = 0; d < head_dim; ++d) q[(size_t)r * head_dim + d] = src[d] * scale;
    }
}

/* Span s (0-based within the item) of item (g, h): its partial into po/pm/pl, [padded_rows]
 * rows. Returns 1 when scratch could not be allocated. */
static inline __attribute__((always_inline)) int span_partial(
    const int group, const int head_dim, const int bf16, const int amx, const paged_kv *kv,
    const float *query, int64_t q_row_stride, const item_rows *g, int h, int s, float scale,
    int window, float *po, float *pm, float *pl) {
    size_t bytes = sizeof(float) * scratch_floats(g->padded_rows, head_dim);
#if defined(PG_PREFILL_AMX)
    const size_t q_bytes = sizeof(float) * (size_t)g->padded_rows * head_dim;
    if (amx) bytes = q_bytes + (amx_scratch_bytes(g->padded_rows, head_dim) + 63) / 64 * 64;
#endif
    float *q = (float *)aligned_alloc(64, bytes);
    if (q == NULL) return 1;
    float *kt = q + (size_t)g->padded_rows * head_dim;
    float *vb = kt + (size_t)head_dim * BLOCK;
    scaled_queries(q, g, group, head_dim, query, q_row_stride, h, scale);
    const int span = g->first_span + s;
    const int k0 = span * SPAN_KEYS > g->first_key ? span * SPAN_KEYS : g->first_key;
    const int k1 = (span + 1) * SPAN_KEYS - 1 < g->last_pos ? (span + 1) * SPAN_KEYS - 1 : g->last_pos;
#if defined(PG_PREFILL_AMX)
    if (amx) {
        prefill_span_amx(group, head_dim, bf16, kv, h, q, g->rows, g->padded_rows, g->first_pos,
                         k0, k1, window, po, pm, pl, (uint8_t *)q + q_bytes);
        free(q);
        return 0;
    }
#endif
    (void)amx;
    prefill_span(group, head_dim, bf16, kv, h, q, g->rows, g->padded_rows, g->first_pos, k0, k1,
                 window, po, pm, pl, kt, vb);
    free(q);
    return 0;
}

/* Out rows of item (g, h) from its running state; a head's sink (NULL: none) takes its share
 * of the softmax's mass and attends nothing. */
static inline void write_rows(float *out, int64_t out_row_stride, const item_rows *g, int group,
                              int head_dim, int h, const float *o, const float *m,
                              const float *l, const float *sinks) {
    for (int r = 0; r < g->rows; ++r) {
        float *dst = out + (int64_t)(g->i0 + r / group) * out_row_stride +
                     (int64_t)(h * group + r % group) * head_dim;
        const float total = sinks != NULL ? l[r] + expf(sinks[h * group + r % group] - m[r])
                                          : l[r];
        const float inv = 1.0f / total;
        for (int d = 0; d < head_dim; ++d) dst[d] = o[(size_t)r * head_dim + d] * inv;
    }
}

/* A whole item, its spans merged as they are computed. Returns 1 when scratch could not be
 * allocated. */
static inline __attribute__((always_inline)) int prefill_item(
    const int group, const int head_dim, const int bf16, const int amx, const paged_kv *kv,
    const float *query,
    int64_t q_row_stride, float *out, int64_t out_row_stride, const item_rows *g, int h,
    float scale, int window, const float *sinks) {
    const size_t rd = (size_t)g->padded_rows * head_dim;
    /* running o, m, l, then a span's po, pm, pl */
    float *o = (float *)aligned_alloc(64, sizeof(float) * ((2 * rd + 4 * g->padded_rows + 15) / 16 * 16));
    if (o == NULL) return 1;
    float *m = o + rd, *l = m + g->padded_rows;
    float *po = l + g->padded_rows, *pm = po + rd, *pl = pm + g->padded_rows;
    memset(o, 0, sizeof(float) * rd);
    for (int r = 0; r < g->padded_rows; ++r) {
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
    }
    int failed = 0;
    for (int s = 0; s < g->spans && !failed; ++s) {
        failed = span_partial(group, head_dim, bf16, amx, kv, query, q_row_stride, g, h, s,
                              scale, window, po, pm, pl);
        for (int r = 0; r < g->rows && !failed; ++r)
            merge_partial(head_dim, o + (size_t)r * head_dim, m + r, l + r,
                          po + (size_t)r * head_dim, pm[r], pl[r]);
    }
    if (!failed) write_rows(out, out_row_stride, g, group, head_dim, h, o, m, l, sinks);
    free(o);
    return failed;
}

/* 1: spans run on AMX tiles (prefill_span_amx): the build and the CPU have AMX-BF16, Linux
 * grants the tile state, head_dim is a multiple of 32, and the pages are bf16 (the --dtype
 * bf16 mode's KV: 1.4-1.5x the FMA path on long chunks, 1.1x on a 16-row chunk); fp32 pages
 * stay on the FMA path (their K / V split into three pieces per block ran 0.9-1.0x it on long
 * chunks and 0.6x on short ones; docs/benchmarks.md), so the fp32 mode's bits are unchanged.
 * PREFIXGATE_PREFILL_AMX (read per call, for benchmarks/prefill_attention.py and the tests):
 * "0" never, "all" fp32 pages too. */
static int prefill_amx(int head_dim, int kv_bf16) {
#if defined(PG_PREFILL_AMX)
    const char *env = getenv("PREFIXGATE_PREFILL_AMX");
    if (env != NULL && env[0] == '0') return 0;
    const int all = env != NULL && strcmp(env, "all") == 0;
    return head_dim % 32 == 0 && (kv_bf16 || all) && pg_amx_available();
#else
    (void)head_dim, (void)kv_bf16;
    return 0;
#endif
}

/*
 * query:   n_rows rows; row i, query head g at query + i * q_row_stride + g * head_dim
 * k_cache, v_cache: fp32, or bf16 when kv_bf16 is 1
 * pages:   the sequence's page ids from its first token (at least ceil(ctx_len / page_size))
 * out:     row i, head g at out + i * out_row_stride + g * head_dim (rows dense per head)
 * window:  0, or a sliding layer's window: row i sees its last `window` positions only
 * sinks:   NULL, or [Hq] attention-sink logits (gpt-oss), one more term in each softmax
 * head_dim must be a multiple of 16 (<= 256), group = Hq / Hkv <= 16.
 * returns 0; -1 when scratch could not be allocated (out partly written); -2 when the sizes or
 *          a page id are out of range (nothing written)
 */
int pg_paged_prefill_f32(const float *query, int64_t q_row_stride, const void *k_cache,
                         const void *v_cache, const int64_t *pages, int64_t num_seq_pages,
                         int ctx_len, int n_rows, float *out, int64_t out_row_stride,
                         int num_q_heads, int num_kv_heads, int head_dim, int page_size,
                         float scale, int num_threads, int64_t num_pages, int kv_bf16,
                         int window, const float *sinks) {
    if (n_rows < 1 || ctx_len < n_rows || page_size < 1 || num_kv_heads < 1 || window < 0 ||
        num_q_heads % num_kv_heads || head_dim % KEYS || head_dim > PREFILL_MAX_HEAD_DIM ||
        num_q_heads / num_kv_heads > PREFILL_MAX_GROUP)
        return -2;
    const int64_t used_pages = ((int64_t)ctx_len + page_size - 1) / page_size;
    if (used_pages > num_seq_pages) return -2;
    for (int64_t p = 0; p < used_pages; ++p)
        if (pages[p] < 0 || pages[p] >= num_pages) return -2;
    if (num_threads < 1) num_threads = 1;
    const int group = num_q_heads / num_kv_heads;
    const int elem_bytes = kv_bf16 ? 2 : 4;
    const paged_kv kv = {(const char *)k_cache, (const char *)v_cache, pages,
                         (int64_t)page_size * num_kv_heads * head_dim * elem_bytes,
                         (int64_t)num_kv_heads * head_dim * elem_bytes, page_size, elem_bytes};
    const int amx = prefill_amx(head_dim, kv_bf16);
    /* AMX: whole 16-row tiles, and items of 64 positions (each block's K/V tiles, built once
     * per item, then serve twice the rows) */
    const int row_pad = amx ? AMX_ITEM_PAD : TILE_ROWS;
    const int per_item = amx ? 2 * ROWS_PER_ITEM : ROWS_PER_ITEM;
    const int blocks = (n_rows + per_item - 1) / per_item;
    const int items = blocks * num_kv_heads;
    int failed = 0;
/* compile-time (group, head_dim) for the common shapes, per page dtype B; CALL(G, D, B) */
#define PG_PREFILL_CASES(CALL, B)                                    \
    switch (head_dim * 64 + group) {                                 \
        case 64 * 64 + 1: failed |= CALL(1, 64, B); break;           \
        case 64 * 64 + 3: failed |= CALL(3, 64, B); break;           \
        case 64 * 64 + 4: failed |= CALL(4, 64, B); break;           \
        case 64 * 64 + 8: failed |= CALL(8, 64, B); break;           \
        case 128 * 64 + 1: failed |= CALL(1, 128, B); break;         \
        case 128 * 64 + 4: failed |= CALL(4, 128, B); break;         \
        case 128 * 64 + 8: failed |= CALL(8, 128, B); break;         \
        default: failed |= CALL(group, head_dim, B); break;          \
    }
#define PG_DISPATCH(CALL)                        \
    if (kv_bf16) {                               \
        PG_PREFILL_CASES(CALL, 1)                \
    } else {                                     \
        PG_PREFILL_CASES(CALL, 0)                \
    }
    if (items >= ITEMS_PER_THREAD * num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : failed)
        for (int item = 0; item < items; ++item) {
            /* latest (longest) blocks first: the causal mask makes them uneven */
            const item_rows g = item_geometry(blocks - 1 - item / num_kv_heads, group, ctx_len,
                                              n_rows, window, row_pad);
            const int h = item % num_kv_heads;
#define PG_ITEM(G, D, B) \
    prefill_item(G, D, B, amx, &kv, query, q_row_stride, out, out_row_stride, &g, h, scale, window, \
                 sinks)
            PG_DISPATCH(PG_ITEM)
#undef PG_ITEM
        }
        return failed ? -1 : 0;
    }
    /* few items: one task per (item, span), partials kept, then merged in span order */
    int *task_start = (int *)malloc(sizeof(int) * ((size_t)items + 1));
    if (task_start == NULL) return -1;
    size_t stride = 0; /* floats of one task's partial: o [R][D], m [R], l [R] */
    task_start[0] = 0;
    for (int item = 0; item < items; ++item) {
        const item_rows g = item_geometry(item / num_kv_heads, group, ctx_len, n_rows, window, row_pad);
        task_start[item + 1] = task_start[item] + g.spans;
        const size_t need = (size_t)g.padded_rows * (head_dim + 2);
        stride = need > stride ? need : stride;
    }
    const int tasks = task_start[items];
    float *partials = (float *)malloc(sizeof(float) * stride * (size_t)tasks);
    if (partials == NULL) {
        free(task_start);
        return -1;
    }
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : failed)
    for (int task = 0; task < tasks; ++task) {
        int item = 0;
        while (task_start[item + 1] <= task) ++item;
        const item_rows g = item_geometry(item / num_kv_heads, group, ctx_len, n_rows, window, row_pad);
        const int h = item % num_kv_heads;
        float *po = partials + stride * (size_t)task;
        float *pm = po + (size_t)g.padded_rows * head_dim, *pl = pm + g.padded_rows;
#define PG_SPAN(G, D, B)                                                                    \
    span_partial(G, D, B, amx, &kv, query, q_row_stride, &g, h, task - task_start[item], scale, \
                 window, po, pm, pl)
        PG_DISPATCH(PG_SPAN)
#undef PG_SPAN
    }
    if (!failed) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
        for (int item = 0; item < items; ++item) {
            const item_rows g = item_geometry(item / num_kv_heads, group, ctx_len, n_rows, window, row_pad);
            const size_t rd = (size_t)g.padded_rows * head_dim;
            float *state = (float *)calloc(rd + 2 * (size_t)g.padded_rows, sizeof(float));
            if (state == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            float *m = state + rd, *l = m + g.padded_rows;
            for (int r = 0; r < g.padded_rows; ++r) m[r] = -FLT_MAX;
            for (int s = 0; s < g.spans; ++s) {
                const float *po = partials + stride * (size_t)(task_start[item] + s);
                const float *pm = po + rd, *pl = pm + g.padded_rows;
                for (int r = 0; r < g.rows; ++r)
                    merge_partial(head_dim, state + (size_t)r * head_dim, m + r, l + r,
                                  po + (size_t)r * head_dim, pm[r], pl[r]);
            }
            write_rows(out, out_row_stride, &g, group, head_dim, item % num_kv_heads, state, m, l,
                       sinks);
            free(state);
        }
    }
    free(partials);
    free(task_start);
#undef PG_DISPATCH
#undef PG_PREFILL_CASES
    return failed ? -1 : 0;
}
