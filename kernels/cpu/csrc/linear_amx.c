/* AMX twin of linear_quant.c: y = x . W^T (+ bias) (+ residual), W in the same packed Q4_0 /
 * Q4_1 / Q8_0 groups (16 columns x 32 k), on Intel AMX-BF16 tiles, as accurate as fp32.
 *
 * How: every 32-weight group is d * (q - 8) (Q4_0), d * q + m (Q4_1) or d * q (Q8_0), and the
 * integers q - 8 in [-8, 7], q in [0, 15] and q in [-128, 127] are exact in bf16. Each fp32
 * activation is split into three bf16 parts with x = hi + mid + lo exactly (hi = x truncated to
 * bf16, mid = (x - hi) truncated, lo = the rest: at most 8 significant bits are left, so every
 * subtraction is exact). Per group, three TDPBF16PS (hi, mid, lo against the same integer B
 * tile) give S[r][c] = sum_k q[k][c] x[r][k], the 3 x 32 products exact in fp32 and summed in
 * fp32; then acc[r][c] += d[c] * S[r][c] (+ m[c] * sum_k x[r][k] for Q4_1) in fp32 FMAs (the
 * fold). The B tile (16 k-pairs x 16 columns in AMX's pair layout, which is the packed layout's
 * own order for 4 bits) is built from the quants with a 32-entry vpermw table lookup into a
 * small ring in L1, once per group, column block and row tile: no second copy of the weights.
 *
 * Fidelity: Q4_0 and Q8_0 weights are the dequantized values exactly (d * (q - 8) and d * q are
 * exact in fp32). A Q4_1 weight enters as d * q + m unrounded, where the dequantized value is
 * fl(d * q + m): they differ by at most half an ulp of the weight, an error of the size of the
 * fp32 path's own rounding of each product. So results are not bit-identical to linear_quant.c
 * (the sum is grouped per 32 k, and the Q4_1 weight is not rounded), but as close to the exact
 * (fp64) product: max error / sum |x| |w| 7.4e-8 vs 3.4e-7 for linear_quant.c and linear.c on
 * the default model's matrices (benchmarks/linear.py); tests/kernels/cpu/test_linear_amx.py
 * bounds it against fp64 at 2x the register kernel's error, and checks that the three parts
 * give back every bit of x. A row's result does not depend on the other rows of the call.
 * TDPBF16PS flushes denormals: a part below 2^-126 (x below ~2^-110) is lost, an absolute error
 * under 1e-33 per product; an inf activation gives NaN (inf - inf in the split).
 *
 * Structure: the tile work (zero, B load, 3 products, store) and the vector work (B build,
 * fold) overlap little, so the kernel loads the A tiles (three parts) once for CHUNK column
 * blocks and builds the B tiles AHEAD groups ahead in a ring that stays in L1 (the
 * accumulators of CHUNK x 16 rows spill, and still win over reloading A); the nibble index is
 * one vpmaddwd (byte * 0x1001) instead of a shift and an or. Each alternative tried, and the
 * kernel's speed against linear.c and linear_quant.c per row count, is in docs/benchmarks.md
 * (benchmarks/linear.py, benchmarks/model.py --fp32-baseline).
 * Few rows cost this kernel about what 12 cost it (the tiles' work hardly depends on the rows;
 * the weights' stream from DRAM bounds the register kernel there), so kernels/cpu/ops.py takes
 * it from QUANT_AMX_MIN_ROWS (12) rows, where it starts to beat the register kernel. Prefill
 * is faster too; decode at 16 rows is then bound by the rest of the step (attention over the
 * K/V), so the linear layers alone cannot double it. No weight is copied: RSS is unchanged,
 * plus a transient 6 bytes per activation during a call.
 *
 * Linux hands out the 8 KB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once per
 * process); pg_amx_available() asks once and returns 0 when the CPU, the build or the kernel
 * says no, and callers then use linear_quant.c. Built without AMX (another CPU: the library is
 * compiled with -march=native) the file has only that answer and a stub that returns -1.
 *
 * Built with the other sources into one library by kernels/cpu/library.py.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define PG_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define COLS 16
#define GROUP 32
#define TILE_ROWS 16
#define TILE_STEP 4 /* row tiles are a multiple of this (compiled variants) */

