/* A hybrid model's linear-attention (Gated DeltaNet) layer on CPU, fp32: the gated delta rule
 * run token by token over a flat varlen batch, and its short causal conv1d + SiLU. The torch
 * reference (kernels/torch_cpu/gated_delta.py) is the contract and the oracle in the tests.
 *
 * Layout (rows of every sequence of the step back to back, like attention):
 *   q, k       [T, Hq, Dk]  heads dense, rows at q_stride / k_stride (Hq = Hv, or Hk when fused)
 *   v          [T, Hv, Dv]  heads dense, rows at v_stride
 *   g, beta    [T, Hv]      rows at g_stride / beta_stride (fused: the raw a and b)
 *   state_in   [S, Hv, Dk, Dv] contiguous, or with state_slots [S] int64 (else NULL) a pool
 *              [N, Hv, Dk, Dv] whose entry state_slots[s] is sequence s's
 *   state_out  [S, Hv, Dk, Dv] contiguous, or with write_slots the pool's entries again (in
 *              place; distinct slots); it may be state_in itself (in place)
 *   out        [T, Hv, Dv]  contiguous
 *   save_index [T] int32: -1, or the slot p of saved [P, Hv, Dk, Dv] that takes the state
 *              after that row
 *   qsl        [S + 1] int64: sequence s owns rows qsl[s] .. qsl[s + 1] - 1
 *
 * NOTE: bit-identity. A sequence's state must not depend on how its tokens were split into
 * calls nor on what else is in the batch (the hybrid prefix cache restores a checkpoint and
 * continues bit-identically to a cold run). So every value is computed by the same
 * instructions from the same inputs whatever the call, never by a path chosen by an address,
 * a length or the batch: a work item is one (sequence, head, column block) walked token by
 * token; columns of the state are independent in the recurrence (S^T k, the update and S^T q
 * all reduce over Dk, down a column), so the blocks change no arithmetic, and a narrow last
 * block is zero-padded so that every column runs the same vector code (no scalar tail); the
 * conv's products are explicit fmaf (scalar tails and vector bodies round alike); the only
 * horizontal sums (the l2 norms) use a fixed 16-lane pattern; exp and log1p run as scalar
 * calls, or (SiLU) over a fixed-size aligned local row.
 *
 * Per token (per head, column j of the state; sums over i in two alternating partial sums):
 *   mem_j = exp(g) * sum_i S_ij k_i;  delta_j = (v_j - mem_j) * beta
 *   S_ij  = exp(g) * S_ij + k_i delta_j;  o_j = sum_i S_ij q_i
 * (the reference decays S first and then reduces: the same value up to rounding.)
 *
 * Work items are spread over the OpenMP threads of the process (torch's libgomp pool), one
 * dynamic item at a time: a long prefill's items and a decode row's items mix.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GD_MAX_DK 256
#ifndef GD_BLOCK_V
/* state columns per work item: a [Dk, 64] block (32 KiB at Dk 128) stays in L1 */
#define GD_BLOCK_V 64
#endif
#define CONV_BLOCK 64   /* channels of the conv per inner block */
#define CONV_MAX_K 8    /* conv kernel width */

int pg_gated_delta_limits(int *max_head_dim_k, int *max_conv_kernel) {
    *max_head_dim_k = GD_MAX_DK;
    *max_conv_kernel = CONV_MAX_K;
    return 0;
}

/* sum of x[i]^2 in a fixed 16-lane order (the same bits for the same values, any address) */
static float sum_squares(const float *x, int n) {
    float lanes[16] __attribute__((aligned(64))) = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) lanes[l] = fmaf(x[i + l], x[i + l], lanes[l]);
    for (int l = 0; i + l < n; ++l) lanes[l] = fmaf(x[i + l], x[i + l], lanes[l]);
    for (int width = 8; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    return lanes[0];
}

