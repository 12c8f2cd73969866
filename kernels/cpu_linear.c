/* Linear layers for a few rows (decode and verification passes): bf16 on CPUs with AVX512-BF16
 * (on the AMX tiles where the CPU has them: LINEAR_AMX below, which serves prefill's many rows
 * too), fp32 on CPUs with AVX-512F or with AVX2 and FMA.
 *
 * A pass over a few rows reads every weight once and does little arithmetic with each, so its
 * time is the weight read plus whatever part of the arithmetic does not overlap it. Here the
 * weight is packed once into the order this loop reads it, groups of GROUP output columns, each
 * group a run of (k step, GROUP columns), so a group is one contiguous stream that the loop
 * prefetches ahead of itself, and each loaded step meets up to ROWS rows held in registers. A
 * bf16 step is a pair of inputs (vdpbf16ps: two products added into fp32 in one instruction), an
 * fp32 step one input (a fused multiply-add). Groups are split over OpenMP threads; a group's
 * rows go in tiles of up to ROWS, the later tiles reading the group's weights again from the
 * core's cache.
 *
 *   bf16: y[r, n] = round_bf16(bias[n] + sum over k pairs j, in order, of (x[r,2j] w[n,2j] + x[r,2j+1] w[n,2j+1]))
 *   fp32: y[r, n] = bias[n] + sum over k, in order, of x[r,k] w[n,k]
 *
 * Each output is one chain over the steps in order, whatever the row count and the rows beside
 * it, so a row's result does not depend on the batch it runs in. The sum order is not oneDNN's:
 * results differ from F.linear's in the last bits of the fp32 sum (in bf16, one unit of bf16
 * where the sum lies at a rounding boundary).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
#error "cpu_linear.c needs AVX-512F, or AVX2 with FMA; this CPU or compiler lacks both"
#endif

#ifndef BLOCKS
#define BLOCKS 3   /* 16-lane registers of output columns a group */
#endif
#ifndef ROWS
#define ROWS 8     /* rows a tile: ROWS x BLOCKS accumulators, BLOCKS weight registers, a broadcast */
#endif
#if ROWS > 8
#error "ROWS is at most 8 (the bf16 driver's tile cases)"
#endif
#define GROUP (16 * BLOCKS)
#ifndef AHEAD
#define AHEAD 4096 /* bytes the loop prefetches ahead of itself in the packed weight */
#endif
#define PARALLEL_MIN_BYTES 131072 /* below this much packed weight, one thread */

int structspec_linear_version(void) { return 6; } /* 6: bf16 on the AMX tiles where the CPU has them */

/* which element types this build serves: 1 fp32, 2 bf16 (AVX512-BF16), or'ed */
int structspec_linear_types(void) {
#ifdef __AVX512BF16__
    return 3;
#else
    return 1;
#endif
}

/* Tiles of near-equal size, the larger first, each row count its own unrolled loop: CALL(rows)
 * with rows a constant, at most R (CASES lists the counts below R; the cases above R are never
 * taken). Used by both drivers. */
#define CAP(r, R) ((r) < (R) ? (r) : (R))
#define CASES7(CALL, R)                                                                              \
    case 1: CALL(CAP(1, R)); break; case 2: CALL(CAP(2, R)); break; case 3: CALL(CAP(3, R)); break;  \
    case 4: CALL(CAP(4, R)); break; case 5: CALL(CAP(5, R)); break; case 6: CALL(CAP(6, R)); break;  \
    case 7: CALL(CAP(7, R)); break;
#define CASES15(CALL, R)                                                                             \
    CASES7(CALL, R)                                                                                  \
    case 8: CALL(CAP(8, R)); break; case 9: CALL(CAP(9, R)); break; case 10: CALL(CAP(10, R)); break; \
    case 11: CALL(CAP(11, R)); break; case 12: CALL(CAP(12, R)); break;                              \
    case 13: CALL(CAP(13, R)); break; case 14: CALL(CAP(14, R)); break;                              \
    case 15: CALL(CAP(15, R)); break;
#define TILE_TAKE(m, r0, tiles, t) (((m) - (r0)) / ((tiles) - (t)) + (((m) - (r0)) % ((tiles) - (t)) != 0))
#define TILES(m, R, CASES, CALL)                                                                     \
    for (int64_t t = 0, r0 = 0, tiles = ((m) + (R) - 1) / (R); t < tiles; t++) {                      \
        const int64_t take = TILE_TAKE(m, r0, tiles, t);                                             \
        switch (take) {                                                                              \
            CASES(CALL, R)                                                                           \
            default: CALL(R); break;                                                                 \
        }                                                                                            \
        r0 += take;                                                                                  \
    }

