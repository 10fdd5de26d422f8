/* Paged decode attention on CPU, fp32: one query row per sequence, K/V read in place from
 * the pages (no gather into a contiguous buffer).
 *
 * Layout (kernels/layout.py): k_cache, v_cache [num_pages, page_size, Hkv, D] contiguous, fp32
 * or bf16 (kv_bf16). A bf16 element is the top half of an fp32's bits, so it is widened exactly
 * as it is loaded (zero-extend, shift left 16: two vector instructions per 8-16 elements, no
 * buffer); scores, softmax and the weighted sum stay fp32. Decode reads every context byte once,
 * so bf16 pages halve what it streams from DRAM.
 *
 * A sliding layer (window > 0) attends only the last `window` positions, itself included: the
 * walk starts at position len - window, so the pages before the window are never read.
 *
 * Two passes over the context: scores of every query head, softmax, then the weighted sum of
 * V rows; the G = Hq / Hkv query heads of a KV head share every K/V row load. Work is spread
 * over the OpenMP threads of the process (the same libgomp torch loaded, so one pool):
 *   - many sequences: one item per sequence, all heads per token, so each page is read as
 *     one contiguous stream (faster than per-head items from DRAM: docs/benchmarks.md);
 *   - few sequences (fewer than 2 per thread): one item per (sequence, KV head), so a single
 *     long sequence still uses every thread.
 *
 * Built and loaded by kernels/cpu/decode.py; the torch reference is the oracle in the tests.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256

int pg_limits(int *max_group, int *max_head_dim) {
    *max_group = MAX_GROUP;
    *max_head_dim = MAX_HEAD_DIM;
    return 0;
}

/* The hardware prefetcher follows a contiguous stream but restarts at every jump to a
 * scattered page. So while token j of a page is read, token j of the next page is requested
 * (into L2), keeping one page of requests in flight, unless the next page directly follows
 * this one in memory (then the hardware stream already covers it, and extra requests cost:
 * always prefetching slowed contiguous pages and helped shuffled ones; skipping adjacent
 * pages kept the help without the cost: docs/benchmarks.md).
 *
 * A page_walk visits a sequence's token rows in order (one head's slice at `offset`, or the
 * whole row), issuing those requests as it goes. */
typedef struct {
    const char *cache;        /* k_cache or v_cache */
    const int64_t *seq_pages; /* the sequence's page ids */
    int64_t page_stride, token_stride, offset; /* bytes */
    int len, page_size, row_bytes;
    int j, pg;                /* token within the page, page index */
    const char *base, *next;  /* this page (+ offset); the next page when scattered, else NULL */
} page_walk;

/* Enter page w->pg: its base, and the next page to prefetch (NULL: none, or adjacent). */
static inline void walk_enter_page(page_walk *w) {
    const int64_t *pages = w->seq_pages;
    w->base = w->cache + pages[w->pg] * w->page_stride + w->offset;
    const int last = (int64_t)(w->pg + 1) * w->page_size >= w->len;
    w->next = last || pages[w->pg + 1] == pages[w->pg] + 1
                  ? NULL
                  : w->cache + pages[w->pg + 1] * w->page_stride + w->offset;
}

/* A walk over tokens first .. len - 1 (first < len); token_stride, offset and row_elems in
 * elements of elem_bytes (4: fp32, 2: bf16) */
static inline page_walk walk_start(const void *cache, const int64_t *seq_pages, int first,
                                   int len, int page_size, int64_t token_stride, int64_t offset,
                                   int row_elems, int elem_bytes) {
    page_walk w = {(const char *)cache, seq_pages, token_stride * page_size * elem_bytes,
                   token_stride * elem_bytes, offset * elem_bytes, len, page_size,
                   row_elems * elem_bytes, first % page_size, first / page_size, NULL, NULL};
    walk_enter_page(&w);
    return w;
}

/* The next token's row (call exactly `len - first` times). */
static inline const void *walk_next(page_walk *w) {
    if (w->j == w->page_size) {
        w->j = 0;
        ++w->pg;
        walk_enter_page(w);
    }
    const int64_t at = (int64_t)w->j++ * w->token_stride;
    if (w->next != NULL)
        for (int b = 0; b < w->row_bytes; b += 64) __builtin_prefetch(w->next + at + b, 0, 2);
    return w->base + at;
}

