// One decode step through every layer of a pre-norm dense decoder, in one call (a step of a
// few rows: decode rows, draft verifications, small prefill chunks).
//
// Why: a decode step's per-layer ops are small (one row per sequence), and driving each from
// Python costs a ctypes call and a fresh output tensor per op, a quarter of a b1 step on
// SmolLM2. Here the loop over layers runs in C on preallocated buffers, and each op is the
// same library function the per-op path calls, with the same arguments: the result is
// bit-identical to that path (tests/engine/models/test_decode_step.py), only the dispatch is gone.
// What each layer runs was bound once, at load (kernels/cpu/decode_step.py): the descriptors
// below carry the packed weights and which kernel reads them.
//
// Layer: x = norm(h); qkv = x W_qkv (+ b); per-head q/k norms (Qwen3); rotate q|k; write k, v into the pages; attention of
// each row over its pages (plain groups, cascade groups sharing a run of pages, or one
// sequence's consecutive rows, causal); h += attn
// W_o; x = norm(h); h += silu(x W_gate) * (x W_up) W_down.

#include <stddef.h>
#include <stdint.h>

// ---- the library's kernels this loop calls (their own files document them) -----------------
void pg_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out,
                     int64_t out_stride, int64_t rows, int dim, float eps, int num_threads);
void pg_rms_norm_heads_f32(float *x, int64_t row_stride, int q_heads, int k_heads, int head_dim,
                           const float *q_weight, const float *k_weight, int64_t rows, float eps,
                           int num_threads);
void pg_silu_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int64_t rows,
                     int inter, int num_threads);
void pg_rope_f32(float *x, int64_t row_stride, int num_heads, int head_dim, const float *cos_t,
                 const float *sin_t, int64_t rows, int num_threads);
int pg_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    float *k_cache, float *v_cache, const int64_t *slots, int64_t rows,
                    int64_t row_elems, int64_t num_slots);
int pg_write_kv_bf16(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                     uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int64_t rows,
                     int64_t row_elems, int64_t num_slots);
void pg_linear_f32(const float *x, int64_t ldx, const float *packed, const float *bias,
                   const float *residual, int64_t ld_res, float *y, int64_t ldy, int M, int N,
                   int K, int num_threads);
int pg_linear_quant_f32(int qtype, const float *x, int64_t ldx, const uint8_t *packed,
                        const float *bias, const float *residual, int64_t ld_res, float *y,
                        int64_t ldy, int M, int N, int K, int scratch_min_rows, int num_threads);
int pg_linear_quant_amx_f32(int qtype, const float *x, int64_t ldx, const uint8_t *packed,
                            const float *bias, const float *residual, int64_t ld_res, float *y,
                            int64_t ldy, int M, int N, int K, int num_threads);
int pg_linear_bf16(const float *x, int64_t ldx, const uint16_t *packed, const float *bias,
                   const float *residual, int64_t ld_res, float *y, int64_t ldy, int M, int N,
                   int K, int amx_min_rows, int num_threads);
int pg_linear_q8(int qtype, const float *x, int64_t ldx, const uint8_t *packed, const float *bias,
                 const float *residual, int64_t ld_res, float *y, int64_t ldy, int M, int N, int K,
                 int num_threads);
int pg_paged_decode_f32(const float *query, int64_t q_row_stride, const void *k_cache,
                        const void *v_cache, const int64_t *pages, int64_t max_pages,
                        const int32_t *lengths, const int64_t *rows, float *out,
                        int64_t out_row_stride, float *lse, int num_seqs, int num_q_heads,
                        int num_kv_heads, int head_dim, int page_size, float scale,
                        int num_threads, int64_t num_pages, int64_t num_rows, int kv_bf16,
                        int window, const float *sinks);
int pg_paged_prefill_f32(const float *query, int64_t q_row_stride, const void *k_cache,
                         const void *v_cache, const int64_t *pages, int64_t n_pages, int ctx_len,
                         int n_rows, float *out, int64_t out_row_stride, int num_q_heads,
                         int num_kv_heads, int head_dim, int page_size, float scale,
                         int num_threads, int64_t num_pages, int kv_bf16, int window,
                         const float *sinks);