/* Pruned logits (structspec_linear_pruned, structspec_linear_f32_pruned): the rows marked dense
 * first, then the others, in *rows_of (m of them; *dense_rows: how many are dense), and the dense
 * rows of x (row stride ldx elements of `size` bytes) copied one after another (k each), which
 * the caller frees with the order. */
static void *dense_rows_first(const void *x, int64_t ldx, int64_t m, int64_t k, size_t size, const uint8_t *dense,
                              int64_t **rows_of, int64_t *dense_rows) {
    int64_t *order = malloc(sizeof(int64_t) * (m > 0 ? m : 1));
    int64_t nd = 0, ns = m - 1;
    for (int64_t r = 0; r < m; r++) order[dense[r] ? nd++ : ns--] = r;
    char *xd = malloc(size * (nd > 0 ? nd : 1) * k);
    for (int64_t i = 0; i < nd; i++) memcpy(xd + i * k * size, (const char *)x + order[i] * ldx * size, size * k);
    *rows_of = order;
    *dense_rows = nd;
    return xd;
}

#ifdef __AVX512BF16__ /* bf16: pairs of inputs */

int64_t structspec_linear_packed_words(int64_t n, int64_t k) { return (n + GROUP - 1) / GROUP * (k / 2) * GROUP; }

/* w [n, k] bf16 (row stride ldw; k even) -> p [groups][k / 2][GROUP] 32-bit pairs, zero past n */
void structspec_linear_pack(const uint16_t *w, int64_t ldw, int64_t n, int64_t k, uint32_t *p) {
    const int64_t pairs = k / 2, groups = (n + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t j = 0; j < pairs; j++)
            for (int64_t l = 0; l < GROUP; l++) {
                const int64_t o = g * GROUP + l;
                p[(g * pairs + j) * GROUP + l] =
                    o < n ? (uint32_t)w[o * ldw + 2 * j] | (uint32_t)w[o * ldw + 2 * j + 1] << 16 : 0u;
            }
}

/* the fp32 sums of 16 columns (+ bias, or NULL), rounded once to bf16, into the first `left` of them at y */
static inline void store_sums(uint16_t *y, __m512 sums, const float *bias, int64_t left) {
    const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias) : _mm512_setzero_ps();
    _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums, b)));
}

/* One tile: `rows` rows of x against a group's packed stream p. `next`: where this tile also
 * brings a share of the next group's stream into L2, or NULL. A group of more rows than a tile
 * holds runs several tiles, and those after the first read its weights from the core's cache:
 * the memory would idle while they run. So each of a group's `tiles` tiles (tile t given next at
 * pair t * pairs / tiles) requests the next group's pairs in order, one every `tiles` steps (a
 * countdown, not a division a step), and the next group's read overlaps this group's arithmetic
 * (docs/benchmarks.md measures it). The AVX2 fp32 loop does the same; the AVX-512 fp32 loop's
 * many-row tiles, where it measured no gain, do not. */
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx, const uint32_t *p,
                                                       int64_t pairs, const float *bias, uint16_t *y,
                                                       int64_t ldy, int64_t cols, const int rows,
                                                       const uint32_t *next, const int64_t tiles) {
    __m512 acc[ROWS][BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm512_setzero_ps();
    int64_t wait = 0; /* steps until the next step of `next` is requested */
    for (int64_t j = 0; j < pairs; j++) {
        const uint32_t *pj = p + j * GROUP;
        __m512bh w[BLOCKS];
        const int fetch = next && wait-- == 0;
        for (int b = 0; b < BLOCKS; b++) {
            _mm_prefetch((const char *)(pj + 16 * b) + AHEAD, _MM_HINT_T0);
            if (fetch) _mm_prefetch((const char *)(next + 16 * b), _MM_HINT_T1);
            w[b] = (__m512bh)_mm512_loadu_si512(pj + 16 * b);
        }
        if (fetch) next += GROUP, wait = tiles - 1;
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * j, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xb, w[b]);
        }
    }
    for (int b = 0; b < BLOCKS && cols > 16 * b; b++)
        for (int r = 0; r < rows; r++) store_sums(y + r * ldy + 16 * b, acc[r][b], bias ? bias + 16 * b : NULL, cols - 16 * b);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && BLOCKS == 3