/* torch's softplus (beta 1, threshold 20) */
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t q_stride, k_stride, v_stride, g_stride, beta_stride;
    const float *a_log, *dt_bias; /* NULL: q, k, g, beta are the rule's inputs as they are */
    int key_group;                /* value heads per q/k head (fused) */
    float eps, scale;             /* fused: l2 norm epsilon, q scale */
    const float *state_in;
    float *state_out, *saved, *out;
    const int64_t *state_slots;
    int write_slots; /* state_out is the pool (at the slots), else [S, ...] */
    const int32_t *save_index;
    int num_heads, dk, dv;
} gd_args;

/* GNU C vector types (no intrinsics): 16 floats, one AVX-512 register or two AVX2 ones; the
 * compiler lowers them to whatever -march=native has. */
typedef float vf16 __attribute__((vector_size(64)));
#define GD_VECS (GD_BLOCK_V / 16)

/* The first nv columns of the local block S [dk, GD_BLOCK_V] into rows of dst at row_stride. */
static inline void store_block(float *dst, int64_t row_stride, const vf16 *S, int dk, int nv) {
    if (nv == GD_BLOCK_V)
        for (int i = 0; i < dk; ++i)
            memcpy(dst + i * row_stride, S + i * GD_VECS, GD_BLOCK_V * sizeof(float));
    else
        for (int i = 0; i < dk; ++i)
            memcpy(dst + i * row_stride, S + i * GD_VECS, nv * sizeof(float));
}

/* One (sequence, head, column block) item: rows first .. last - 1, columns j0 .. j0 + nv - 1.
 * NOTE: a narrower last block is zero-padded to GD_BLOCK_V columns (zero state and v stay
 * zero), so every column runs the very same instructions: no scalar tail whose rounding could
 * differ. The accumulators over Dk alternate between two register sets (even and odd i) to
 * hide the FMA latency; that order is fixed, so it is the same in every call. */