/* Each of `rows` score rows of length `len`, in place: exp(score - row max); the row max and
 * the sum of the numerators go to row_max / denom (softmax = numerator / denom). */
static inline void softmax_numerators(float *scores, int rows, int len, float *row_max,
                                      float *denom) {
    for (int r = 0; r < rows; ++r) {
        float *row = scores + (int64_t)r * len;
        float m = -FLT_MAX;
        for (int t = 0; t < len; ++t) m = row[t] > m ? row[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; ++t) {
            row[t] = expf(row[t] - m);
            sum += row[t];
        }
        row_max[r] = m;
        denom[r] = sum;
    }
}

/* One (sequence, KV head) work item. Always inlined into call sites whose group and
 * head_dim are compile-time constants (see the dispatch below), so the per-row accumulators
 * live in vector registers and the D-loops unroll; the generic call site covers the rest. */
static inline __attribute__((always_inline)) int attend_item(
    const int group, const int head_dim, const int bf16, const float *query, int64_t q_row_stride,
    const void *k_cache, const void *v_cache, const int64_t *seq_pages, int len, int64_t row,
    float *out, int64_t out_row_stride, float *lse_row, int h, int num_kv_heads,
    int page_size, float scale, int window, const float *sinks) {
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int first = window > 0 && len > window ? len - window : 0;
    const int n = len - first; /* tokens attended */
    float *scores = (float *)malloc(sizeof(float) * (size_t)group * (size_t)n);
    if (scores == NULL) return 1;
    float q[MAX_GROUP][MAX_HEAD_DIM];
    float acc[MAX_GROUP][MAX_HEAD_DIM];
    for (int g = 0; g < group; ++g) {
        const float *src = query + row * q_row_stride + (int64_t)(h * group + g) * head_dim;
        for (int d = 0; d < head_dim; ++d) {
            q[g][d] = src[d] * scale;
            acc[g][d] = 0.0f;
        }
    }
    /* pass 1: scaled scores of every context token for the G rows */
    const int64_t head_offset = (int64_t)h * head_dim;
    const int elem_bytes = bf16 ? 2 : 4;
    page_walk walk_k = walk_start(k_cache, seq_pages, first, len, page_size, token_stride,
                                  head_offset, head_dim, elem_bytes);
    for (int t = 0; t < n; ++t) {
        const void *k = walk_next(&walk_k);
        for (int g = 0; g < group; ++g) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; ++d) dot += q[g][d] * kv_elem(k, d, bf16);
            scores[g * n + t] = dot;
        }
    }
    float denom[MAX_GROUP], row_max[MAX_GROUP];
    softmax_numerators(scores, group, n, row_max, denom);
    /* pass 2: weighted sum of V rows */
    page_walk walk_v = walk_start(v_cache, seq_pages, first, len, page_size, token_stride,
                                  head_offset, head_dim, elem_bytes);
    for (int t = 0; t < n; ++t) {
        const void *v = walk_next(&walk_v);
        for (int g = 0; g < group; ++g) {
            const float p = scores[g * n + t];
#pragma omp simd
            for (int d = 0; d < head_dim; ++d) acc[g][d] += p * kv_elem(v, d, bf16);
        }
    }
    for (int g = 0; g < group; ++g) {
        float *dst = out + row * out_row_stride + (int64_t)(h * group + g) * head_dim;
        /* a sink takes its share of the softmax's mass and attends nothing */
        const float total =
            sinks != NULL ? denom[g] + expf(sinks[h * group + g] - row_max[g]) : denom[g];
        const float inv = 1.0f / total;
        for (int d = 0; d < head_dim; ++d) dst[d] = acc[g][d] * inv;
        if (lse_row != NULL) lse_row[h * group + g] = row_max[g] + logf(total);
    }
    free(scores);
    return 0;
}

/* One sequence, all heads (G and D compile-time constants at the specialised call sites).
 * Scratch (scaled queries, accumulators, scores) comes from one malloc. */
