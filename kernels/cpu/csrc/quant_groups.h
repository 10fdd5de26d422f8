/*
 * What the GGUF-block linear kernels (linear_quant.c, linear_q8.c) share: ggml's type ids, the
 * packed group of 16 output columns x 32 k, and the store of one accumulator row tile with its
 * bias and residual. Included, never compiled on its own; library.py hashes it into the build
 * key with the sources.
 */
#ifndef PG_QUANT_GROUPS_H
#define PG_QUANT_GROUPS_H

#include <stddef.h>
#include <stdint.h>

#define COLS 16
#define GROUP 32

/* ggml's type ids */
enum { PG_Q4_0 = 2, PG_Q4_1 = 3, PG_Q8_0 = 8 };

/* bytes of one packed group (16 columns x 32 k) of `qtype`, 0 when not handled */
static inline int quant_group_bytes(int qtype) {
    switch (qtype) {
        case PG_Q4_0: return 2 * COLS + COLS * GROUP / 2;
        case PG_Q4_1: return 4 * COLS + COLS * GROUP / 2;
        case PG_Q8_0: return 2 * COLS + COLS * GROUP;
        default: return 0;
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* One 16-column accumulator row tile -> y (columns [0, ncols)), + bias, + residual. */
static inline void store_tile(const __m512 *acc, int nrows, int ncols, const float *bias,
                              const float *residual, int64_t ld_res, float *y, int64_t ldy) {
    for (int r = 0; r < nrows; ++r) {
        float row[COLS];
        _mm512_storeu_ps(row, acc[r]);
        float *dst = y + r * ldy;
        const float *res = residual != NULL ? residual + r * ld_res : NULL;
        for (int c = 0; c < ncols; ++c) {
            float v = row[c];
            if (bias != NULL) v += bias[c];
            if (res != NULL) v = res[c] + v;
            dst[c] = v;
        }
    }
}
#endif

#endif
