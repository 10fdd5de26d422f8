/* Paged prefill attention on CPU, fp32: the n new query rows of one sequence attend causally
 * (aligned to the lower right: row i sits at position ctx_len - n + i) to the sequence's
 * context, K/V read in place from its pages. Covers a first prefill (ctx_len == n), a chunk
 * after earlier chunks and a suffix after a cached prefix alike. A sliding layer (window > 0):
 * row i sees positions (pos - window, pos] only; an item's keys start at its first row's
 * window, so the pages before it are never read.
 *
 * Why: the torch path gathers the context into a dense buffer and runs SDPA's CPU flash
 * kernel, whose GEMM blocks are thin at head dim 64 (docs/benchmarks.md); this
 * kernel keeps the G query heads of a KV head together as the rows of one tile, so each K/V
 * row loaded serves G x 16 query rows, and computes 16 keys per vector.
 *
 * Work item: (KV head, block of ROWS_PER_ITEM query positions); its R = ROWS_PER_ITEM * G
 * rows are scaled queries, online-softmax state (max, sum) and output accumulators. Keys go
 * by in blocks of 16: the block's K rows are transposed into kt[D][16] (so a query row's 16
 * scores are D vector FMAs with the query element broadcast), masked past each row's
 * position, folded into the running softmax, and the V rows are accumulated into the rows'
 * outputs. Items are handed out latest block first (the causal mask makes them uneven).
 *
 * Layout (kernels/layout.py): k_cache, v_cache [num_pages, page_size, Hkv, D] contiguous, fp32
 * or bf16 (kv_bf16): a key block's bf16 K and V rows are widened exactly (zero-extend, shift
 * left 16) once per block, K while it is transposed, V into an fp32 block buffer, so the tiles
 * below run the fp32 code unchanged and the conversion is amortised over all the item's rows
 * (widening each V vector as the tiles load it instead was measurably slower than fp32 pages;
 * the block buffer is not: docs/benchmarks.md).
 * Built with the other kernels/cpu/csrc files into one library by kernels/cpu/library.py; the torch
 * path (SDPA) is the oracle in the tests.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"

#define KEYS 16          /* keys per block: one vector of scores */
#define ROWS_PER_ITEM 32 /* query positions per work item */
#define TILE_ROWS 4      /* query rows whose scores and outputs are in registers together */
#define PREFILL_MAX_GROUP 16
#define PREFILL_MAX_HEAD_DIM 256

_Static_assert(sizeof(vkeys) == KEYS * sizeof(float), "KEYS is one vkeys");

int pg_prefill_limits(int *max_group, int *max_head_dim) {
    *max_group = PREFILL_MAX_GROUP;
    *max_head_dim = PREFILL_MAX_HEAD_DIM;
    return 0;
}

/* One work item. `rows` = positions in the item (<= ROWS_PER_ITEM) x group; row r is position
 * i0 + r / group, query head h * group + r % group. head_dim, group and bf16 (the page
 * dtype) are compile-time constants where inlined. Returns 1 when scratch could not be allocated. */