static void gd_item(const gd_args *a, int64_t seq, int h, int j0, int nv, int64_t first,
                    int64_t last) {
    const int dk = a->dk, dv = a->dv;
    vf16 S[GD_MAX_DK * GD_VECS];
    float qn[GD_MAX_DK] __attribute__((aligned(64))), kn[GD_MAX_DK] __attribute__((aligned(64)));
    float vrow[GD_BLOCK_V] __attribute__((aligned(64))) = {0};
    float orow[GD_BLOCK_V] __attribute__((aligned(64)));
    const int64_t slot = a->state_slots != NULL ? a->state_slots[seq] : seq;
    const int64_t head_state = (slot * a->num_heads + h) * dk * dv;
    const int64_t head_out = ((a->write_slots ? slot : seq) * a->num_heads + h) * dk * dv;
    if (nv == GD_BLOCK_V) /* constant sizes: the copies inline into a few vector moves */
        for (int i = 0; i < dk; ++i)
            memcpy(S + i * GD_VECS, a->state_in + head_state + (int64_t)i * dv + j0,
                   GD_BLOCK_V * sizeof(float));
    else {
        memset(S, 0, sizeof(vf16) * GD_VECS * dk);
        for (int i = 0; i < dk; ++i)
            memcpy(S + i * GD_VECS, a->state_in + head_state + (int64_t)i * dv + j0,
                   nv * sizeof(float));
    }
    const int hq = a->a_log != NULL ? h / a->key_group : h;
    const float neg_a = a->a_log != NULL ? -expf(a->a_log[h]) : 0.0f;
    for (int64_t r = first; r < last; ++r) {
        const float *q = a->q + r * a->q_stride + (int64_t)hq * dk;
        const float *k = a->k + r * a->k_stride + (int64_t)hq * dk;
        memcpy(vrow, a->v + r * a->v_stride + (int64_t)h * dv + j0, nv * sizeof(float));
        float g = a->g[r * a->g_stride + h], beta = a->beta[r * a->beta_stride + h];
        if (a->a_log != NULL) {
            const float q_inv = a->scale / sqrtf(sum_squares(q, dk) + a->eps);
            const float k_inv = 1.0f / sqrtf(sum_squares(k, dk) + a->eps);
            for (int i = 0; i < dk; ++i) {
                qn[i] = q[i] * q_inv;
                kn[i] = k[i] * k_inv;
            }
            q = qn;
            k = kn;
            g = neg_a * softplus(g + a->dt_bias[h]);
            beta = 1.0f / (1.0f + expf(-beta));
        }
        const float decay = expf(g);
        /* mem = S^T k (the old S), two partial sums */
        vf16 even[GD_VECS] = {0}, odd[GD_VECS] = {0}, delta[GD_VECS];
        int i = 0;
        for (; i + 1 < dk; i += 2)
#pragma GCC unroll 8
            for (int n = 0; n < GD_VECS; ++n) {
                even[n] += S[i * GD_VECS + n] * k[i];
                odd[n] += S[(i + 1) * GD_VECS + n] * k[i + 1];
            }
        if (i < dk)
#pragma GCC unroll 8
            for (int n = 0; n < GD_VECS; ++n) even[n] += S[i * GD_VECS + n] * k[i];
#pragma GCC unroll 8
        for (int n = 0; n < GD_VECS; ++n) {
            vf16 v;
            memcpy(&v, vrow + 16 * n, sizeof v);
            delta[n] = (v - (even[n] + odd[n]) * decay) * beta;
            even[n] = odd[n] = (vf16){0};
        }
        /* S = decay S + k delta^T; o = S^T q (the new S), two partial sums */
        for (i = 0; i + 1 < dk; i += 2)
#pragma GCC unroll 8
            for (int n = 0; n < GD_VECS; ++n) {
                const vf16 s0 = S[i * GD_VECS + n] * decay + k[i] * delta[n];
                const vf16 s1 = S[(i + 1) * GD_VECS + n] * decay + k[i + 1] * delta[n];
                S[i * GD_VECS + n] = s0;
                S[(i + 1) * GD_VECS + n] = s1;
                even[n] += s0 * q[i];
                odd[n] += s1 * q[i + 1];
            }
        if (i < dk)
#pragma GCC unroll 8
            for (int n = 0; n < GD_VECS; ++n) {
                const vf16 s0 = S[i * GD_VECS + n] * decay + k[i] * delta[n];
                S[i * GD_VECS + n] = s0;
                even[n] += s0 * q[i];
            }
#pragma GCC unroll 8
        for (int n = 0; n < GD_VECS; ++n) {
            const vf16 o = even[n] + odd[n];
            memcpy(orow + 16 * n, &o, sizeof o);
        }
        memcpy(a->out + (r * a->num_heads + h) * dv + j0, orow, nv * sizeof(float));
        const int32_t p = a->save_index != NULL ? a->save_index[r] : -1;
        if (p >= 0) {
            store_block(a->saved + ((int64_t)p * a->num_heads + h) * dk * dv + j0, dv, S, dk, nv);
        }
    }
    store_block(a->state_out + head_out + j0, dv, S, dk, nv);
}

/* The gated delta rule over every sequence (see the top of the file). When a_log is not NULL
 * (the fused entry), q and k have num_heads / key_group heads and are l2-normalised here (eps),
 * q scaled by `scale`, g = -exp(a_log) * softplus(g + dt_bias) and beta = sigmoid(beta).
 * Returns 0, or -1 when Dk is over the limit. */