enum { PG_Q4_0 = 2, PG_Q4_1 = 3, PG_Q8_0 = 8 };

int pg_quant_group_bytes(int qtype); /* linear_quant.c */

#if defined(PG_AMX)

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

int pg_amx_available(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) {
        unsigned long bits = 0;
        /* the grant is per process, for every thread; asking twice is harmless */
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 &&
                        syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 &&
                        (bits & (1ul << XFEATURE_XTILEDATA))
                    ? 1
                    : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state == 1;
}

/* LDTILECFG's 64-byte operand, palette 1 */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* Column blocks per chunk: the A tiles of a group are loaded once for this many blocks. */
#define CHUNK 3
/* B tiles are built this many steps ahead, into a ring of AHEAD + 1 slots. */
#define AHEAD 4
#define RING (AHEAD + 1)
/* Activations of up to this many values (64 rows of 1,536) are split before the threads start. */
#define SPLIT_SERIAL_MAX (64 * 1536)
/* Groups between a tile store and the fold that reads it back (LAG + 1 buffers). */
#define LAG 2
#define LAGS (LAG + 1)

/* The eight tiles (macros: the intrinsics paste the number into the instruction): one
 * accumulator per block of a chunk, the A tiles of the three parts, two B tiles (alternating
 * blocks, so a B load does not wait for the products still reading the other). */
#define T_C0 0
#define T_C1 1
#define T_C2 2
#define T_HI 3
#define T_MID 4
#define T_LO 5
#define T_B0 6
#define T_B1 7

static void configure_tiles(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t == T_B0 || t == T_B1 ? GROUP / 2 : rows;
    }
    /* NOTE: GCC (12) declares the operand of ldtilecfg as 8 bytes: without the barrier the
     * stores of the other 56 may be dropped as dead */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* bf16 bits of (i & 15) - offset in word i: the vpermw table of a 4-bit quant */
static inline __m512i nibble_table(int offset) {
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = _mm512_cvtepi32_ps(_mm512_sub_epi32(iota, _mm512_set1_epi32(offset)));
    /* small integers are exact in bf16: their fp32 bits' low half is zero */
    const __m256i words = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(values), 16));
    return _mm512_broadcast_i64x4(words);
}

/* One group's B tile: row j = 16 columns x (k = 2j, 2j + 1) as bf16 pairs. */
static inline void build_b_q4(const uint8_t *qs, __m512i table, uint16_t *b) {
#pragma GCC unroll 16
    for (int j = 0; j < GROUP / 2; ++j) {
        /* byte j * 16 + c: k = 2j low nibble, 2j + 1 high; dword c -> (low word: low nibble in
         * bits 0-3, high word: high nibble in bits 0-3) as byte * 0x1001 (one vpmaddwd for a
         * shift and an or); vpermw reads 5 index bits, and the table repeats after 16, so the
         * bits above the nibble do not matter */
        const __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + j * COLS)));
        const __m512i index = _mm512_madd_epi16(t, _mm512_set1_epi32(0x1001));
        _mm512_store_si512((__m512i *)(b + j * 2 * COLS), _mm512_permutexvar_epi16(index, table));
    }
}

static inline void build_b_q8(const uint8_t *qs, uint16_t *b) {
#pragma GCC unroll 16
    for (int j = 0; j < GROUP / 2; ++j) {
        const __m512i even = _mm512_castps_si512(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 2 * j * COLS)))));
        const __m512i odd = _mm512_castps_si512(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + (2 * j + 1) * COLS)))));
        /* bf16 of k = 2j in the low word, of 2j + 1 in the high word (exact: |q| <= 128) */
        const __m512i pair = _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(even, 16), odd);
        _mm512_store_si512((__m512i *)(b + j * 2 * COLS), pair);
    }
}