static inline __attribute__((always_inline)) int attend_sequence(
    const int group, const int head_dim, const int bf16, const int num_kv_heads,
    const float *query, int64_t q_row_stride, const void *k_cache, const void *v_cache,
    const int64_t *seq_pages,
    int len, int64_t row, float *out, int64_t out_row_stride, float *lse_row, int page_size,
    float scale, int window, const float *sinks) {
    const int num_q_heads = group * num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const size_t qd = (size_t)num_q_heads * head_dim;
    const int first = window > 0 && len > window ? len - window : 0;
    const int n = len - first; /* tokens attended */
    float *q = (float *)malloc(sizeof(float) * (2 * qd + (size_t)num_q_heads * (size_t)n + 2 * num_q_heads));
    if (q == NULL) return 1;
    float *acc = q + qd;
    float *scores = acc + qd;
    float *row_max = scores + (size_t)num_q_heads * n;
    float *denom = row_max + num_q_heads;
    const float *src = query + row * q_row_stride;
    for (size_t i = 0; i < qd; ++i) q[i] = src[i] * scale;
    memset(acc, 0, sizeof(float) * qd);
    /* pass 1: each token's K row (all heads) is one contiguous read */
    const int elem_bytes = bf16 ? 2 : 4;
    page_walk walk_k = walk_start(k_cache, seq_pages, first, len, page_size, token_stride, 0,
                                  (int)token_stride, elem_bytes);
    for (int t = 0; t < n; ++t) {
        const void *k = walk_next(&walk_k);
        for (int h = 0; h < num_kv_heads; ++h) {
            for (int g = 0; g < group; ++g) {
                const float *qr = q + (size_t)(h * group + g) * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; ++d) dot += qr[d] * kv_elem(k, h * head_dim + d, bf16);
                scores[(int64_t)(h * group + g) * n + t] = dot;
            }
        }
    }
    softmax_numerators(scores, num_q_heads, n, row_max, denom);
    /* pass 2: weighted sum of V rows, same streaming order */
    page_walk walk_v = walk_start(v_cache, seq_pages, first, len, page_size, token_stride, 0,
                                  (int)token_stride, elem_bytes);
    for (int t = 0; t < n; ++t) {
        const void *v = walk_next(&walk_v);
        for (int h = 0; h < num_kv_heads; ++h) {
            for (int g = 0; g < group; ++g) {
                const float p = scores[(int64_t)(h * group + g) * n + t];
                float *a = acc + (size_t)(h * group + g) * head_dim;
#pragma omp simd
                for (int d = 0; d < head_dim; ++d) a[d] += p * kv_elem(v, h * head_dim + d, bf16);
            }
        }
    }
    float *dst = out + row * out_row_stride;
    for (int r = 0; r < num_q_heads; ++r) {
        const float total = sinks != NULL ? denom[r] + expf(sinks[r] - row_max[r]) : denom[r];
        const float inv = 1.0f / total;
        for (int d = 0; d < head_dim; ++d) dst[r * head_dim + d] = acc[r * head_dim + d] * inv;
        if (lse_row != NULL) lse_row[r] = row_max[r] + logf(total);
    }
    free(q);
    return 0;
}

/*
 * query:   row r, query head h at query + r * q_row_stride + h * head_dim
 * k_cache, v_cache: fp32, or bf16 when kv_bf16 is 1
 * pages:   [num_seqs, max_pages] int64 page ids of each sequence, from its first token
 * lengths: [num_seqs] tokens to attend to (>= 1)
 * rows:    [num_seqs] query row of each sequence
 * out:     row r, head h at out + r * out_row_stride + h * head_dim
 * lse:     NULL, or [num_seqs, Hq] log-sum-exp of the scaled scores
 * window:  0, or a sliding layer's window: each row attends its last `window` positions only
 * sinks:   NULL, or [Hq] attention-sink logits (gpt-oss): each head's softmax also spreads
 *          exp(sink) over nothing, so the output is scaled by sum / (sum + exp(sink))
 * num_pages: pool size; every page id read must be in [0, num_pages)
 * num_rows: rows of query and out; every rows[s] must be in [0, num_rows)
 * num_threads: OpenMP threads to use (torch's intra-op count: the calling thread's own
 *          OpenMP default may differ when it is not the thread torch configured)
 * returns 0; -1 when a scratch buffer could not be allocated (out left partly written); -2
 *          when a length is < 1, a page id or a row is out of range (nothing written)
 */