#include "cpu_amx.h"
#define LINEAR_AMX 1
/* bf16 on the matrix units (AMX), for weights whose k / 2 pairs are a multiple of 16. The packing
 * is the same: a group's 16 pairs starting at pair j are a 16-row B tile for each of its three
 * 16-column blocks (rows GROUP pairs apart, 64 bytes each: 16 columns' pairs), so a step of 32
 * inputs is one A tile of up to 16 rows of x (64 bytes each, read where they lie) and three
 * tile products into three 16 x 16 fp32 C tiles. A group's rows go in tiles of up to 16; those
 * after the first read its weights from the core's cache. Each output is a sum of exact bf16
 * products in fp32 over the steps in order, its own row's and column's only, so a row's result
 * does not depend on the rows beside it; the tiles' sums are not vdpbf16ps's bits, so an AMX
 * build takes the tiles for every row count (and the vdpbf16ps loop for weights whose pairs are
 * not a multiple of 16, and where the OS refuses the tiles). Tiles: 0-2 C, 3 A, 4-6 B. */
#define AMX_PAIRS 16

static inline void amx_linear_configure(int rows) {
    const uint8_t r[7] = {rows, rows, rows, rows, AMX_PAIRS, AMX_PAIRS, AMX_PAIRS};
    amx_configure_rows(r, 7);
}

/* `m` rows of x (row stride ldx) against one group's packed stream pg: y's row for x's row r is
 * out[r] (NULL: r itself), columns cols of the group's GROUP. *configured: the tile row count
 * this thread's tiles are configured for (0: none yet).
 *
 * The group's first tile streams its weights from memory, and the later tiles (more than 16 rows)
 * read them from the core's cache, while the memory idles. `next` (or NULL): the stream of the
 * group this thread runs next, whose lines the later tiles request into L2 in order, an equal
 * share each, spread over their steps, so that the next group's read overlaps this group's
 * arithmetic (as the vdpbf16ps loop's `tile` does). `warm`: this group's stream was so requested
 * by the group before, and its first tile need not ask for it ahead. Requests only: the same
 * arithmetic, the same bits. */