int pg_cascade_decode_f32(const float *query, int64_t q_row_stride, const void *k_cache,
                          const void *v_cache, const int64_t *shared_pages,
                          int64_t n_shared_pages, int shared_len, const int64_t *seq_rows,
                          int num_seqs, const float *own_lse, float *out, int64_t out_row_stride,
                          float *lse, int num_q_heads, int num_kv_heads, int head_dim,
                          int page_size, float scale, int num_threads, int64_t num_pages,
                          int64_t num_rows, int kv_bf16);

// ---- what the load bound (mirrored by ctypes Structures in kernels/cpu/decode_step.py) -------

enum { PG_LINEAR_F32 = 0, PG_LINEAR_QUANT = 1, PG_LINEAR_BF16 = 2, PG_LINEAR_Q8 = 3 };

typedef struct {
    int32_t kind;              // PG_LINEAR_*
    int32_t qtype;             // ggml block type id (QUANT, Q8)
    int32_t n, k;              // out and in features
    int32_t amx_min_rows;      // QUANT: AMX kernel from this many rows (0: never); BF16: its own
    int32_t scratch_min_rows;  // QUANT: the register kernel's scratch threshold
    const void *packed;
    const float *bias;         // NULL: none
} pg_linear_op;

typedef struct {
    const float *input_norm;  // [H]
    const float *mlp_norm;    // [H]
    int32_t rotate;           // 0: a layer without RoPE (SmolLM3's NoPE layers)
    const float *q_norm;      // [D] per-head q norm (Qwen3), NULL: none (k_norm likewise)
    const float *k_norm;
    pg_linear_op qkv, o, gate_up, down;
} pg_dense_layer;

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter;
    int32_t page_size, kv_bf16;
    float eps, scale;
    const pg_dense_layer *layers;
} pg_dense_model;

typedef struct {
    const int64_t *rows;     // [B] query rows of the group's sequences
    const int64_t *pages;    // [B, max_pages] each sequence's own pages
    int64_t max_pages;
    const int32_t *lengths;  // [B] tokens attended from its first listed page
    int32_t num_seqs;
    int32_t shared_len;          // cascade: tokens of the shared run (0: a plain group)
    const int64_t *shared_pages; // cascade: [n_shared_pages]
    int64_t n_shared_pages;
    float *own_lse;              // cascade: [B, Hq] scratch
    int32_t prefill_rows;        // > 0: one sequence's consecutive new rows (causal over its
    int32_t ctx_len;             // ctx_len tokens, ``pages`` its pages), from query row
    int64_t first_row;           // first_row on (a prefill chunk, a draft verification)
} pg_decode_group;

static int run_linear(const pg_linear_op *op, const float *x, int64_t ldx,
                      const float *residual, int64_t ld_res, float *y, int64_t ldy, int rows,
                      int threads) {
    switch (op->kind) {
    case PG_LINEAR_F32:
        pg_linear_f32(x, ldx, (const float *)op->packed, op->bias, residual, ld_res, y, ldy, rows,
                      op->n, op->k, threads);
        return 0;
    case PG_LINEAR_QUANT:
        // as NativeLinearQuant: the AMX kernel from its row threshold, the register kernel
        // when it declines (it wrote nothing then)
        if (op->amx_min_rows > 0 && rows >= op->amx_min_rows &&
            pg_linear_quant_amx_f32(op->qtype, x, ldx, (const uint8_t *)op->packed, op->bias,
                                    residual, ld_res, y, ldy, rows, op->n, op->k, threads) == 0)
            return 0;
        return pg_linear_quant_f32(op->qtype, x, ldx, (const uint8_t *)op->packed, op->bias,
                                   residual, ld_res, y, ldy, rows, op->n, op->k,
                                   op->scratch_min_rows, threads) ? -3 : 0;
    case PG_LINEAR_BF16:
        return pg_linear_bf16(x, ldx, (const uint16_t *)op->packed, op->bias, residual, ld_res, y,
                              ldy, rows, op->n, op->k, op->amx_min_rows, threads) ? -3 : 0;
    case PG_LINEAR_Q8:
        return pg_linear_q8(op->qtype, x, ldx, (const uint8_t *)op->packed, op->bias, residual,
                            ld_res, y, ldy, rows, op->n, op->k, threads) ? -3 : 0;
    default:
        return -4;
    }
}