static inline void build_b(int qtype, const uint8_t *gp, __m512i table, uint16_t *b) {
    if (qtype == PG_Q8_0)
        build_b_q8(gp + 2 * COLS, b);
    else
        build_b_q4(gp + (qtype == PG_Q4_1 ? 4 : 2) * COLS, table, b);
}

/* Where row r's three parts of group g start: tile after tile of tile_rows rows; in a tile,
 * group after group, part after part, row after row of 32 bf16 (one A tile: 64-byte rows,
 * contiguous). */
static inline int64_t part_offset(int r, int g, int groups, int tile_rows) {
    return ((int64_t)(r / tile_rows * groups + g) * 3 * tile_rows + r % tile_rows) * GROUP;
}

/* bf16 bits of the three parts of 16 floats, exact: hi = x truncated, mid = (x - hi)
 * truncated, lo = x - hi - mid (at most 8 significant bits are left for it) */
static inline void split16(__m512 v, __m256i *hi, __m256i *mid, __m256i *lo) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    const __m512i h = _mm512_and_si512(_mm512_castps_si512(v), high);
    const __m512 rest = _mm512_sub_ps(v, _mm512_castsi512_ps(h));
    const __m512i m = _mm512_and_si512(_mm512_castps_si512(rest), high);
    const __m512i l = _mm512_castps_si512(_mm512_sub_ps(rest, _mm512_castsi512_ps(m)));
    *hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16));
    *mid = _mm512_cvtepi32_epi16(_mm512_srli_epi32(m, 16));
    *lo = _mm512_cvtepi32_epi16(_mm512_srli_epi32(l, 16));
}

/* Rows [r0, r1) of x (zero rows from M on: the padding of the last tile) -> their three bf16
 * parts, laid out by part_offset, and for Q4_1 (sums != NULL) each group's sum of x. */
static void split_rows(const float *x, int64_t ldx, int r0, int r1, int M, int K, int tile_rows,
                       uint16_t *parts, float *sums) {
    const int groups = K / GROUP;
    for (int r = r0; r < r1; ++r) {
        for (int g = 0; g < groups; ++g) {
            uint16_t *dst = parts + part_offset(r, g, groups, tile_rows);
            const int64_t part = (int64_t)tile_rows * GROUP;
            if (r >= M) {
                for (int p = 0; p < 3; ++p) memset(dst + p * part, 0, GROUP * sizeof(uint16_t));
                if (sums != NULL) sums[(int64_t)r * groups + g] = 0.0f;
                continue;
            }
            const float *xg = x + r * ldx + g * GROUP;
            for (int half = 0; half < 2; ++half) {
                __m256i hi, mid, lo;
                split16(_mm512_loadu_ps(xg + 16 * half), &hi, &mid, &lo);
                _mm256_storeu_si256((__m256i *)(dst + 16 * half), hi);
                _mm256_storeu_si256((__m256i *)(dst + part + 16 * half), mid);
                _mm256_storeu_si256((__m256i *)(dst + 2 * part + 16 * half), lo);
            }
            if (sums != NULL) {
                __m512d s = _mm512_add_pd(_mm512_cvtps_pd(_mm256_loadu_ps(xg)),
                                          _mm512_cvtps_pd(_mm256_loadu_ps(xg + 8)));
                s = _mm512_add_pd(s, _mm512_cvtps_pd(_mm256_loadu_ps(xg + 16)));
                s = _mm512_add_pd(s, _mm512_cvtps_pd(_mm256_loadu_ps(xg + 24)));
                sums[(int64_t)r * groups + g] = (float)_mm512_reduce_add_pd(s);
            }
        }
    }
}

/* y tile: rows [0, R) x columns [0, ncols) = acc (+ bias) (+ residual). */
static inline void store_rows(const __m512 *acc, int R, int ncols, const float *bias,
                              const float *residual, int64_t ld_res, float *y, int64_t ldy) {
    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
    const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        __m512 v = acc[r];
        if (bias != NULL) v = _mm512_add_ps(v, b);
        if (residual != NULL)
            v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, residual + r * ld_res), v);
        _mm512_mask_storeu_ps(y + r * ldy, mask, v);
    }
}