static void amx_group(const uint16_t *x, int64_t ldx, int64_t m, const uint32_t *pg, int64_t pairs,
                      const float *bias, uint16_t *y, int64_t ldy, int64_t cols, const int64_t *out,
                      int *configured, const uint32_t *next, int warm) {
    float acc[16 * GROUP] __attribute__((aligned(64)));
    const int64_t steps = pairs / AMX_PAIRS, lines = pairs * GROUP * 4 / 64;
    for (int64_t t = 0, r0 = 0, tiles = (m + 15) / 16; t < tiles; t++) {
        /* tile t >= 1 requests lines [from, to) of `next`, `per_step` a step */
        const int64_t from = next && t ? (t - 1) * lines / (tiles - 1) : 0, to = next && t ? t * lines / (tiles - 1) : 0;
        const int64_t per_step = (to - from + steps - 1) / steps;
        const char *ask = (const char *)next + from * 64, *ask_end = (const char *)next + to * 64;
        const int take = (int)TILE_TAKE(m, r0, tiles, t);
        if (take != *configured) {
            amx_linear_configure(take);
            *configured = take;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        const uint16_t *xr = x + r0 * ldx;
        for (int64_t j = 0; j < pairs; j += AMX_PAIRS) {
            const uint32_t *pj = pg + j * GROUP;
            if (t == 0 && !warm) /* the first tile streams the group from memory: ask for it ahead */
                for (int l = 0; l < AMX_PAIRS * GROUP * 4; l += 64)
                    _mm_prefetch((const char *)pj + AHEAD + l, _MM_HINT_T0);
            for (int64_t l = 0; l < per_step && ask < ask_end; l++, ask += 64) _mm_prefetch(ask, _MM_HINT_T1);
            _tile_loadd(3, xr + 2 * j, ldx * 2);
            _tile_loadd(4, pj, GROUP * 4);
            _tile_dpbf16ps(0, 3, 4);
            _tile_loadd(5, pj + 16, GROUP * 4);
            _tile_dpbf16ps(1, 3, 5);
            _tile_loadd(6, pj + 32, GROUP * 4);
            _tile_dpbf16ps(2, 3, 6);
        }
        _tile_stored(0, acc, GROUP * 4);
        _tile_stored(1, acc + 16, GROUP * 4);
        _tile_stored(2, acc + 32, GROUP * 4);
        for (int b = 0; b < BLOCKS && cols > 16 * b; b++)
            for (int r = 0; r < take; r++)
                store_sums(y + (out ? out[r0 + r] : r0 + r) * ldy + 16 * b, _mm512_load_ps(acc + r * GROUP + 16 * b),
                           bias ? bias + 16 * b : NULL, cols - 16 * b);
        r0 += take;
    }
}
#else
#define LINEAR_AMX 0
#endif

/* whether a bf16 weight of `pairs` input pairs runs on the matrix units: an AMX build, the OS
 * letting this process use them, and whole steps of AMX_PAIRS (the one decision of both drivers) */
static int amx_serves(int64_t pairs) {
#if LINEAR_AMX
    return pairs % AMX_PAIRS == 0 && amx_usable();
#else
    (void)pairs;
    return 0;
#endif
}

/* 1 where bf16 rows run on the matrix units (an AMX build, and the OS lets this process use them) */
int structspec_linear_amx(void) { return amx_serves(0); }

/* y [m, n] = x [m, k] by the packed weight (+ bias, fp32, or NULL); bf16 rows, unit last stride */
void structspec_linear(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint32_t *p,
                       const float *bias, uint16_t *y, int64_t ldy, int64_t n, int threads) {
    const int64_t pairs = k / 2, groups = (n + GROUP - 1) / GROUP;
    const int parallel = threads > 1 && groups > 1 && groups * pairs * GROUP * 4 >= PARALLEL_MIN_BYTES;
#if LINEAR_AMX
    if (amx_serves(pairs)) {
#pragma omp parallel num_threads(threads) if (parallel)
        {
            int configured = 0;
            int64_t last = -2; /* the group this thread ran last (a static schedule: its own run of groups) */
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const uint32_t *pg = p + g * pairs * GROUP;
                amx_group(x, ldx, m, pg, pairs, bias ? bias + g * GROUP : 0, y + g * GROUP, ldy,
                          n - g * GROUP < GROUP ? n - g * GROUP : GROUP, NULL, &configured,
                          g + 1 < groups ? pg + pairs * GROUP : NULL, last == g - 1 && m > 16);
                last = g;
            }
            if (configured) _tile_release();
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t g = 0; g < groups; g++) {
        const uint32_t *pg = p + g * pairs * GROUP;
        const float *bg = bias ? bias + g * GROUP : 0;
        const int64_t cols = n - g * GROUP < GROUP ? n - g * GROUP : GROUP;
        const uint32_t *next = g + 1 < groups ? pg + pairs * GROUP : NULL;
#define BF16_TILE(rows) tile(x + r0 * ldx, ldx, pg, pairs, bg, y + r0 * ldy + g * GROUP, ldy, cols, rows, \
                             tiles > 1 && next ? next + t * pairs / tiles * GROUP : NULL, tiles)
        TILES(m, ROWS, CASES7, BF16_TILE)
#undef BF16_TILE
    }
}

/* Pruned logits in bf16: structspec_linear's y [m, n] where asked for, -inf elsewhere, as
 * structspec_linear_f32_pruned below gives them in fp32: `wanted` marks groups of 16 columns (the
 * bitmask's), and a group of this loop's GROUP columns is computed for every row when any of its
 * 16-column groups is wanted, for the dense rows only otherwise. A computed column is the same
 * tile's chain as structspec_linear's, so the same bits. */