// Attention of every decode row of the step for one layer, into attn [T, Hq * D].
static int attend(const pg_dense_model *m, const float *qkv, int64_t ld_qkv, const void *kc,
                  const void *vc, const pg_decode_group *groups, int num_groups, float *attn,
                  int64_t num_pages, int64_t rows, int threads) {
    const int q = m->num_heads * m->head_dim;
    for (int g = 0; g < num_groups; ++g) {
        const pg_decode_group *grp = &groups[g];
        if (grp->prefill_rows > 0) {
            int rc = pg_paged_prefill_f32(qkv + grp->first_row * ld_qkv, ld_qkv, kc, vc,
                                          grp->pages, grp->max_pages, grp->ctx_len,
                                          grp->prefill_rows, attn + grp->first_row * q, q,
                                          m->num_heads, m->num_kv_heads, m->head_dim,
                                          m->page_size, m->scale, threads, num_pages,
                                          m->kv_bf16, 0, NULL);
            if (rc != 0)
                return -3;  // the addressing was checked: only its scratch can fail
            continue;
        }
        int rc = pg_paged_decode_f32(qkv, ld_qkv, kc, vc, grp->pages, grp->max_pages,
                                     grp->lengths, grp->rows, attn, q,
                                     grp->shared_len ? grp->own_lse : NULL, grp->num_seqs,
                                     m->num_heads, m->num_kv_heads, m->head_dim, m->page_size,
                                     m->scale, threads, num_pages, rows, m->kv_bf16, 0, NULL);
        if (rc == 0 && grp->shared_len)
            rc = pg_cascade_decode_f32(qkv, ld_qkv, kc, vc, grp->shared_pages,
                                       grp->n_shared_pages, grp->shared_len, grp->rows,
                                       grp->num_seqs, grp->own_lse, attn, q, NULL,
                                       m->num_heads, m->num_kv_heads, m->head_dim, m->page_size,
                                       m->scale, threads, num_pages, rows, m->kv_bf16);
        if (rc != 0)
            return -3;
    }
    return 0;
}

static int page_ok(int64_t page, int64_t num_pages) { return page >= 0 && page < num_pages; }

// Every slot, row, length and page the step will use, checked once before layer 0 (the
// addressing is the same for every layer): a bad one is refused before anything is written.
static int addressing_ok(const pg_dense_model *m, int64_t num_pages, int64_t rows,
                         const int64_t *slots, const pg_decode_group *groups, int num_groups) {
    const int64_t num_slots = num_pages * m->page_size;
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] < -1 || slots[r] >= num_slots) return 0;
    for (int g = 0; g < num_groups; ++g) {
        const pg_decode_group *grp = &groups[g];
        if (grp->prefill_rows > 0) {
            if (grp->first_row < 0 || grp->first_row + grp->prefill_rows > rows ||
                grp->ctx_len < grp->prefill_rows ||
                grp->max_pages * m->page_size < grp->ctx_len)
                return 0;
            for (int64_t p = 0; p < (grp->ctx_len + m->page_size - 1) / m->page_size; ++p)
                if (!page_ok(grp->pages[p], num_pages)) return 0;
            continue;
        }
        for (int b = 0; b < grp->num_seqs; ++b) {
            const int64_t len = grp->lengths[b];
            if (grp->rows[b] < 0 || grp->rows[b] >= rows || len < 1 ||
                len > grp->max_pages * m->page_size)
                return 0;
            for (int64_t p = 0; p < (len + m->page_size - 1) / m->page_size; ++p)
                if (!page_ok(grp->pages[b * grp->max_pages + p], num_pages)) return 0;
        }
        if (grp->shared_len) {
            if (grp->shared_len < 1 || grp->shared_len > grp->n_shared_pages * m->page_size)
                return 0;
            for (int64_t p = 0; p < grp->n_shared_pages; ++p)
                if (!page_ok(grp->shared_pages[p], num_pages)) return 0;
        }
    }
    return 1;
}

