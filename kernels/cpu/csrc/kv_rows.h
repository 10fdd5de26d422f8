/*
 * What the paged attention kernels (paged_decode.c, paged_prefill.c, paged_cascade.c) read K/V
 * rows with: an element of an fp32 or bf16 row as fp32, a vector of 16 scores, and the row of
 * a token in a sequence's pages. Included,
 * never compiled on its own; library.py hashes it into the build key with the sources.
 */
#ifndef PG_KV_ROWS_H
#define PG_KV_ROWS_H

#include <stdint.h>
#include <string.h>

/* Element i of a K/V row, as fp32: a bf16 is widened exactly (its bits are the fp32's top
 * half). Inlined with a constant `bf16`, the loops over it vectorise either way. */
static inline float kv_elem(const void *row, int64_t i, const int bf16) {
    if (bf16) {
        const union { uint32_t u; float f; } w = {.u = (uint32_t)((const uint16_t *)row)[i] << 16};
        return w.f;
    }
    return ((const float *)row)[i];
}

/* 16 keys' scores: one AVX-512 register. */
typedef float vkeys __attribute__((vector_size(16 * sizeof(float))));

static inline vkeys load_keys(const float *p) {
    vkeys v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline void store_keys(float *p, vkeys v) { memcpy(p, &v, sizeof(v)); }

/* A sequence's K/V pages: the caches, its page ids in order, the byte strides. */
typedef struct {
    const char *k_cache, *v_cache;
    const int64_t *pages;
    int64_t page_stride, token_stride; /* bytes */
    int page_size, elem_bytes;
} paged_kv;

/* Row of token t of KV head h (K or V cache). */
static inline const void *kv_row(const paged_kv *kv, const char *cache, int t, int h,
                                 int head_dim) {
    return cache + kv->pages[t / kv->page_size] * kv->page_stride +
           (int64_t)(t % kv->page_size) * kv->token_stride +
           (int64_t)h * head_dim * kv->elem_bytes;
}

#endif
