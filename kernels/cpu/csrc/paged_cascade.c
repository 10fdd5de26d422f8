/* The shared-run half of cascade (shared-prefix) decode attention on CPU, fp32: the decode
 * rows of B sequences whose contexts start with the same run of pages attend to that run
 * once, all together, K/V read in place from the pages; optionally merged by log-sum-exp with
 * each sequence's result over its own pages (computed before by pg_paged_decode_f32 with lse),
 * so the caller gets the final rows without any torch merge ops.
 *
 * Why: per KV head the shared run is one K/V matrix seen by R = B * G query rows, i.e. a small
 * GEMM, not B GEMVs. The torch path (SDPA's CPU flash kernel on a strided view, bf16 pages
 * upcast by a copy first) pays that GEMM plus ~10 small merge ops per layer (figures:
 * docs/benchmarks.md, benchmarks/cascade.py).
 *
 * Work item: (KV head, split of the keys). Every item keeps all R rows of its head together,
 * so each K/V row it loads serves all R rows (the point of the cascade); the keys are split so
 * that few KV heads still give every thread work (3 heads on 2 threads: 2 splits, 6 items)
 * without re-reading any K/V row. Within an item, two passes as in paged_decode.c: scores of
 * all its keys (64-key blocks of K transposed into kt[D][64], 4 rows x 64 keys of accumulators
 * in registers), each row's softmax numerators, then the weighted sum of V (bf16 V widened
 * once per block into a buffer, as paged_prefill.c does). Each item leaves its unnormalised
 * partial (row max, sum, output) in a scratch buffer; a second parallel pass merges the splits
 * (and the own-pages result) per row and writes out.
 *
 * Layout (kernels/layout.py): k_cache, v_cache [num_pages, page_size, Hkv, D] contiguous, fp32
 * or bf16 (kv_bf16, widened exactly: a bf16 is the top half of an fp32's bits).
 *
 * Reads rows with kv_rows.h, like the other attention kernels. Built and loaded by
 * kernels/cpu/cascade.py; the torch path is the oracle in tests/kernels/cpu/test_cascade.py.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"

#define KEYS 16            /* keys per vector of scores */
#define VECS 4             /* score vectors per row tile and key block */
#define BLOCK (KEYS * VECS) /* keys per block: transposed K / widened V buffer */
#define TILE_ROWS 4        /* query rows whose scores and outputs are in registers together */
#define MIN_SPLIT_KEYS 256 /* fewer keys per item than this: the partials cost more than the
                              extra parallelism gains */
#define CASCADE_MAX_HEAD_DIM 256
#define MAX_ITEM_SCORES (1 << 18) /* scores per item (1 MiB): more keys split further */
#define CASCADE_MAX_ROWS 4096 /* rows per KV head (B x G): bounds the scratch */

_Static_assert(sizeof(vkeys) == KEYS * sizeof(float), "KEYS is one vkeys");

int pg_cascade_limits(int *max_rows, int *max_head_dim) {
    *max_rows = CASCADE_MAX_ROWS;
    *max_head_dim = CASCADE_MAX_HEAD_DIM;
    return 0;
}

/* One (KV head h, keys [t_begin, t_end)) item over all `rows` = B x G rows of the head; row r
 * is sequence r / group (query row seq_rows[r / group]), query head h * group + r % group.
 * Two passes, like paged_decode.c (the item's keys are few enough that the score matrix stays
 * in L2): S = Q K^T, each row's softmax numerators, then O = P V. Without an online softmax the
 * GEMM loops are pure FMAs, the softmax runs over long vectorised rows, and each row tile keeps
 * its outputs in registers over a whole key block (paged_prefill.c's online softmax was
 * slower than SDPA here, these two passes are not: docs/benchmarks.md, benchmarks/cascade.py).
 * Leaves the unnormalised partial in o [rows][D], m [rows], l [rows].
 * head_dim and bf16 are compile-time constants where inlined. Returns 1 when scratch could not
 * be allocated. */
