/*
 * What the paged attention kernels (paged_decode.c, paged_prefill.c, paged_cascade.c) read K/V
 * rows with: an element of an fp32 or bf16 row as fp32, and a vector of 16 scores. Included,
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

#endif