/* acc[r] += d * S[r] (+ m * the row's group sum) for the R rows of one stored accumulator tile:
 * the fold of one group into fp32 accumulators. */
static inline __attribute__((always_inline)) void scale_add(const int R, const int has_min,
                                                            const float *s, const uint8_t *gp,
                                                            const float *sums, int groups,
                                                            __m512 *acc) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gp));
    if (has_min) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gp + 2 * COLS)));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[r * groups]),
                                     _mm512_fmadd_ps(d, _mm512_load_ps(s + r * COLS), acc[r]));
    } else {
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_fmadd_ps(d, _mm512_load_ps(s + r * COLS), acc[r]);
    }
}

/* Group g's products for block n of the chunk (B from the ring slot of this step) into C,
 * stored for the fold LAG groups later; the A tiles are loaded already. */
#define PG_BLOCK_TILES(C, BT, n)                                                         \
    do {                                                                                 \
        _tile_zero(C);                                                                   \
        _tile_loadd(BT, ring + ((int64_t)(step % RING) * CHUNK + (n)) * GROUP * COLS, 64); \
        _tile_dpbf16ps(C, T_HI, BT);                                                     \
        _tile_dpbf16ps(C, T_MID, BT);                                                    \
        _tile_dpbf16ps(C, T_LO, BT);                                                     \
        _tile_stored(C, s[g % LAGS] + (n) * TILE_ROWS * COLS, COLS * sizeof(float));     \
    } while (0)

/* blocks in chunk c of a thread's range [first, last) */
static inline int chunk_blocks(int c, int first, int last) {
    const int left = last - first - c * CHUNK;
    return left < CHUNK ? left : CHUNK;
}

/* The B tiles of step (chunk c, group g) into their ring slot. */
static inline void build_step(int qtype, const uint8_t *packed, int64_t block_bytes, int groups,
                              int first, int last, int64_t step, __m512i table, uint16_t *ring) {
    const int c = (int)(step / groups), g = (int)(step % groups);
    const int gb = pg_quant_group_bytes(qtype);
    const int nb = chunk_blocks(c, first, last);
    for (int n = 0; n < nb; ++n) {
        const uint8_t *gp = packed + (first + c * CHUNK + n) * block_bytes + (int64_t)g * gb;
        build_b(qtype, gp, table, ring + ((int64_t)(step % RING) * CHUNK + n) * GROUP * COLS);
        /* a few chunks ahead, into L2: the weights stream from DRAM */
        for (int line = 0; line < gb; line += 64)
            __builtin_prefetch(
                (const void *)((uintptr_t)gp + (uintptr_t)2 * CHUNK * block_bytes + line), 0, 2);
    }
}

/*
 * One row tile of R rows (a compile-time constant where inlined) x column blocks [first, last),
 * in chunks of CHUNK blocks: per group, the A tiles (the three parts of the activations) are
 * loaded once for the chunk. A step is (chunk, group); three stages overlap in it: the tile
 * products of step s, the B tiles of step s + AHEAD (built into a small ring that stays in L1),
 * and the fold of step s - LAG from its stored accumulator tiles. NOTE: no stage reads what
 * another has just written: a tile load right behind the vector stores it reads (or a vector
 * load right behind the tile store) waits for them to leave the core, and the tile and the
 * vector units then take turns instead of overlapping.
 */