void structspec_linear_pruned(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint32_t *p,
                              const float *bias, uint16_t *y, int64_t ldy, int64_t n, const uint8_t *dense,
                              const uint8_t *wanted, int threads) {
    const int64_t pairs = k / 2, groups = (n + GROUP - 1) / GROUP, narrow = (n + 15) / 16;
    int64_t *rows_of, nd;
    const uint16_t *xd = dense_rows_first(x, ldx, m, k, sizeof(uint16_t), dense, &rows_of, &nd);
    const int parallel = threads > 1 && groups > 1 && groups * pairs * GROUP * 4 >= PARALLEL_MIN_BYTES;
    const int amx = amx_serves(pairs);
#pragma omp parallel num_threads(threads) if (parallel)
    {
        int configured = 0; /* this thread's AMX tile rows (0: not configured) */
#pragma omp for schedule(dynamic, 8)
        for (int64_t g = 0; g < groups; g++) {
            const uint32_t *pg = p + g * pairs * GROUP;
            const float *bg = bias ? bias + g * GROUP : 0;
            const int64_t cols = n - g * GROUP < GROUP ? n - g * GROUP : GROUP;
            uint16_t *yg = y + g * GROUP;
            int want = 0;
            for (int64_t w = g * BLOCKS; w < (g + 1) * BLOCKS && w < narrow; w++) want |= wanted[w];
#if LINEAR_AMX
            if (amx) {
                if (want) amx_group(x, ldx, m, pg, pairs, bg, yg, ldy, cols, NULL, &configured, NULL, 0);
                else amx_group(xd, k, nd, pg, pairs, bg, yg, ldy, cols, rows_of, &configured, NULL, 0);
            } else
#endif
            if (want) {
#define ALL_ROWS(rows) tile(x + r0 * ldx, ldx, pg, pairs, bg, yg + r0 * ldy, ldy, cols, rows, NULL, 1)
                TILES(m, ROWS, CASES7, ALL_ROWS)
#undef ALL_ROWS
            } else {
                uint16_t strip[ROWS * GROUP];
#define DENSE_ROWS(rows)                                                                             \
    do {                                                                                             \
        tile(xd + r0 * k, k, pg, pairs, bg, strip, GROUP, cols, rows, NULL, 1);                      \
        for (int r = 0; r < (rows); r++)                                                             \
            memcpy(yg + rows_of[r0 + r] * ldy, strip + r * GROUP, sizeof(uint16_t) * cols);          \
    } while (0)
                TILES(nd, ROWS, CASES7, DENSE_ROWS)
#undef DENSE_ROWS
            }
            if (!want)
                for (int64_t i = nd; i < m; i++)
                    for (int64_t c = 0; c < cols; c++) yg[rows_of[i] * ldy + c] = 0xff80; /* bf16 -inf */
        }
#if LINEAR_AMX
        if (configured) _tile_release();
#endif
    }
    free((void *)xd);
    free(rows_of);
}
#endif /* __AVX512BF16__ */

/* fp32 with AVX-512 (the AVX2 loop is further down): the same loop, one input a step. A bf16
 * step's two products an instruction let 8 rows against 3 vectors hide under the weight read;
 * an fp32 step's one product is twice the instructions, and rows of a second tile (read from
 * cache after the first) no longer overlap the stream. So the fp32 weight is packed in groups
 * of 16 columns, and
 *   - up to FEW_ROWS rows (decode and verification passes) go in one tile a group: every row
 *     against each loaded vector while the group streams from memory;
 *   - more rows go in tiles of up to MANY_ROWS against MANY_BLOCKS neighbouring groups at once
 *     (each group its own stream), the later tiles reading them again from the core's cache.
 * Each output is the same chain over k either way. */
#ifndef F32_FEW_ROWS
#define F32_FEW_ROWS 16
#endif
#ifndef F32_MANY_ROWS
#define F32_MANY_ROWS 12
#endif
#ifndef F32_MANY_BLOCKS
#define F32_MANY_BLOCKS 2
#endif
#if F32_FEW_ROWS > 16 || F32_MANY_ROWS > 16 || F32_MANY_ROWS * F32_MANY_BLOCKS + F32_MANY_BLOCKS + 1 > 32
#error "fp32 tiles: at most 16 rows, and rows x blocks accumulators must fit the 32 registers"
#endif
#define F32_GROUP 16

int64_t structspec_linear_f32_packed_floats(int64_t n, int64_t k) { return (n + F32_GROUP - 1) / F32_GROUP * k * F32_GROUP; }

/* w [n, k] fp32 (row stride ldw) -> p [groups][k][16], zero past n */
void structspec_linear_f32_pack(const float *w, int64_t ldw, int64_t n, int64_t k, float *p) {
    const int64_t groups = (n + F32_GROUP - 1) / F32_GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t j = 0; j < k; j++)
            for (int64_t l = 0; l < F32_GROUP; l++) {
                const int64_t o = g * F32_GROUP + l;
                p[(g * k + j) * F32_GROUP + l] = o < n ? w[o * ldw + j] : 0.0f;
            }
}

#ifdef __AVX512F__
/* A tile reads row r's input at step j from x[r * ldx + j * step]: the rows where they lie (ldx
 * their stride, step 1), or copied side by side, each step's rows one run (ldx 1, step the
 * tile's rows; rows_side_by_side). Where they lie, each row's broadcasts take a pointer register,
 * and a 16-row tile's 16 pointers did not fit: GCC reloaded six from the stack at every step.
 * Side by side, one pointer serves every row at offsets fixed at compile time. Calls of more
 * than F32_SIDE_BY_SIDE_ABOVE rows in the few-row tiles copy them so (a 16 x 1 decode step's
 * linear layers ~1.15x faster on the Cascade Lake host); the many-row tiles, measured slower
 * with the copy, read the rows where they lie. The same products in the same order either way. */
