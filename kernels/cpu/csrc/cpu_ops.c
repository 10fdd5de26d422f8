/* Fused per-token ops of a decoder layer on CPU, fp32: RMSNorm, SiLU-and-multiply, rotary
 * embedding (in place) and the K/V scatter into the pages (fp32 pages, or bf16 pages rounded
 * to nearest even).
 *
 * Why: each is 3-8 small torch ops per layer (a temporary and a dispatch each); at decode
 * batch sizes the dispatches, not the arithmetic, cost a sizeable share of a step
 * (docs/benchmarks.md). One pass over the rows here, no temporaries.
 *
 * Rows are spread over OpenMP threads only when there is enough work to pay for waking them
 * (prefill); decode-sized calls run on the calling thread. Built together with
 * paged_decode.c into one library by kernels/cpu/library.py; kernels/cpu/ops.py wraps
 * these and the torch versions are the oracle in the tests.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* below this many elements a call stays on one thread */
#define PARALLEL_MIN_ELEMS (1 << 16)

/* for (r = 0; r < rows; ++r) BODY, over OpenMP threads only when `par`. NOTE: a plain branch,
 * not `parallel for if (par)`: libgomp sets up a (one-thread) team even when the clause is
 * false, which doubled the cost of a 16-row decode call. */
#define PG_FOR_ROWS(par, num_threads, rows, r, BODY)                                      \
    if (par) {                                                                          \
        _Pragma("omp parallel for num_threads(num_threads) schedule(static)")            \
        for (int64_t r = 0; r < (rows); ++r) BODY                                        \
    } else {                                                                            \
        for (int64_t r = 0; r < (rows); ++r) BODY                                        \
    }

static inline void rms_norm_row(const float *src, const float *weight, float *dst, int dim,
                                float eps) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < dim; ++d) sum += src[d] * src[d];
    const float inv = (float)(1.0 / sqrt((double)sum / dim + (double)eps));
#pragma omp simd
    for (int d = 0; d < dim; ++d) dst[d] = weight[d] * (src[d] * inv);
}

/* out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps); rows of `dim` floats at the given
 * strides (out may be x itself, not a partial overlap). The mean and the reciprocal square root are taken in double
 * so the result does not depend on -ffast-math's reassociation beyond the sum order. */
void pg_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float *out,
                     int64_t out_stride, int64_t rows, int dim, float eps, int num_threads) {
    const int par = (int64_t)rows * dim >= PARALLEL_MIN_ELEMS && num_threads > 1;
    PG_FOR_ROWS(par, num_threads, rows, r, { rms_norm_row(x + r * x_stride, weight, out + r * out_stride, dim, eps); })
}

/* Per-head RMSNorm in place (Qwen3's q/k norms over a fused q|k|v row): in each of `rows`
 * rows (`row_stride` floats apart) the first `q_heads` heads of `head_dim` floats are normed
 * with `q_weight`, the next `k_heads` with `k_weight`; v and whatever follows is untouched. */
void pg_rms_norm_heads_f32(float *x, int64_t row_stride, int q_heads, int k_heads, int head_dim,
                           const float *q_weight, const float *k_weight, int64_t rows, float eps,
                           int num_threads) {
    const int heads = q_heads + k_heads;
    const int par = (int64_t)rows * heads * head_dim >= PARALLEL_MIN_ELEMS && num_threads > 1;
    PG_FOR_ROWS(par, num_threads, rows, r, {
        float *row = x + r * row_stride;
        for (int h = 0; h < heads; ++h)
            rms_norm_row(row + (int64_t)h * head_dim, h < q_heads ? q_weight : k_weight,
                         row + (int64_t)h * head_dim, head_dim, eps);
    })
}