int pg_paged_decode_f32(const float *query, int64_t q_row_stride, const void *k_cache,
                        const void *v_cache, const int64_t *pages, int64_t max_pages,
                        const int32_t *lengths, const int64_t *rows, float *out,
                        int64_t out_row_stride, float *lse, int num_seqs, int num_q_heads,
                        int num_kv_heads, int head_dim, int page_size, float scale,
                        int num_threads, int64_t num_pages, int64_t num_rows, int kv_bf16,
                        int window, const float *sinks) {
    const int group = num_q_heads / num_kv_heads;
    int failed = 0;
    if (num_threads < 1) num_threads = 1;
    if (window < 0) return -2;
    /* bad addressing is an error, never an out-of-bounds read */
    for (int s = 0; s < num_seqs; ++s) {
        const int len = lengths[s];
        const int64_t used_pages = ((int64_t)len + page_size - 1) / page_size;
        if (len < 1 || used_pages > max_pages || rows[s] < 0 || rows[s] >= num_rows) return -2;
        const int64_t *seq_pages = pages + (int64_t)s * max_pages;
        for (int64_t p = 0; p < used_pages; ++p)
            if (seq_pages[p] < 0 || seq_pages[p] >= num_pages) return -2;
    }

/* One call of CALL(G, D, B) with compile-time constants for the common (group, head_dim)
 * pairs and the page dtype B, else with the runtime values; `continue`s the enclosing
 * parallel loop. */
#define PG_GROUP_CASES(CALL, D, B)                        \
    case D:                                               \
        switch (group) {                                  \
            case 1: failed |= CALL(1, D, B); continue;    \
            case 2: failed |= CALL(2, D, B); continue;    \
            case 3: failed |= CALL(3, D, B); continue;    \
            case 4: failed |= CALL(4, D, B); continue;    \
            case 8: failed |= CALL(8, D, B); continue;    \
            default: break;                               \
        }                                                 \
        break;
#define PG_DISPATCH_DTYPE(CALL, B)             \
    switch (head_dim) {                        \
        PG_GROUP_CASES(CALL, 64, B)            \
        PG_GROUP_CASES(CALL, 128, B)           \
        default: break;                        \
    }                                          \
    failed |= CALL(group, head_dim, B);        \
    continue;
#define PG_DISPATCH(CALL)                                 \
    if (kv_bf16) {                                        \
        PG_DISPATCH_DTYPE(CALL, 1)                        \
    }                                                     \
    PG_DISPATCH_DTYPE(CALL, 0)

    if (num_seqs >= 2 * num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : failed)
        for (int s = 0; s < num_seqs; ++s) {
            const int64_t *seq_pages = pages + (int64_t)s * max_pages;
            float *lse_row = lse != NULL ? lse + (int64_t)s * num_q_heads : NULL;
#define PG_SEQ(G, D, B)                                                                      \
    attend_sequence(G, D, B, num_kv_heads, query, q_row_stride, k_cache, v_cache, seq_pages, \
                    lengths[s], rows[s], out, out_row_stride, lse_row, page_size, scale,   \
                    window, sinks)
            PG_DISPATCH(PG_SEQ)
#undef PG_SEQ
        }
        return failed ? -1 : 0;
    }

    const int num_items = num_seqs * num_kv_heads;

#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) reduction(| : failed)
    for (int item = 0; item < num_items; ++item) {
        const int s = item / num_kv_heads;
        const int h = item % num_kv_heads;
        const int64_t *seq_pages = pages + (int64_t)s * max_pages;
        float *lse_row = lse != NULL ? lse + (int64_t)s * num_q_heads : NULL;
#define PG_ITEM(G, D, B)                                                                   \
    attend_item(G, D, B, query, q_row_stride, k_cache, v_cache, seq_pages, lengths[s],      \
                rows[s], out, out_row_stride, lse_row, h, num_kv_heads, page_size, scale,   \
                window, sinks)
        PG_DISPATCH(PG_ITEM)
#undef PG_ITEM
    }
#undef PG_DISPATCH
#undef PG_DISPATCH_DTYPE
#undef PG_GROUP_CASES
    return failed ? -1 : 0;
}