#define F32_SIDE_BY_SIDE_ABOVE 8

/* x [m, k] (row stride ldx) as the tiles of TILES(m, R, ...) read it side by side: the tile of
 * rows r0 .. r0 + take - 1 at xt + r0 * k, its step j at xt[r0 * k + j * take + r]. The steps are
 * split over the threads. Freed by the caller. */
static float *rows_side_by_side(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t R, int threads) {
    float *xt = malloc(sizeof(float) * (m * k > 0 ? m * k : 1));
    const int64_t tiles = (m + R - 1) / R;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && m * k >= 4096)
    for (int64_t j = 0; j < k; j++)
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int64_t take = TILE_TAKE(m, r0, tiles, t);
            for (int64_t r = 0; r < take; r++) xt[r0 * k + j * take + r] = x[(r0 + r) * ldx + j];
            r0 += take;
        }
    return xt;
}

/* x's rows side by side (rows_side_by_side, tiles of up to F32_FEW_ROWS) for one-group tiles,
 * where that pays: more than F32_SIDE_BY_SIDE_ABOVE rows; else NULL (read them where they lie) */
static float *side_by_side_where_it_pays(const float *x, int64_t ldx, int64_t m, int64_t k, int threads) {
    return m > F32_SIDE_BY_SIDE_ABOVE ? rows_side_by_side(x, ldx, m, k, F32_FEW_ROWS, threads) : NULL;
}

/* rows x (blocks groups of 16 columns, the groups' packed streams k * 16 floats apart) */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, int64_t step, const float *p,
                                                           int64_t k, const float *bias, float *y, int64_t ldy,
                                                           int64_t cols, const int rows, const int blocks) {
    __m512 acc[16][F32_MANY_BLOCKS > 1 ? F32_MANY_BLOCKS : 1];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j++) {
        __m512 w[F32_MANY_BLOCKS > 1 ? F32_MANY_BLOCKS : 1];
        for (int b = 0; b < blocks; b++) {
            const float *pj = p + (b * k + j) * F32_GROUP;
            _mm_prefetch((const char *)pj + AHEAD, _MM_HINT_T0);
            w[b] = _mm512_loadu_ps(pj);
        }
        for (int r = 0; r < rows; r++) {
            const __m512 xb = _mm512_set1_ps(x[r * ldx + j * step]);
            for (int b = 0; b < blocks; b++) acc[r][b] = _mm512_fmadd_ps(xb, w[b], acc[r][b]);
        }
    }
    for (int b = 0; b < blocks; b++) {
        const int64_t left = cols - 16 * b;
        if (left <= 0) break;
        const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 bb = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * b) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * ldy + 16 * b, m, _mm512_add_ps(acc[r][b], bb));
    }
}

/* y [m, n] = x [m, k] by the packed fp32 weight (+ bias or NULL); fp32 rows, unit last stride */
void structspec_linear_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *p, const float *bias,
                           float *y, int64_t ldy, int64_t n, int threads) {
    const int64_t groups = (n + F32_GROUP - 1) / F32_GROUP;
    const int few = m <= F32_FEW_ROWS, span = few ? 1 : F32_MANY_BLOCKS; /* groups a tile */
    const int64_t spans = (groups + span - 1) / span;
    const int parallel = threads > 1 && spans > 1 && groups * k * F32_GROUP * 4 >= PARALLEL_MIN_BYTES;
    float *xt = few ? side_by_side_where_it_pays(x, ldx, m, k, parallel ? threads : 1) : NULL;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t s = 0; s < spans; s++) {
        const int64_t c0 = s * span * F32_GROUP, cols = n - c0 < span * F32_GROUP ? n - c0 : span * F32_GROUP;
        const float *ps = p + s * span * k * F32_GROUP;
        const float *bs = bias ? bias + c0 : 0;
        const int blocks = (int)((cols + F32_GROUP - 1) / F32_GROUP);
#define F32_TILE(rows, nb) tile_f32(x + r0 * ldx, ldx, 1, ps, k, bs, y + r0 * ldy + c0, ldy, cols, rows, nb)
#define FEW(rows) F32_TILE(rows, 1)
#define FEW_SIDE_BY_SIDE(rows) tile_f32(xt + r0 * k, 1, rows, ps, k, bs, y + r0 * ldy + c0, ldy, cols, rows, 1)
#define MANY(rows) F32_TILE(rows, F32_MANY_BLOCKS)
        if (xt) {
            TILES(m, F32_FEW_ROWS, CASES15, FEW_SIDE_BY_SIDE)
        } else if (few) {
            TILES(m, F32_FEW_ROWS, CASES15, FEW)
        } else if (blocks == F32_MANY_BLOCKS) {
            TILES(m, F32_MANY_ROWS, CASES15, MANY)
        } else { /* the last span, fewer groups: one at a time */
            for (int b = 0; b < blocks; b++) {
                const float *pb = ps + b * k * F32_GROUP;
                const float *bb = bs ? bs + b * F32_GROUP : 0;
                const int64_t cb = cols - b * F32_GROUP < F32_GROUP ? cols - b * F32_GROUP : F32_GROUP;
#define ONE(rows) tile_f32(x + r0 * ldx, ldx, 1, pb, k, bb, y + r0 * ldy + c0 + b * F32_GROUP, ldy, cb, rows, 1)
                TILES(m, F32_MANY_ROWS, CASES15, ONE)
#undef ONE
            }
        }
#undef MANY
#undef FEW_SIDE_BY_SIDE
#undef FEW
#undef F32_TILE
    }
    free(xt);
}
#else /* AVX2 and FMA: 16 registers of 8 lanes */

