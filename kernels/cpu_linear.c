/* bf16 linear layers for a few rows (decode and verification passes), for CPUs with AVX512-BF16.
 *
 * A pass over a few rows reads every weight once and does little arithmetic with each, so its
 * time is the weight read plus whatever part of the arithmetic does not overlap it. Here the
 * weight is packed once into the order this loop reads it, groups of GROUP output columns, each
 * group a run of (k pair, GROUP columns) of bf16 pairs, so a group is one contiguous stream that
 * the loop prefetches ahead of itself, and each loaded pair meets up to ROWS rows held in
 * registers (vdpbf16ps: two products added into fp32 in one instruction). Groups are split over
 * OpenMP threads; a group's rows go in tiles of up to ROWS, the later tiles reading the group's
 * weights again from the core's cache.
 *
 *   y[r, n] = round_bf16(bias[n] + sum over k pairs j, in order, of (x[r,2j] w[n,2j] + x[r,2j+1] w[n,2j+1]))
 *
 * Each output is one chain over the pairs in order, whatever the row count and the rows beside
 * it, so a row's result does not depend on the batch it runs in. The sum order is not oneDNN's:
 * results differ from F.linear's in the last bits of the fp32 sum (one unit of bf16 where the sum
 * lies at a rounding boundary).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#ifndef __AVX512BF16__
#error "cpu_linear.c needs AVX512-BF16 (vdpbf16ps); this CPU or compiler lacks it"
#endif

#ifndef BLOCKS
#define BLOCKS 3   /* 16-lane registers of output columns a group */
#endif
#ifndef ROWS
#define ROWS 8     /* rows a tile: ROWS x BLOCKS accumulators, BLOCKS weight registers, a broadcast */
#endif
#define GROUP (16 * BLOCKS)
#ifndef AHEAD
#define AHEAD 4096 /* bytes the loop prefetches ahead of itself in the packed weight */
#endif
#define PARALLEL_MIN_BYTES 131072 /* below this much packed weight, one thread */

int structspec_linear_version(void) { return 1; }

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

static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t ldx, const uint32_t *p,
                                                       int64_t pairs, const float *bias, uint16_t *y,
                                                       int64_t ldy, int64_t cols, const int rows) {
    __m512 acc[ROWS][BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm512_setzero_ps();
    for (int64_t j = 0; j < pairs; j++) {
        const uint32_t *pj = p + j * GROUP;
        __m512bh w[BLOCKS];
        for (int b = 0; b < BLOCKS; b++) {
            _mm_prefetch((const char *)(pj + 16 * b) + AHEAD, _MM_HINT_T0);
            w[b] = (__m512bh)_mm512_loadu_si512(pj + 16 * b);
        }
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * j, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int b = 0; b < BLOCKS; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xb, w[b]);
        }
    }
    for (int b = 0; b < BLOCKS; b++) {
        const int64_t left = cols - 16 * b;
        if (left <= 0) break;
        const __mmask16 m = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512 bb = bias ? _mm512_maskz_loadu_ps(m, bias + 16 * b) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][b], bb));
            _mm256_mask_storeu_epi16(y + r * ldy + 16 * b, m, (__m256i)h);
        }
    }
}

/* y [m, n] = x [m, k] by the packed weight (+ bias, fp32, or NULL); bf16 rows, unit last stride */
void structspec_linear(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint32_t *p,
                       const float *bias, uint16_t *y, int64_t ldy, int64_t n, int threads) {
    const int64_t pairs = k / 2, groups = (n + GROUP - 1) / GROUP;
    const int64_t tiles = (m + ROWS - 1) / ROWS;
    const int parallel = threads > 1 && groups > 1 && groups * pairs * GROUP * 4 >= PARALLEL_MIN_BYTES;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t g = 0; g < groups; g++) {
        const uint32_t *pg = p + g * pairs * GROUP;
        const float *bg = bias ? bias + g * GROUP : 0;
        const int64_t cols = n - g * GROUP < GROUP ? n - g * GROUP : GROUP;
        for (int64_t t = 0, r0 = 0; t < tiles; t++) {
            const int64_t rows = (m - r0) / (tiles - t); /* tiles of near-equal size, the larger first */
            const int64_t take = rows + ((m - r0) % (tiles - t) != 0);
            const uint16_t *xt = x + r0 * ldx;
            uint16_t *yt = y + r0 * ldy + g * GROUP;
            switch (take) { /* each row count its own unrolled loop */
#if ROWS > 1
                case 1: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 1); break;
#endif
#if ROWS > 2
                case 2: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 2); break;
#endif
#if ROWS > 3
                case 3: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 3); break;
#endif
#if ROWS > 4
                case 4: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 4); break;
#endif
#if ROWS > 5
                case 5: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 5); break;
#endif
#if ROWS > 6
                case 6: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 6); break;
#endif
#if ROWS > 7
                case 7: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 7); break;
#endif
#if ROWS > 8
                case 8: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 8); break;
#endif
#if ROWS > 9
                case 9: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 9); break;
#endif
#if ROWS > 10
                case 10: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 10); break;
#endif
#if ROWS > 11
                case 11: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, 11); break;
#endif
                default: tile(xt, ldx, pg, pairs, bg, yt, ldy, cols, ROWS); break;
            }
            r0 += take;
        }
    }
}