int pg_gated_delta_f32(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                       const float *v, int64_t v_stride, const float *g, int64_t g_stride,
                       const float *beta, int64_t beta_stride, const float *a_log,
                       const float *dt_bias, int key_group, float eps, float scale,
                       const float *state_in, float *state_out, const int64_t *qsl, int num_seqs,
                       int num_heads, int dk, int dv, const int32_t *save_index, float *out,
                       float *saved, const int64_t *state_slots, int write_slots,
                       int num_threads) {
    if (dk < 1 || dk > GD_MAX_DK || dv < 1 || key_group < 1) return -1;
    if (num_threads < 1) num_threads = 1;
    const gd_args args = {q, k, v, g, beta, q_stride, k_stride, v_stride, g_stride, beta_stride,
                          a_log, dt_bias, key_group, eps, scale, state_in, state_out, saved,
                          out, state_slots, write_slots && state_slots != NULL, save_index,
                          num_heads, dk, dv};
    const int blocks = (dv + GD_BLOCK_V - 1) / GD_BLOCK_V;
    const int64_t per_seq = (int64_t)num_heads * blocks, items = num_seqs * per_seq;
    /* work: tokens x state size; below ~1 MFLOP one thread is cheaper than waking the team */
    const int64_t work = (qsl[num_seqs] - qsl[0] + num_seqs) * (int64_t)num_heads * dk * dv;
#define GD_ITEM(item)                                                                       \
    do {                                                                                    \
        const int64_t seq = (item) / per_seq;                                               \
        const int h = (int)(((item) % per_seq) / blocks), b = (int)((item) % blocks);       \
        const int j0 = b * GD_BLOCK_V;                                                      \
        gd_item(&args, seq, h, j0, dv - j0 < GD_BLOCK_V ? dv - j0 : GD_BLOCK_V, qsl[seq],   \
                qsl[seq + 1]);                                                              \
    } while (0)
    if (num_threads > 1 && items > 1 && work >= (1 << 18)) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
        for (int64_t item = 0; item < items; ++item) GD_ITEM(item);
    } else {
        for (int64_t item = 0; item < items; ++item) GD_ITEM(item);
    }
#undef GD_ITEM
    return 0;
}

/* Input `offset` (relative to the sequence's first row; negative: its conv state) of channel
 * block c0 .. c0 + n - 1. */
static inline const float *conv_input(const float *x, int64_t x_stride, const float *state_seq,
                                      int width, int channels, int64_t start, int64_t offset,
                                      int c0) {
    return offset < 0 ? state_seq + (width + offset) * channels + c0
                      : x + (start + offset) * x_stride + c0;
}

/* One output row of the conv: every channel, in blocks of CONV_BLOCK. weight_t [K, C] (the
 * kernel transposed, so a tap's weights are a contiguous row). NOTE: a channel's block and
 * its place in it depend only on the channel, the products are explicit fmaf, and SiLU's exp
 * runs over a whole aligned local row, so each channel takes the same path in every call. */
static void conv_row(const float *x, int64_t x_stride, const float *weight_t,
                     const float *state_seq, int64_t start, int64_t offset, int channels,
                     int kernel_size, float *out_row) {
    const int width = kernel_size - 1;
    float acc[CONV_BLOCK] __attribute__((aligned(64)));
    float act[CONV_BLOCK] __attribute__((aligned(64)));
    for (int c0 = 0; c0 < channels; c0 += CONV_BLOCK) {
        const int n = channels - c0 < CONV_BLOCK ? channels - c0 : CONV_BLOCK;
        for (int c = 0; c < CONV_BLOCK; ++c) acc[c] = 0.0f;
        for (int j = 0; j < kernel_size; ++j) {
            const float *in = conv_input(x, x_stride, state_seq, width, channels, start,
                                         offset - width + j, c0);
            const float *w = weight_t + (int64_t)j * channels + c0;
            if (n == CONV_BLOCK) /* constant trip count: unrolled, no alias check */
                for (int c = 0; c < CONV_BLOCK; ++c) acc[c] = fmaf(in[c], w[c], acc[c]);
            else
                for (int c = 0; c < n; ++c) acc[c] = fmaf(in[c], w[c], acc[c]);
        }
        /* NOTE: clamped so 1 + e^-x stays finite (see silu_mul_row in cpu_ops.c); over the
         * whole local row (the padding is zeros), so every channel runs the same code */
#pragma omp simd aligned(acc, act : 64)
        for (int c = 0; c < CONV_BLOCK; ++c)
            act[c] = acc[c] / (1.0f + expf(fminf(-acc[c], 88.0f)));
        memcpy(out_row + c0, act, n * sizeof(float));
    }
}