/* A group's 16 columns are two registers; a tile holds up to F32_AVX2_ROWS rows against them
 * (2 x rows accumulators, the two weight registers, a broadcast: at most 15 of the 16), for any
 * row count, the later tiles of a group reading its weights again from the core's cache. The
 * same chain over k as the AVX-512 loop, so the same results. */
#ifndef F32_AVX2_ROWS
#define F32_AVX2_ROWS 6
#endif
#if F32_AVX2_ROWS > 6
#error "F32_AVX2_ROWS is at most 6 (2 x rows accumulators + 3 must fit the 16 registers)"
#endif

static inline __m256i lanes_below(int64_t left) { /* all-ones in the lanes < left */
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t ldx, const float *p, int64_t k,
                                                           const float *bias, float *y, int64_t ldy,
                                                           int64_t cols, const int rows, const float *next,
                                                           const int64_t tiles) {
    __m256 acc[F32_AVX2_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t wait = 0; /* as tile's in the bf16 loop */
    for (int64_t j = 0; j < k; j++) {
        const float *pj = p + j * F32_GROUP;
        _mm_prefetch((const char *)pj + AHEAD, _MM_HINT_T0);
        if (next && wait-- == 0) {
            _mm_prefetch((const char *)next, _MM_HINT_T1);
            next += F32_GROUP, wait = tiles - 1;
        }
        const __m256 w0 = _mm256_loadu_ps(pj), w1 = _mm256_loadu_ps(pj + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * ldx + j);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int b = 0; b < 2; b++) {
        const int64_t left = cols - 8 * b;
        if (left <= 0) break;
        const __m256i m = lanes_below(left);
        const __m256 bb = bias ? _mm256_maskload_ps(bias + 8 * b, m) : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) _mm256_maskstore_ps(y + r * ldy + 8 * b, m, _mm256_add_ps(acc[r][b], bb));
    }
}

/* y [m, n] = x [m, k] by the packed fp32 weight (+ bias or NULL); fp32 rows, unit last stride */
void structspec_linear_f32(const float *x, int64_t ldx, int64_t m, int64_t k, const float *p, const float *bias,
                           float *y, int64_t ldy, int64_t n, int threads) {
    const int64_t groups = (n + F32_GROUP - 1) / F32_GROUP;
    const int parallel = threads > 1 && groups > 1 && groups * k * F32_GROUP * 4 >= PARALLEL_MIN_BYTES;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t g = 0; g < groups; g++) {
        const float *pg = p + g * k * F32_GROUP;
        const float *bg = bias ? bias + g * F32_GROUP : 0;
        const int64_t cols = n - g * F32_GROUP < F32_GROUP ? n - g * F32_GROUP : F32_GROUP;
        const float *next = g + 1 < groups ? pg + k * F32_GROUP : NULL; /* as tile's in the bf16 loop */
#define AVX2_TILE(rows) tile_f32(x + r0 * ldx, ldx, pg, k, bg, y + r0 * ldy + g * F32_GROUP, ldy, cols, rows, \
                                 tiles > 1 && next ? next + t * k / tiles * F32_GROUP : NULL, tiles)
        TILES(m, F32_AVX2_ROWS, CASES7, AVX2_TILE)