static inline __attribute__((always_inline)) int prefill_item(
    const int group, const int head_dim, const int bf16, const paged_kv *kv, const float *query,
    int64_t q_row_stride, float *out, int64_t out_row_stride, int ctx_len, int n_rows, int h,
    int i0, int positions, float scale, int window) {
    const int rows = positions * group;
    const int first_pos = ctx_len - n_rows + i0; /* position of the item's first query */
    const int last_pos = first_pos + positions - 1;
    /* the first key any of the item's rows sees */
    const int first_key = window > 0 && first_pos >= window ? first_pos - window + 1 : 0;
    /* scratch: q [R][D], o [R][D], kt [D][KEYS], m [R], l [R] with R = rows rounded up to
     * whole tiles (the padding rows are zero queries that see no key); bf16 pages: vb [KEYS][D],
     * the block's V rows widened */
    const int padded_rows = (rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    const int chunks = head_dim / KEYS;
    const size_t qd = (size_t)padded_rows * head_dim;
    size_t floats = 2 * qd + (size_t)head_dim * KEYS * (bf16 ? 2 : 1) + 2 * (size_t)padded_rows;
    floats = (floats + 15) / 16 * 16; /* aligned_alloc takes whole multiples of the alignment */
    float *q = (float *)aligned_alloc(64, sizeof(float) * floats);
    if (q == NULL) return 1;
    float *o = q + qd;
    float *kt = o + qd;
    float *m = kt + (size_t)head_dim * KEYS;
    float *l = m + padded_rows;
    float *vb = l + padded_rows;
    memset(q, 0, sizeof(float) * qd);
    for (int r = 0; r < padded_rows; ++r) {
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
    }
    for (int r = 0; r < rows; ++r) {
        const float *src = query + (int64_t)(i0 + r / group) * q_row_stride +
                           (int64_t)(h * group + r % group) * head_dim;
        for (int d = 0; d < head_dim; ++d) q[(size_t)r * head_dim + d] = src[d] * scale;
    }
    memset(o, 0, sizeof(float) * qd);

    for (int t0 = first_key; t0 <= last_pos; t0 += KEYS) {
        const int nkeys = last_pos + 1 - t0 < KEYS ? last_pos + 1 - t0 : KEYS;
        const float *vrow[KEYS];
        /* K block transposed: kt[d][j] = K[t0 + j][d] (zero past the last key) */
        for (int j = 0; j < KEYS; ++j) {
            if (j < nkeys) {
                const void *k = kv_row(kv, kv->k_cache, t0 + j, h, head_dim);
                const void *v = kv_row(kv, kv->v_cache, t0 + j, h, head_dim);
                if (bf16) {
                    float *row = vb + (size_t)j * head_dim;
                    for (int d = 0; d < head_dim; ++d) row[d] = kv_elem(v, d, 1);
                    vrow[j] = row;
                } else {
                    vrow[j] = (const float *)v;
                }
                for (int d = 0; d < head_dim; ++d) kt[d * KEYS + j] = kv_elem(k, d, bf16);
            } else {
                vrow[j] = NULL;
                for (int d = 0; d < head_dim; ++d) kt[d * KEYS + j] = 0.0f;
            }
        }
        /* TILE_ROWS rows at a time: their 16 scores each stay in registers (one kt row load
         * per TILE_ROWS FMAs), then their softmax update, then their output slices take each
         * V vector loaded once for all the tile's rows */
        for (int r = 0; r < padded_rows; r += TILE_ROWS) {
            vkeys sc[TILE_ROWS];
            for (int i = 0; i < TILE_ROWS; ++i) sc[i] = (vkeys){0};
            const float *q0 = q + (size_t)r * head_dim;
            for (int d = 0; d < head_dim; ++d) {
                const vkeys kd = load_keys(kt + d * KEYS);
                for (int i = 0; i < TILE_ROWS; ++i) sc[i] += q0[i * head_dim + d] * kd;
            }
            float p[TILE_ROWS][KEYS], alpha[TILE_ROWS];
            int most_visible = 0;
            for (int i = 0; i < TILE_ROWS; ++i) {
                /* keys j in [seen, visible) of the block: up to the row's position, from its
                 * window's start; none for the padding rows */
                const int pos = r + i < rows ? first_pos + (r + i) / group : -1;
                const int visible = pos - t0 + 1 < nkeys ? pos - t0 + 1 : nkeys;
                const int seen = window > 0 ? pos - window + 1 - t0 : 0;
                most_visible = visible > most_visible ? visible : most_visible;
                store_keys(p[i], sc[i]);
                float mb = m[r + i];
                for (int j = 0; j < KEYS; ++j)
                    mb = j >= seen && j < visible && p[i][j] > mb ? p[i][j] : mb;
                alpha[i] = expf(m[r + i] - mb);
                float sum = 0.0f;
                /* all 16 lanes through the vector exp; keys outside the row's span weigh 0
                 * (their argument replaced before the exp, so a NaN score still propagates) */
#pragma omp simd reduction(+ : sum)
                for (int j = 0; j < KEYS; ++j) {
                    const int in_span = j >= seen && j < visible;
                    const float e = expf(in_span ? p[i][j] - mb : -1e30f);
                    p[i][j] = in_span ? e : 0.0f;
                    sum += p[i][j];
                }
                m[r + i] = mb;
                l[r + i] = l[r + i] * alpha[i] + sum;
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
    for (int r = 0; r < rows; ++r) {
        float *dst = out + (int64_t)(i0 + r / group) * out_row_stride +
                     (int64_t)(h * group + r % group) * head_dim;
        const float inv = 1.0f / l[r];
        for (int d = 0; d < head_dim; ++d) dst[d] = o[(size_t)r * head_dim + d] * inv;
    }
    free(q);
    return 0;
}

/*
 * query:   n_rows rows; row i, query head g at query + i * q_row_stride + g * head_dim
 * k_cache, v_cache: fp32, or bf16 when kv_bf16 is 1
 * pages:   the sequence's page ids from its first token (at least ceil(ctx_len / page_size))
 * out:     row i, head g at out + i * out_row_stride + g * head_dim (rows dense per head)
 * window:  0, or a sliding layer's window: row i sees its last `window` positions only
 * head_dim must be a multiple of 16 (<= 256), group = Hq / Hkv <= 16.
 * returns 0; -1 when scratch could not be allocated (out partly written); -2 when the sizes or
 *          a page id are out of range (nothing written)
 */
int pg_paged_prefill_f32(const float *query, int64_t q_row_stride, const void *k_cache,
                         const void *v_cache, const int64_t *pages, int64_t num_seq_pages,
                         int ctx_len, int n_rows, float *out, int64_t out_row_stride,
                         int num_q_heads, int num_kv_heads, int head_dim, int page_size,
                         float scale, int num_threads, int64_t num_pages, int kv_bf16,
                         int window) {
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
    const int blocks = (n_rows + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    const int items = blocks * num_kv_heads;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : failed)
    for (int item = 0; item < items; ++item) {
        const int b = blocks - 1 - item / num_kv_heads; /* latest (longest) blocks first */
        const int h = item % num_kv_heads;
        const int i0 = b * ROWS_PER_ITEM;
        const int positions = n_rows - i0 < ROWS_PER_ITEM ? n_rows - i0 : ROWS_PER_ITEM;
#define PG_PREFILL(G, D, B)                                                                  \
    prefill_item(G, D, B, &kv, query, q_row_stride, out, out_row_stride, ctx_len, n_rows, h, \
                 i0, positions, scale, window)
/* compile-time (group, head_dim) for the common shapes, per page dtype B */
#define PG_PREFILL_CASES(B)                                                   \
    switch (head_dim * 64 + group) {                                          \
        case 64 * 64 + 1: failed |= PG_PREFILL(1, 64, B); continue;           \
        case 64 * 64 + 3: failed |= PG_PREFILL(3, 64, B); continue;           \
        case 64 * 64 + 4: failed |= PG_PREFILL(4, 64, B); continue;           \
        case 64 * 64 + 8: failed |= PG_PREFILL(8, 64, B); continue;           \
        case 128 * 64 + 1: failed |= PG_PREFILL(1, 128, B); continue;         \
        case 128 * 64 + 4: failed |= PG_PREFILL(4, 128, B); continue;         \
        case 128 * 64 + 8: failed |= PG_PREFILL(8, 128, B); continue;         \
        default: failed |= PG_PREFILL(group, head_dim, B); continue;          \
    }
        if (kv_bf16) PG_PREFILL_CASES(1)
        PG_PREFILL_CASES(0)
#undef PG_PREFILL_CASES
#undef PG_PREFILL
    }
    return failed ? -1 : 0;
}