static inline __attribute__((always_inline)) void row_tile(
    const int R, int qtype, const uint8_t *packed, int64_t block_bytes, int first, int last,
    int K, int N, const uint16_t *parts, const float *sums, const float *bias,
    const float *residual, int64_t ld_res, float *y, int64_t ldy, int rows, __m512i table,
    uint16_t *ring) {
    const int gb = pg_quant_group_bytes(qtype), groups = K / GROUP;
    const int has_min = qtype == PG_Q4_1;
    const int64_t part = (int64_t)R * GROUP;
    const int chunks = (last - first + CHUNK - 1) / CHUNK;
    const int64_t steps = (int64_t)chunks * groups;
    float s[LAGS][CHUNK * TILE_ROWS * COLS] __attribute__((aligned(64)));
    __m512 acc[CHUNK * TILE_ROWS];
    for (int64_t step = 0; step < AHEAD && step < steps; ++step)
        build_step(qtype, packed, block_bytes, groups, first, last, step, table, ring);
    int64_t step = 0;
    for (int c = 0; c < chunks; ++c) {
        const int nb = chunk_blocks(c, first, last);
        const uint8_t *wp = packed + (first + c * CHUNK) * block_bytes;
#pragma GCC unroll 64
        for (int i = 0; i < CHUNK * R; ++i) acc[i] = _mm512_setzero_ps();
        for (int g = 0; g < groups; ++g, ++step) {
            const uint16_t *a = parts + g * 3 * part;
            _tile_loadd(T_HI, a, 64);
            _tile_loadd(T_MID, a + part, 64);
            _tile_loadd(T_LO, a + 2 * part, 64);
            PG_BLOCK_TILES(T_C0, T_B0, 0);
            if (nb > 1) PG_BLOCK_TILES(T_C1, T_B1, 1);
            if (nb > 2) PG_BLOCK_TILES(T_C2, T_B0, 2);
            if (step + AHEAD < steps)
                build_step(qtype, packed, block_bytes, groups, first, last, step + AHEAD, table,
                           ring);
            if (g >= LAG)
#pragma GCC unroll 4
                for (int n = 0; n < CHUNK; ++n)
                    if (n < nb)
                        scale_add(R, has_min, s[(g - LAG) % LAGS] + n * TILE_ROWS * COLS,
                                  wp + n * block_bytes + (int64_t)(g - LAG) * gb,
                                  has_min ? sums + g - LAG : NULL, groups, acc + n * R);
        }
        for (int g = groups > LAG ? groups - LAG : 0; g < groups; ++g)
#pragma GCC unroll 4
            for (int n = 0; n < CHUNK; ++n)
                if (n < nb)
                    scale_add(R, has_min, s[g % LAGS] + n * TILE_ROWS * COLS,
                              wp + n * block_bytes + (int64_t)g * gb, has_min ? sums + g : NULL,
                              groups, acc + n * R);
#pragma GCC unroll 4
        for (int n = 0; n < CHUNK; ++n)
            if (n < nb) {
                const int col = (first + c * CHUNK + n) * COLS;
                const int ncols = N - col < COLS ? N - col : COLS;
                store_rows(acc + n * R, rows, ncols, bias != NULL ? bias + col : NULL,
                           residual != NULL ? residual + col : NULL, ld_res, y + col, ldy);
            }
    }
}

#undef PG_BLOCK_TILES

static void row_tile_dispatch(int R, int qtype, const uint8_t *packed, int64_t block_bytes,
                              int first, int last, int K, int N, const uint16_t *parts,
                              const float *sums, const float *bias, const float *residual,
                              int64_t ld_res, float *y, int64_t ldy, int rows, __m512i table,
                              uint16_t *ring) {
    switch (R) {
#define PG_ROWS(r)                                                                        \
    case r:                                                                               \
        row_tile(r, qtype, packed, block_bytes, first, last, K, N, parts, sums, bias,     \
                 residual, ld_res, y, ldy, rows, table, ring);                            \
        break;
        PG_ROWS(4) PG_ROWS(8) PG_ROWS(12) PG_ROWS(16)
#undef PG_ROWS
        default: break;
    }
}

#else

int pg_amx_available(void) { return 0; }

#endif /* PG_AMX */

/*
 * Same arguments and layouts as pg_linear_quant_f32 (linear_quant.c), without its path choice.
 * Work is split over column blocks, one contiguous range per thread, each row tile after the
 * other; the activations are split into bf16 parts once per call. Returns 0, or -1 (nothing
 * written) when AMX is not usable here, the type or K is not handled, or no workspace.
 */