static inline void silu_mul_row(const float *g, float *dst, int inter) {
    const float *u = g + inter;
#pragma omp simd
    for (int i = 0; i < inter; ++i) dst[i] = g[i] / (1.0f + expf(fminf(-g[i], 88.0f))) * u[i];
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]; gate_up rows at `gu_stride`,
 * out dense [rows, inter]. NOTE: the exponent is clamped so 1 + e^-g stays finite: under
 * -ffast-math the division may become a reciprocal estimate + Newton step, which turns an
 * infinite denominator into NaN (g <= -88 gives ~1e-37 instead of torch's -0). */
void pg_silu_mul_f32(const float *gate_up, int64_t gu_stride, float *out, int64_t rows,
                     int inter, int num_threads) {
    const int par = (int64_t)rows * inter >= PARALLEL_MIN_ELEMS && num_threads > 1;
    PG_FOR_ROWS(par, num_threads, rows, r, { silu_mul_row(gate_up + r * gu_stride, out + r * (int64_t)inter, inter); })
}

static inline void rope_row(float *x, int num_heads, int head_dim, const float *c,
                            const float *s) {
    const int half = head_dim / 2;
    for (int h = 0; h < num_heads; ++h) {
        float *x1 = x + (int64_t)h * head_dim;
        float *x2 = x1 + half;
#pragma omp simd
        for (int i = 0; i < half; ++i) {
            const float a = x1[i], b = x2[i];
            x1[i] = a * c[i] - b * s[i];
            x2[i] = b * c[i] + a * s[i];
        }
    }
}

/* Rotate-half RoPE in place: for heads [0, num_heads) of each row (head h of row r at
 * x + r * row_stride + h * head_dim), pair i = (x[i], x[i + D/2]) turns by the angle whose
 * cos/sin are cos[r * half + i] / sin[r * half + i] (one table row per token). */
void pg_rope_f32(float *x, int64_t row_stride, int num_heads, int head_dim, const float *cos_t,
                 const float *sin_t, int64_t rows, int num_threads) {
    const int half = head_dim / 2;
    const int par = (int64_t)rows * num_heads * head_dim >= PARALLEL_MIN_ELEMS && num_threads > 1;
    PG_FOR_ROWS(par, num_threads, rows, r, {
        rope_row(x + r * row_stride, num_heads, head_dim, cos_t + r * half, sin_t + r * half);
    })
}

/* K/V of token r (row_elems floats each, at k + r * k_stride / v + r * v_stride) into slot
 * slots[r] of the caches ([num_slots, row_elems] dense); slot -1 = skip the token.
 * Returns 0, or -2 (nothing written) when a slot is outside [-1, num_slots). */
int pg_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    float *k_cache, float *v_cache, const int64_t *slots, int64_t rows,
                    int64_t row_elems, int64_t num_slots) {
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] < -1 || slots[r] >= num_slots) return -2;
    const size_t bytes = sizeof(float) * (size_t)row_elems;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slots[r];
        if (slot < 0) continue;
        memcpy(k_cache + slot * row_elems, k + r * k_stride, bytes);
        memcpy(v_cache + slot * row_elems, v + r * v_stride, bytes);
    }
    return 0;
}

/* fp32 -> bf16, rounded to nearest even like torch's .to(torch.bfloat16); a NaN stays a (quiet)
 * NaN. Integer ops only: -ffast-math may assume no NaN in float compares. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* pg_write_kv_f32 into bf16 caches: each fp32 K/V element rounded as it is stored. */
int pg_write_kv_bf16(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                     uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int64_t rows,
                     int64_t row_elems, int64_t num_slots) {
    for (int64_t r = 0; r < rows; ++r)
        if (slots[r] < -1 || slots[r] >= num_slots) return -2;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t slot = slots[r];
        if (slot < 0) continue;
        const float *ks = k + r * k_stride, *vs = v + r * v_stride;
        uint16_t *kd = k_cache + slot * row_elems, *vd = v_cache + slot * row_elems;
#pragma omp simd
        for (int64_t i = 0; i < row_elems; ++i) {
            kd[i] = f32_to_bf16(ks[i]);
            vd[i] = f32_to_bf16(vs[i]);
        }
    }
    return 0;
}
