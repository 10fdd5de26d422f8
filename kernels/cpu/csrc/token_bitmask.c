// Grammar-constrained sampling: mask the logits of tokens a grammar forbids (fp32, CPU).
//
// bitmask [rows, words] int32, bit j of word w = token 32*w + j is allowed (xgrammar's layout);
// logits [rows, vocab] fp32 at row stride logits_stride. A forbidden token gets -inf. A word of
// all ones (every token allowed, the common case inside free text) costs one compare.
#include <stdint.h>
#include <string.h>

// -inf by its bit pattern: the library is built with -ffast-math, which assumes no infinities
// in arithmetic (a stored constant is not arithmetic, but the bit pattern leaves no doubt)
static inline void store_neg_inf(float *dst) {
    const uint32_t bits = 0xff800000u;
    memcpy(dst, &bits, sizeof bits);
}

void pg_apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *bitmask,
                                int64_t bitmask_stride, int64_t rows, int64_t vocab) {
    const int64_t words = (vocab + 31) / 32;
    for (int64_t r = 0; r < rows; r++) {
        float *row = logits + r * logits_stride;
        const uint32_t *bits = (const uint32_t *)(bitmask + r * bitmask_stride);
        for (int64_t w = 0; w < words; w++) {
            uint32_t word = bits[w];
            if (word == 0xffffffffu) continue;
            const int64_t base = w * 32;
            const int n = vocab - base < 32 ? (int)(vocab - base) : 32;
            for (int j = 0; j < n; j++)
                if (!((word >> j) & 1u)) store_neg_inf(row + base + j);
        }
    }
}