int pg_linear_quant_amx_f32(int qtype, const float *x, int64_t ldx, const uint8_t *packed,
                            const float *bias, const float *residual, int64_t ld_res, float *y,
                            int64_t ldy, int M, int N, int K, int num_threads) {
#if defined(PG_AMX)
    if (!pg_amx_available() || pg_quant_group_bytes(qtype) == 0 || K % GROUP || M < 0) return -1;
    const int blocks = (N + COLS - 1) / COLS, groups = K / GROUP;
    if (blocks == 0 || M == 0) return 0;
    const int gb = pg_quant_group_bytes(qtype);
    const int64_t block_bytes = (int64_t)groups * gb;
    /* tiles of 4, 8, 12 or 16 rows, the last padded with zero rows: four compiled variants
     * (sixteen cost several times the compile time, for little at odd row counts) */
    const int tile_rows = M <= TILE_ROWS ? (M + TILE_STEP - 1) / TILE_STEP * TILE_STEP : TILE_ROWS;
    const int padded = (M + tile_rows - 1) / tile_rows * tile_rows;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > blocks) num_threads = blocks;
    /* one workspace, allocated before anything is written (y may be the residual itself):
     * the three parts, the Q4_1 group sums, a ring of B tiles per thread */
    const size_t parts_bytes = (size_t)padded * K * 3 * sizeof(uint16_t);
    const size_t sums_bytes = qtype == PG_Q4_1 ? (size_t)padded * groups * sizeof(float) : 0;
    const size_t b_bytes = (size_t)RING * CHUNK * GROUP * COLS * sizeof(uint16_t);
    const size_t sums_at = (parts_bytes + 63) / 64 * 64;
    const size_t b_at = sums_at + (sums_bytes + 63) / 64 * 64;
    uint8_t *work = aligned_alloc(64, b_at + b_bytes * num_threads);
    if (work == NULL) return -1;
    uint16_t *parts = (uint16_t *)work;
    float *sums = sums_bytes ? (float *)(work + sums_at) : NULL;
    /* NOTE: a decode step's activations are split by the caller, before the parallel region:
     * a barrier between the split and the tiles cost more than the split itself whenever the
     * machine was busy (a waiting thread loses its time slice) */
    const int split_first = (int64_t)padded * K <= SPLIT_SERIAL_MAX;
    if (split_first) split_rows(x, ldx, 0, padded, M, K, tile_rows, parts, sums);
#pragma omp parallel num_threads(num_threads)
    {
        const int threads = omp_get_num_threads(), t = omp_get_thread_num();
        if (!split_first) {
            split_rows(x, ldx, (int)((int64_t)padded * t / threads),
                       (int)((int64_t)padded * (t + 1) / threads), M, K, tile_rows, parts, sums);
#pragma omp barrier
        }
        const int first = (int)((int64_t)blocks * t / threads);
        const int last = (int)((int64_t)blocks * (t + 1) / threads);
        uint16_t *ring = (uint16_t *)(work + b_at + b_bytes * t);
        const __m512i table = nibble_table(qtype == PG_Q4_0 ? 8 : 0);
        configure_tiles(tile_rows);
        for (int m0 = 0; m0 < M; m0 += tile_rows) {
            const int rows = M - m0 < tile_rows ? M - m0 : tile_rows;
            if (first < last)
                row_tile_dispatch(tile_rows, qtype, packed, block_bytes, first, last, K, N,
                                  parts + part_offset(m0, 0, groups, tile_rows),
                                  sums != NULL ? sums + (int64_t)m0 * groups : NULL, bias,
                                  residual != NULL ? residual + m0 * ld_res : NULL, ld_res,
                                  y + m0 * ldy, ldy, rows, table, ring);
        }
        _tile_release();
    }
    free(work);
    return 0;
#else
    (void)qtype, (void)x, (void)ldx, (void)packed, (void)bias, (void)residual, (void)ld_res;
    (void)y, (void)ldy, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
#endif
}