static inline __attribute__((always_inline)) int cascade_item(
    const int head_dim, const int bf16, const paged_kv *kv, const float *query,
    int64_t q_row_stride, const int64_t *seq_rows, int group, int rows, int h, int t_begin,
    int t_end, float scale, float *o, float *m, float *l) {
    /* scratch: q [R][D] and the padding rows' o [R - rows][D] with R = rows rounded up to
     * whole tiles (padding rows are zero queries whose results are dropped), s [R][n] with n =
     * the item's keys rounded up to whole blocks, kt [D][BLOCK], bf16 pages: vb [BLOCK][D] */
    const int padded_rows = (rows + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    const int pad = padded_rows - rows;
    const int chunks = head_dim / KEYS;
    const int n_keys = t_end - t_begin;
    const int n_padded = (n_keys + BLOCK - 1) / BLOCK * BLOCK;
    const size_t qd = (size_t)padded_rows * head_dim;
    size_t floats = qd + (size_t)pad * head_dim + (size_t)padded_rows * n_padded +
                    (size_t)head_dim * BLOCK * (bf16 ? 2 : 1);
    floats = (floats + 15) / 16 * 16; /* aligned_alloc takes whole multiples of the alignment */
    float *q = (float *)aligned_alloc(64, sizeof(float) * floats);
    if (q == NULL) return 1;
    float *pad_o = q + qd;
    float *s = pad_o + (size_t)pad * head_dim;
    float *kt = s + (size_t)padded_rows * n_padded;
    float *vb = kt + (size_t)head_dim * BLOCK;
#define ROW_O(r) ((r) < rows ? o + (size_t)(r) * head_dim : pad_o + (size_t)((r) - rows) * head_dim)
    memset(q, 0, sizeof(float) * qd);
    for (int r = 0; r < rows; ++r) {
        const float *src = query + seq_rows[r / group] * q_row_stride +
                           (int64_t)(h * group + r % group) * head_dim;
        for (int d = 0; d < head_dim; ++d) q[(size_t)r * head_dim + d] = src[d] * scale;
    }

    /* pass 1: scores, a block of BLOCK keys (transposed, kt[d][j] = K[t0 + j][d], zero past
     * the last key) against every row tile: TILE_ROWS x VECS independent accumulators */
    for (int b0 = 0; b0 < n_padded; b0 += BLOCK) {
        const int nkeys = n_keys - b0 < BLOCK ? n_keys - b0 : BLOCK;
        for (int j = 0; j < BLOCK; ++j) {
            if (j < nkeys) {
                const void *k = kv_row(kv, kv->k_cache, t_begin + b0 + j, h, head_dim);
                for (int d = 0; d < head_dim; ++d) kt[d * BLOCK + j] = kv_elem(k, d, bf16);
            } else {
                for (int d = 0; d < head_dim; ++d) kt[d * BLOCK + j] = 0.0f;
            }
        }
        for (int r = 0; r < padded_rows; r += TILE_ROWS) {
            vkeys sc[TILE_ROWS][VECS];
            for (int i = 0; i < TILE_ROWS; ++i)
                for (int c = 0; c < VECS; ++c) sc[i][c] = (vkeys){0};
            const float *q0 = q + (size_t)r * head_dim;
            for (int d = 0; d < head_dim; ++d) {
                vkeys kd[VECS];
                for (int c = 0; c < VECS; ++c) kd[c] = load_keys(kt + d * BLOCK + c * KEYS);
                for (int i = 0; i < TILE_ROWS; ++i) {
                    const float qv = q0[i * head_dim + d];
                    for (int c = 0; c < VECS; ++c) sc[i][c] += qv * kd[c];
                }
            }
            for (int i = 0; i < TILE_ROWS; ++i)
                for (int c = 0; c < VECS; ++c)
                    store_keys(s + (size_t)(r + i) * n_padded + b0 + c * KEYS, sc[i][c]);
        }
    }
    /* softmax numerators over the real keys; the padding keys weigh 0 */
    for (int r = 0; r < padded_rows; ++r) {
        float *row = s + (size_t)r * n_padded;
        float mx = -FLT_MAX;
#pragma omp simd reduction(max : mx)
        for (int t = 0; t < n_keys; ++t) mx = row[t] > mx ? row[t] : mx;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < n_keys; ++t) {
            row[t] = expf(row[t] - mx);
            sum += row[t];
        }
        for (int t = n_keys; t < n_padded; ++t) row[t] = 0.0f;
        if (r < rows) {
            m[r] = mx;
            l[r] = sum;
        }
    }
    /* pass 2: O = P V, a block of V rows (bf16: widened once into vb) against every row tile,
     * whose outputs stay in registers over the block */
    for (int b0 = 0; b0 < n_padded; b0 += BLOCK) {
        const int nkeys = n_keys - b0 < BLOCK ? n_keys - b0 : BLOCK;
        const float *vrow[BLOCK];
        for (int j = 0; j < nkeys; ++j) {
            const void *v = kv_row(kv, kv->v_cache, t_begin + b0 + j, h, head_dim);
            if (bf16) {
                float *row = vb + (size_t)j * head_dim;
                for (int d = 0; d < head_dim; ++d) row[d] = kv_elem(v, d, 1);
                vrow[j] = row;
            } else {
                vrow[j] = (const float *)v;
            }
        }
        for (int r = 0; r < padded_rows; r += TILE_ROWS) {
            const float *p0 = s + (size_t)r * n_padded + b0;
            for (int c0 = 0; c0 < chunks; c0 += 4) {
                const int cn = chunks - c0 < 4 ? chunks - c0 : 4;
                vkeys acc[TILE_ROWS][4];
                for (int i = 0; i < TILE_ROWS; ++i)
                    for (int c = 0; c < cn; ++c)
                        acc[i][c] = b0 == 0 ? (vkeys){0}
                                            : load_keys(ROW_O(r + i) + (c0 + c) * KEYS);
                for (int j = 0; j < nkeys; ++j) {
                    vkeys vv[4];
                    for (int c = 0; c < cn; ++c) vv[c] = load_keys(vrow[j] + (c0 + c) * KEYS);
                    for (int i = 0; i < TILE_ROWS; ++i) {
                        const float pij = p0[(size_t)i * n_padded + j];
                        for (int c = 0; c < cn; ++c) acc[i][c] += pij * vv[c];
                    }
                }
                for (int i = 0; i < TILE_ROWS; ++i)
                    for (int c = 0; c < cn; ++c)
                        store_keys(ROW_O(r + i) + (c0 + c) * KEYS, acc[i][c]);
            }
        }
    }
#undef ROW_O
    free(q);
    return 0;
}