/* The sequence owning `row` (qsl rises; rows of empty sequences belong to the next one). */
static inline int64_t seq_of_row(const int64_t *qsl, int num_seqs, int64_t row) {
    int64_t lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (qsl[mid] <= row) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Depthwise causal conv + SiLU over each sequence from its conv state (the reference's
 * causal_conv1d_varlen). x [T, C] rows at x_stride; weight [C, K] contiguous; conv_state and
 * new_state [S, K - 1, C] contiguous (new_state may be conv_state: it is written after every
 * read); with state_slots (else NULL) conv_state is a pool [N, K - 1, C] whose entry
 * state_slots[s] is sequence s's, and with write_slots new_state is that pool again (in
 * place, distinct slots); out [T, C] contiguous; saved [P, K - 1, C]; save_index as for the
 * rule. Rows are independent given the inputs, so they are spread over the threads in order
 * (each reads its inputs as a stream). Returns 0, -1 when K is over the limit, -2 out of memory. */
int pg_causal_conv1d_f32(const float *x, int64_t x_stride, const float *weight,
                         const float *conv_state, const int64_t *qsl, int num_seqs, int channels,
                         int kernel_size, const int32_t *save_index, float *out,
                         float *new_state, float *saved, const int64_t *state_slots,
                         int write_slots, int num_threads) {
    if (kernel_size < 1 || kernel_size > CONV_MAX_K) return -1;
    if (num_threads < 1) num_threads = 1;
    const int width = kernel_size - 1;
    const int64_t state_size = (int64_t)width * channels;
    float *weight_t = malloc(sizeof(float) * kernel_size * channels);
    if (weight_t == NULL) return -2;
    for (int c = 0; c < channels; ++c)
        for (int j = 0; j < kernel_size; ++j)
            weight_t[(int64_t)j * channels + c] = weight[(int64_t)c * kernel_size + j];
    const int64_t first = qsl[0], rows = qsl[num_seqs] - qsl[0];
#define SLOT(seq) (state_slots != NULL ? state_slots[seq] : (seq))
#define CONV_ROW(r)                                                                         \
    do {                                                                                    \
        const int64_t seq = seq_of_row(qsl, num_seqs, (r));                                 \
        const float *state_seq = conv_state + SLOT(seq) * state_size;                       \
        const int64_t offset = (r) - qsl[seq];                                              \
        conv_row(x, x_stride, weight_t, state_seq, qsl[seq], offset, channels, kernel_size, \
                 out + (r) * channels);                                                     \
        const int32_t p = save_index != NULL ? save_index[r] : -1;                          \
        for (int i = 0; p >= 0 && i < width; ++i)                                           \
            memcpy(saved + p * state_size + (int64_t)i * channels,                          \
                   conv_input(x, x_stride, state_seq, width, channels, qsl[seq],            \
                              offset - width + 1 + i, 0),                                   \
                   channels * sizeof(float));                                               \
    } while (0)
    if (num_threads > 1 && rows > 1 && rows * channels * kernel_size >= (1 << 16)) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int64_t r = first; r < first + rows; ++r) CONV_ROW(r);
    } else {
        for (int64_t r = first; r < first + rows; ++r) CONV_ROW(r);
    }
#undef CONV_ROW
    free(weight_t);
    /* the last K - 1 inputs of each sequence; in increasing order, so new_state may alias the
     * old state (a short sequence's rows come from later rows of its own old state) */
    for (int64_t seq = 0; seq < num_seqs; ++seq)
        for (int i = 0; i < width; ++i)
            memmove(new_state + (write_slots ? SLOT(seq) : seq) * state_size
                        + (int64_t)i * channels,
                    conv_input(x, x_stride, conv_state + SLOT(seq) * state_size, width, channels,
                               qsl[seq], qsl[seq + 1] - qsl[seq] - width + i, 0),
                    channels * sizeof(float));
#undef SLOT
    return 0;
}