#undef AVX2_TILE
    }
}
#endif /* __AVX512F__ */

/* One group's columns (16: pg its packed stream, bg its bias, cols of them real) for the `rows`
 * rows from r0 of the m rows xx (row stride ldxx; xxt: the same rows side by side, or NULL)
 * into yy (stride ldyy): a tile of the loop above that serves any row count, so the same chain
 * over k as structspec_linear_f32 gives each output. */
#ifdef __AVX512F__
#define GROUP_TILE_ROWS F32_FEW_ROWS
#define GROUP_TILE_CASES CASES15
#define GROUP_SIDE_BY_SIDE(xx, ldxx, m) side_by_side_where_it_pays(xx, ldxx, m, k, parallel ? threads : 1)
#define GROUP_TILE(xx, ldxx, xxt, yy, ldyy, rows)                                                    \
    ((xxt) ? tile_f32((xxt) + r0 * k, 1, rows, pg, k, bg, yy, ldyy, cols, rows, 1)                 \
           : tile_f32((xx) + r0 * (ldxx), ldxx, 1, pg, k, bg, yy, ldyy, cols, rows, 1))
#else
#define GROUP_TILE_ROWS F32_AVX2_ROWS
#define GROUP_TILE_CASES CASES7
#define GROUP_SIDE_BY_SIDE(xx, ldxx, m) ((float *)NULL)
#define GROUP_TILE(xx, ldxx, xxt, yy, ldyy, rows) tile_f32((xx) + r0 * (ldxx), ldxx, pg, k, bg, yy, ldyy, cols, rows, NULL, 1)
#endif

/* Pruned logits: structspec_linear_f32's y [m, n] where it is asked for, -inf elsewhere. A row
 * with dense[r] set gets every column; the others get only the 16-column groups g with wanted[g]
 * set (the union of what those rows' grammars allow). A computed column is the same chain over
 * k as structspec_linear_f32's, so the same bits. Groups run in parallel: a wanted group's tiles
 * take every row straight from x into y; another group's take the dense rows (gathered once
 * into a copy) into a strip that is then copied to their rows of y. */
void structspec_linear_f32_pruned(const float *x, int64_t ldx, int64_t m, int64_t k, const float *p,
                                  const float *bias, float *y, int64_t ldy, int64_t n, const uint8_t *dense,
                                  const uint8_t *wanted, int threads) {
    const int64_t groups = (n + F32_GROUP - 1) / F32_GROUP;
    int64_t *rows_of, nd;
    const float *xd = dense_rows_first(x, ldx, m, k, sizeof(float), dense, &rows_of, &nd);
    const int parallel = threads > 1 && groups > 1 && groups * k * F32_GROUP * 4 >= PARALLEL_MIN_BYTES;
    float *xt = GROUP_SIDE_BY_SIDE(x, ldx, m), *xdt = GROUP_SIDE_BY_SIDE(xd, k, nd);
#pragma omp parallel for schedule(dynamic, 16) num_threads(threads) if (parallel)
    for (int64_t g = 0; g < groups; g++) {
        const float *pg = p + g * k * F32_GROUP;
        const float *bg = bias ? bias + g * F32_GROUP : 0;
        const int64_t cols = n - g * F32_GROUP < F32_GROUP ? n - g * F32_GROUP : F32_GROUP;
        float *yg = y + g * F32_GROUP;
        if (wanted[g]) {
#define ALL_ROWS(rows) GROUP_TILE(x, ldx, xt, yg + r0 * ldy, ldy, rows)
            TILES(m, GROUP_TILE_ROWS, GROUP_TILE_CASES, ALL_ROWS)
#undef ALL_ROWS
            continue;
        }
        float strip[GROUP_TILE_ROWS * F32_GROUP];
#define DENSE_ROWS(rows)                                                                             \
    do {                                                                                             \
        GROUP_TILE(xd, k, xdt, strip, F32_GROUP, rows);                                              \
        for (int r = 0; r < (rows); r++)                                                             \
            memcpy(yg + rows_of[r0 + r] * ldy, strip + r * F32_GROUP, sizeof(float) * cols);        \
    } while (0)
        TILES(nd, GROUP_TILE_ROWS, GROUP_TILE_CASES, DENSE_ROWS)
#undef DENSE_ROWS
        for (int64_t i = nd; i < m; i++)
            for (int64_t c = 0; c < cols; c++) yg[rows_of[i] * ldy + c] = -INFINITY;
    }
    free(xt);
    free(xdt);
    free((void *)xd);
    free(rows_of);
}