/*
 * query:   row r, query head g at query + r * q_row_stride + g * head_dim
 * k_cache, v_cache: fp32, or bf16 when kv_bf16 is 1
 * shared_pages: [n_shared_pages] int64 page ids of the shared run, from its first token
 * shared_len: tokens in the run (>= 1, <= n_shared_pages * page_size); every row sees them all
 * seq_rows: [num_seqs] query row of each sequence (and its output row)
 * own_lse: NULL: out gets the shared-run attention alone; else [num_seqs, Hq] the log-sum-exp
 *          of each row's attention over its own pages, whose normalised output is already in
 *          out (at the same rows): out gets the attention over the union, merged in place
 * out:     row r, head g at out + r * out_row_stride + g * head_dim; written at seq_rows
 * lse:     NULL, or [num_seqs, Hq] the log-sum-exp of what out holds
 * num_pages: pool size; every page id read must be in [0, num_pages)
 * num_rows: rows of query and out; every seq_rows[s] must be in [0, num_rows)
 * head_dim must be a multiple of 16 (<= 256), num_seqs x Hq / Hkv <= CASCADE_MAX_ROWS.
 * returns 0; -1 when scratch could not be allocated (nothing written); -2 when the sizes, a
 *          page id or a row are out of range (nothing written)
 */