// The step. ``hidden [T, H]`` holds the embedded tokens and gets the last layer's output;
// ``spare [T, H]`` and the other buffers are scratch of the sizes named. ``kv_caches``: 2 L
// pointers (layer l's K then V pages, [num_pages, page_size, Hkv, D] fp32 or bf16); ``cos``,
// ``sin``: [T, D/2] (NULL: no rotation). Returns 0; -2 for a slot, row, length or page out of
// range (found before layer 0: nothing written); -3 when a kernel could not allocate its
// scratch (the layers before it have written their K/V, as the per-op path would have).
int pg_dense_decode_step(const pg_dense_model *m, void *const *kv_caches, int64_t num_pages,
                         float *hidden, float *spare, float *x, float *qkv, float *attn,
                         float *gate_up, float *act, int64_t rows, const float *cos_t,
                         const float *sin_t, const int64_t *slots,
                         const pg_decode_group *groups, int num_groups, int num_threads) {
    const int h = m->hidden, d = m->head_dim;
    const int q = m->num_heads * d, kv = m->num_kv_heads * d, inter = m->inter;
    const int64_t ld_qkv = q + 2 * kv, num_slots = num_pages * m->page_size;
    const int t = (int)rows;
    if (!addressing_ok(m, num_pages, rows, slots, groups, num_groups))
        return -2;
    for (int l = 0; l < m->num_layers; ++l) {
        const pg_dense_layer *layer = &m->layers[l];
        void *kc = kv_caches[2 * l], *vc = kv_caches[2 * l + 1];
        pg_rms_norm_f32(hidden, h, layer->input_norm, x, h, rows, h, m->eps, num_threads);
        int rc = run_linear(&layer->qkv, x, h, NULL, 0, qkv, ld_qkv, t, num_threads);
        if (rc) return rc;
        if (layer->q_norm != NULL)  // normed before they turn, as the per-op path does
            pg_rms_norm_heads_f32(qkv, ld_qkv, m->num_heads, m->num_kv_heads, d, layer->q_norm,
                                  layer->k_norm, rows, m->eps, num_threads);
        if (cos_t != NULL && layer->rotate)  // q and k heads turn together: adjacent in a row
            pg_rope_f32(qkv, ld_qkv, m->num_heads + m->num_kv_heads, d, cos_t, sin_t, rows,
                        num_threads);
        rc = m->kv_bf16
            ? pg_write_kv_bf16(qkv + q, ld_qkv, qkv + q + kv, ld_qkv, (uint16_t *)kc,
                               (uint16_t *)vc, slots, rows, kv, num_slots)
            : pg_write_kv_f32(qkv + q, ld_qkv, qkv + q + kv, ld_qkv, (float *)kc, (float *)vc,
                              slots, rows, kv, num_slots);
        if (rc) return -2;  // not reached: the slots were checked
        rc = attend(m, qkv, ld_qkv, kc, vc, groups, num_groups, attn, num_pages, rows,
                    num_threads);
        if (rc) return rc;
        // the residual adds are fused into the projections: spare = hidden + attn W_o, then
        // hidden = spare + mlp(norm(spare)), so the stream ends each layer where it began
        rc = run_linear(&layer->o, attn, q, hidden, h, spare, h, t, num_threads);
        if (rc) return rc;
        pg_rms_norm_f32(spare, h, layer->mlp_norm, x, h, rows, h, m->eps, num_threads);
        rc = run_linear(&layer->gate_up, x, h, NULL, 0, gate_up, 2 * inter, t, num_threads);
        if (rc) return rc;
        pg_silu_mul_f32(gate_up, 2 * inter, act, rows, inter, num_threads);
        rc = run_linear(&layer->down, act, inter, spare, h, hidden, h, t, num_threads);
        if (rc) return rc;
    }
    return 0;
}