int pg_cascade_decode_f32(const float *query, int64_t q_row_stride, const void *k_cache,
                          const void *v_cache, const int64_t *shared_pages,
                          int64_t n_shared_pages, int shared_len, const int64_t *seq_rows,
                          int num_seqs, const float *own_lse, float *out, int64_t out_row_stride,
                          float *lse, int num_q_heads, int num_kv_heads, int head_dim,
                          int page_size, float scale, int num_threads, int64_t num_pages,
                          int64_t num_rows, int kv_bf16) {
    if (num_seqs < 1 || shared_len < 1 || page_size < 1 || num_kv_heads < 1 ||
        num_q_heads % num_kv_heads || head_dim % KEYS || head_dim > CASCADE_MAX_HEAD_DIM ||
        (int64_t)num_seqs * (num_q_heads / num_kv_heads) > CASCADE_MAX_ROWS)
        return -2;
    /* bad addressing is an error, never an out-of-bounds read or write */
    if (((int64_t)shared_len + page_size - 1) / page_size > n_shared_pages) return -2;
    for (int64_t p = 0; p < n_shared_pages; ++p)
        if (shared_pages[p] < 0 || shared_pages[p] >= num_pages) return -2;
    for (int s = 0; s < num_seqs; ++s)
        if (seq_rows[s] < 0 || seq_rows[s] >= num_rows) return -2;
    if (num_threads < 1) num_threads = 1;
    const int group = num_q_heads / num_kv_heads;
    const int rows = num_seqs * group; /* per KV head */
    /* splits: enough items for ~2 per thread, at least MIN_SPLIT_KEYS keys each, whole blocks,
     * and few enough keys each that an item's scores ([rows][keys]) stay about L2-sized */
    const int blocks = (shared_len + BLOCK - 1) / BLOCK;
    int splits = (2 * num_threads + num_kv_heads - 1) / num_kv_heads;
    const int most_splits = (shared_len + MIN_SPLIT_KEYS - 1) / MIN_SPLIT_KEYS;
    splits = num_threads == 1 ? 1 : splits < most_splits ? splits : most_splits;
    const int fewest_splits = (int)(((int64_t)rows * blocks * BLOCK + MAX_ITEM_SCORES - 1) /
                                    MAX_ITEM_SCORES);
    splits = splits > fewest_splits ? splits : fewest_splits;
    const int blocks_per_split = (blocks + splits - 1) / splits;
    splits = (blocks + blocks_per_split - 1) / blocks_per_split; /* none empty */
    const int elem_bytes = kv_bf16 ? 2 : 4;
    const paged_kv kv = {(const char *)k_cache, (const char *)v_cache, shared_pages,
                           (int64_t)page_size * num_kv_heads * head_dim * elem_bytes,
                           (int64_t)num_kv_heads * head_dim * elem_bytes, page_size, elem_bytes};
    /* partials: [splits][Hkv][rows] x (o [D], m, l) */
    const size_t part_rows = (size_t)splits * num_kv_heads * rows;
    float *part_o = (float *)malloc(sizeof(float) * part_rows * (head_dim + 2));
    if (part_o == NULL) return -1;
    float *part_m = part_o + part_rows * head_dim;
    float *part_l = part_m + part_rows;
    const int items = splits * num_kv_heads;
    int failed = 0;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : failed)
    for (int item = 0; item < items; ++item) {
        const int h = item % num_kv_heads;
        const int split = item / num_kv_heads;
        const int t_begin = split * blocks_per_split * BLOCK;
        const int t_stop = t_begin + blocks_per_split * BLOCK;
        const int t_end = t_stop < shared_len ? t_stop : shared_len;
        const size_t first = ((size_t)split * num_kv_heads + h) * rows;
#define PG_CASCADE(D, B)                                                                       \
    cascade_item(D, B, &kv, query, q_row_stride, seq_rows, group, rows, h, t_begin, t_end,     \
                 scale, part_o + first * head_dim, part_m + first, part_l + first)
        /* compile-time head_dim for the common sizes, per page dtype */
        if (kv_bf16) {
            if (head_dim == 64) failed |= PG_CASCADE(64, 1);
            else if (head_dim == 128) failed |= PG_CASCADE(128, 1);
            else failed |= PG_CASCADE(head_dim, 1);
        } else {
            if (head_dim == 64) failed |= PG_CASCADE(64, 0);
            else if (head_dim == 128) failed |= PG_CASCADE(128, 0);
            else failed |= PG_CASCADE(head_dim, 0);
        }
#undef PG_CASCADE
    }
    if (failed) {
        free(part_o);
        return -1;
    }
    /* merge: softmax over the union = each partial weighted by its share of the mass */
    const int merge_items = num_seqs * num_kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int item = 0; item < merge_items; ++item) {
        const int s = item / num_kv_heads;
        const int h = item % num_kv_heads;
        for (int g = 0; g < group; ++g) {
            const int r = s * group + g; /* row within the head */
            const int qh = h * group + g;
            float *dst = out + seq_rows[s] * out_row_stride + (int64_t)qh * head_dim;
            float mx = own_lse != NULL ? own_lse[(int64_t)s * num_q_heads + qh] : -FLT_MAX;
            for (int sp = 0; sp < splits; ++sp) {
                const float ms = part_m[((size_t)sp * num_kv_heads + h) * rows + r];
                mx = ms > mx ? ms : mx;
            }
            float acc[CASCADE_MAX_HEAD_DIM];
            float total = 0.0f;
            if (own_lse != NULL) {
                /* own output is normalised: its mass is exp(lse_own) */
                const float w = expf(own_lse[(int64_t)s * num_q_heads + qh] - mx);
                for (int d = 0; d < head_dim; ++d) acc[d] = dst[d] * w;
                total = w;
            } else {
                for (int d = 0; d < head_dim; ++d) acc[d] = 0.0f;
            }
            for (int sp = 0; sp < splits; ++sp) {
                const size_t pr = ((size_t)sp * num_kv_heads + h) * rows + r;
                const float w = expf(part_m[pr] - mx);
                const float *po = part_o + pr * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; ++d) acc[d] += po[d] * w;
                total += part_l[pr] * w;
            }
            const float inv = 1.0f / total;
            for (int d = 0; d < head_dim; ++d) dst[d] = acc[d] * inv;
            if (lse != NULL) lse[(int64_t)s * num_q_heads + qh] = mx + logf(total);
        }
    }
    free(part_o);
    return 0;
}
