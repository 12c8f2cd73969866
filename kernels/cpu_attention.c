/* Ragged attention over per-sequence KV buffers, for the CPU: decode, verification and prefill
 * rows of many sequences in one call per layer.
 *
 * The same step description as kernels/attention.py (the Triton kernels): a table of int64
 * [2 * layers + 4, S]: every layer's key buffer addresses, then every layer's value buffer
 * addresses, then each sequence's first row, row count, past length and capacity. A sequence's
 * buffer for one layer is [KVH, capacity, D] contiguous, fp32 or bf16 (bf16 halves what a step
 * reads; the arithmetic is fp32 either way). One call appends every listed
 * sequence's new keys/values for one layer and attends its new rows over its buffer, in fp32.
 *
 * Work item: one (sequence, kv head, block of up to ROW_BLOCK rows). Its G = H / KVH query heads
 * times its rows share every key and value read: K and V are read once per item, whatever the
 * rows (the blocking that a loop over (query, key) pairs lacks); a long prefill chunk's blocks
 * are separate items so that it keeps every thread busy. Every new key and value is appended
 * before any item runs. Items run in parallel under OpenMP (the runtime torch
 * already loaded: the same soname, so one thread pool).
 *
 * Shared prefixes: documents of one schema begin with the same instruction + schema tokens, whose
 * KV each sequence's buffer holds as a copy of the prefix cache's entry. With `shared` set, the
 * table carries 2 * layers + 2 more rows: every layer's key addresses of a sequence's prefix
 * entry, then every layer's value addresses, then the entry's length and its capacity (0: none).
 * A block of keys or values that lies wholly inside that length is read from the entry rather than
 * from the sequence's own copy: the same bits, so the same results, but the sequences of a batch
 * that share a prefix read one copy of it, which stays in cache from one to the next, instead of
 * each streaming its own from memory.
 *
 * HEAD_DIM and VALUE_DIM are fixed at compile time (kernels/cpu_attention.py builds one library
 * per shape) so the dot products unroll into whole vectors.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<d> -DVALUE_DIM=<dv>"
#endif
#define D HEAD_DIM
#define DV VALUE_DIM
#if D % 8 || DV % 8
#error "head sizes must be multiples of 8"
#endif

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Row `t`, head `h` of a [T, heads, dim] tensor (any row/head strides, unit last stride),
 * fp32 or bf16, into dst[dim] as fp32. */
static inline void load_row(const void *base, int bf16, int64_t off, float *dst, int dim) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + off;
        for (int d = 0; d < dim; d++) dst[d] = bf16_to_f32(p[d]);
    } else {
        memcpy(dst, (const float *)base + off, sizeof(float) * dim);
    }
}

#if D % 16 == 0 && DV % 16 == 0 && defined(__AVX512F__)
#define VW 16 /* lanes: one AVX-512 register */
#else
#define VW 8 /* one AVX2 register: with 16 of them, 16-lane vectors (two registers each) spilled the
              * q.K and P.V accumulators (an fp32 decode step's attention 2.5x slower on a Zen 3) */
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
#ifdef __AVX__
#include <immintrin.h>
#endif
/* a * b + c, rounded once where the CPU has FMA. Written out, not left to the compiler's
 * contraction of `c += a * b`: GCC's tuning for AMD cores declines to fuse some chains of such
 * adds, so the same expression rounded differently across paths that must agree bit for bit
 * (dot_block against qk_tree's explicit fmadd, a row's P.V alone and beside others). */
#if VW == 16
#define fmadd(a, b, c) ((vf)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#elif defined(__FMA__)
#define fmadd(a, b, c) ((vf)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#else
#define fmadd(a, b, c) ((a) * (b) + (c)) /* no fused instruction: two roundings, wherever it is used */
#endif
/* Software prefetch: the hardware's streams alone kept a step at ~14 GB/s, half of what this
 * machine reads. While q.K reads a run of keys, the keys PREFETCH_KEYS ahead are requested, and
 * on the AMX build the values of the same keys too (into L2, for P.V). Without AMX (the bf16 build
 * for AVX512-BF16 CPUs), P.V requests its own values PREFETCH_VALUES ahead instead, on its first
 * pass over them: on a Zen 5 the values' prefetch during q.K slowed a decode step's attention
 * by a third (docs/benchmarks.md); the AMX build keeps what was measured on its host. */
#define PREFETCH_KEYS 64
#define PREFETCH_VALUES 64
/* fp32 values in the generic P.V: requested PREFETCH_VALUES_F32 keys ahead on its first pass over
 * them, two rows a key pair, rather than a block's worth at once during q.K: on the AVX2-only Zen 3
 * host an fp32 decode step's attention took ~10% less time (docs/benchmarks.md) */
#define PREFETCH_VALUES_F32 16
/* fp32 keys in the generic q.K: requested a block (PREFETCH_KEYS) ahead in one burst by the AVX2
 * build (what its Zen 3 host measured with); the AVX-512 build leaves them to the hardware's
 * streams, which on its Intel host (no AVX512-BF16) read them faster than with the burst or with
 * the requests spread over the block (docs/benchmarks.md) */
#define PREFETCH_KEYS_F32 (VW == 8)
/* q.K of up to this many of an item's queries (a tile's) puts the keys' pairs in lanes (qk_keys: a
 * transpose of each 16 keys, then a chain per query), of more the queries' pairs (qk_queries: a
 * chain per key, all 16 lanes busy); qk_keys_for's cases go this far */
#define KEYS_IN_LANES 12
#define NB 64    /* keys per block: a block's keys (or values) in fp32 stay in L1 for every query */
#define VD (D / VW)
#define VDV (DV / VW)
#ifdef __AVX512F__
#define PV_VECS VDV /* P.V's accumulators: every dim of a query at once (2 x VDV of the 32 registers) */
#else /* 16 registers: up to 4 vectors of dims at a time, two chains each, the rest for the loads */
#define PV_VECS (VDV % 4 == 0 ? 4 : VDV % 2 == 0 ? 2 : 1)
#endif
#if defined(__AVX512BF16__) && D % 32 == 0 && VW == 16
#include <immintrin.h>
#define DPBF16 1 /* q.K straight from bf16 keys: vdpbf16ps, fp32 sums of exact bf16 products */
#else
#define DPBF16 0
#endif
#if DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && D <= 128
#include "cpu_amx.h"
/* q.K on the matrix units: for a block of 16 keys and up to 16 of an item's queries, S^T = K Q^T
 * as tiles: A = the 16 keys' rows (32 dims each, read from the KV buffer as they lie), B = the
 * queries transposed into bf16 pairs (built once per item), C = 16 x 16 fp32 scores. Each score
 * is an fp32 sum of exact bf16 products of its own query and key, whatever else shares the tile,
 * so a query's scores do not depend on the batch. */
#define AMX 1
#ifndef PV_TILES
#define PV_TILES 1 /* P.V on the tiles too (pv_tiles); 0: vdpbf16ps (pv_bf16), for measuring one against the other */
#endif
/* tiles 0: C, 1-2: A (keys, alternating), 3-6: B (one per 32 dims): all 16 rows of 64 bytes. */
static inline void amx_configure(void) {
    static const uint8_t rows[7] = {16, 16, 16, 16, 16, 16, 16};
    amx_configure_rows(rows, 7);
}
#else
#define AMX 0
#endif

/* The VW sums of a[0..VW-1]'s lanes, as one vector (lane i: the sum of a[i]): a transposing
 * tree of two-input shuffles and adds. */
static inline vf sum_lanes(vf *a) {
#if VW == 16
#define LO8(x, y) __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
#define HI8(x, y) __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31)
#define LO4(x, y) __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
#define HI4(x, y) __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)
#define LO2(x, y) __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
#define HI2(x, y) __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31)
#define LO1(x, y) __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
#define HI1(x, y) __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31)
    vf b[8], c[4], d[2];
    for (int i = 0; i < 8; i++) b[i] = LO8(a[2 * i], a[2 * i + 1]) + HI8(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 4; i++) c[i] = LO4(b[2 * i], b[2 * i + 1]) + HI4(b[2 * i], b[2 * i + 1]);
    for (int i = 0; i < 2; i++) d[i] = LO2(c[2 * i], c[2 * i + 1]) + HI2(c[2 * i], c[2 * i + 1]);
    return LO1(d[0], d[1]) + HI1(d[0], d[1]);
#else
#define HADD(x, y) (__builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + \
                    __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15))
    vf t0 = HADD(a[0], a[1]), t1 = HADD(a[2], a[3]), t2 = HADD(a[4], a[5]), t3 = HADD(a[6], a[7]);
    vf u0 = HADD(t0, t1), u1 = HADD(t2, t3);
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
#endif
}

/* the larger of a and b lane by lane, b where they are equal or either is a NaN (maxps's rule) */
static inline vf lane_max(vf a, vf b) {
#if VW == 16
    return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
    return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
    typedef int32_t vi __attribute__((vector_size(4 * VW)));
    vi gt = a > b;
    return (vf)(((vi)a & gt) | ((vi)b & ~gt));
#endif
}

/* the largest of x[0:n] (n >= 1), VW lanes at a time in four independent chains (one chain, each
 * step waiting on the last, had made this pass ~15% of a prefill chunk's attention) */
static inline float row_max(const float *x, int64_t n) {
    vf mv[4];
#if VW == 16
    for (int c = 0; c < 4; c++) mv[c] = (vf)_mm512_set1_ps(x[0]);
#else
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < VW; i++) mv[c][i] = x[0];
#endif
    int64_t i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW)
        for (int c = 0; c < 4; c++) {
            vf v;
            memcpy(&v, x + i + c * VW, sizeof v);
            mv[c] = lane_max(v, mv[c]);
        }
    for (; i + VW <= n; i += VW) {
        vf v;
        memcpy(&v, x + i, sizeof v);
        mv[0] = lane_max(v, mv[0]);
    }
#if VW == 16
    /* the last n - i < 16: one masked load, the lanes past n keeping mv[1]'s (no larger than the
     * maximum), then a tree across the lanes (the scalar compares of both had been ~a tenth of a
     * prefill chunk's attention, rows of causal lengths ending anywhere in a vector) */
    if (i < n) {
        const __m512 v = _mm512_mask_loadu_ps((__m512)mv[1], (__mmask16)((1u << (n - i)) - 1), x + i);
        mv[1] = lane_max(v, mv[1]);
    }
    return _mm512_reduce_max_ps((__m512)lane_max(lane_max(mv[3], mv[2]), lane_max(mv[1], mv[0])));
#else
    vf all = lane_max(lane_max(mv[3], mv[2]), lane_max(mv[1], mv[0]));
    float m = all[0];
    for (int l = 1; l < VW; l++) m = all[l] > m ? all[l] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
#endif
}

/* e^x lane by lane for x <= 0 (scores minus their row's maximum): Cody-Waite reduction (k
 * rounded to nearest even) and a degree-6 polynomial, within 2 ulp of expf, on VW lanes at once.
 * x is first raised to -87 where below (a NaN stays a NaN), so 2^k is a normal number, and p * 2^k
 * is one rounding (AVX-512's scalef rounds as the product does) */
static inline vf exp_nonpos(vf x) {
    typedef int32_t vi __attribute__((vector_size(4 * VW)));
    vf lowest;
    for (int i = 0; i < VW; i++) lowest[i] = -87.0f;
    x = lane_max(lowest, x);
    vf k = x * 1.44269504088896341f;
#if VW == 16
    k = (vf)_mm512_roundscale_ps((__m512)k, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif defined(__AVX__)
    k = (vf)_mm256_round_ps((__m256)k, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    for (int i = 0; i < VW; i++) k[i] = __builtin_rintf(k[i]); /* nearest even, the default mode */
#endif
    vf r = x - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    vf p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f
              + r * 0.00138888892f)))));
#if VW == 16
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)k);
#else
    vi bits = (__builtin_convertvector(k, vi) + 127) << 23;
    return p * (vf)bits;
#endif
}

/* One query's softmax numerators in place: s[n] = e^(s[n] * scale - m) for n in [a, e), 0 elsewhere
 * in [0, padded) (a multiple of VW); returns their sum. Written on vectors of VW lanes, where GCC
 * had vectorised the scalar loop at half the register width on AVX-512 Intel builds; vectors wholly
 * outside [a, e) are zeroed without an exponential, and only those across a or e are masked. */
static inline float softmax_row(float *s, int64_t padded, int64_t a, int64_t e, float scale, float m) {
    typedef int32_t vi __attribute__((vector_size(4 * VW)));
    vf sum = {0};
    vi lane;
    for (int i = 0; i < VW; i++) lane[i] = i;
    for (int64_t n = 0; n < padded; n += VW) {
        vf p = {0};
        if (n + VW > a && n < e) {
            vf x;
            memcpy(&x, s + n, sizeof x);
            p = exp_nonpos(x * scale - m);
            if (n < a || n + VW > e) {
                vi at = lane + (int32_t)n;
                p = (vf)((vi)p & ((at >= (int32_t)a) & (at < (int32_t)e)));
            }
            sum += p;
        }
        memcpy(s + n, &p, sizeof p);
    }
    float l = 0.0f;
    for (int i = 0; i < VW; i++) l += sum[i];
    return l;
}

/* scores[0:VW] = q . kf[0:VW] (kf: VW keys of D fp32, contiguous), VW independent chains */
static inline void dot_block(const vf *q, const float *kf, float *scores) {
    vf a[VW] = {0};
    for (int c = 0; c < VD; c++)
        for (int kk = 0; kk < VW; kk++) {
            vf k;
            memcpy(&k, kf + kk * D + c * VW, sizeof k);
            a[kk] = fmadd(q[c], k, a[kk]);
        }
    vf r = sum_lanes(a);
    memcpy(scores, &r, sizeof r);
}

#if VW == 16
/* rows of 16 32-bit lanes: r[i][j] -> r[j][i] */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* q.K of many fp32 queries (prefill), the same bits as dot_block gives each (query, key): its
 * lane l of dims {l, 16 + l, 32 + l, ...} a chain over them in order, then sum_lanes's tree over
 * the lanes (l with l + 8, then with l + 4, l + 2, l + 1). Here the keys lie in lanes instead (kt:
 * a block transposed, [D][NB]), so each lane's chain is a vector of 16 keys' and the tree adds
 * whole vectors: no shuffles, and each loaded vector of keys serves nqt queries (a literal, up to
 * QK_TREE_QUERIES). Adds and multiply-adds go through builtins GCC does not reassociate (this file
 * is built with -fassociative-math). */
#define QK_TREE_QUERIES 4
#define QK_TREE_MIN 24 /* queries in an item from which q.K takes this path */
static inline __attribute__((always_inline)) void lane_pair(const float *q, const float *kt, int l, const int nqt,
                                                          __m512 t[QK_TREE_QUERIES]) {
    __m512 a[QK_TREE_QUERIES], b[QK_TREE_QUERIES];
    for (int c = 0; c < VD; c++) {
        const __m512 k0 = _mm512_load_ps(kt + (c * 16 + l) * NB), k1 = _mm512_load_ps(kt + (c * 16 + l + 8) * NB);
        for (int r = 0; r < nqt; r++) {
            const __m512 q0 = _mm512_set1_ps(q[r * D + c * 16 + l]), q1 = _mm512_set1_ps(q[r * D + c * 16 + l + 8]);
            a[r] = c ? _mm512_fmadd_ps(q0, k0, a[r]) : _mm512_mul_ps(q0, k0);
            b[r] = c ? _mm512_fmadd_ps(q1, k1, b[r]) : _mm512_mul_ps(q1, k1);
        }
    }
    for (int r = 0; r < nqt; r++) t[r] = _mm512_add_round_ps(a[r], b[r], _MM_FROUND_CUR_DIRECTION);
}

static inline __attribute__((always_inline)) void qk_tree(const float *q, const int nqt, const float *kt, int64_t keys,
                                                        float *s, int64_t ps) {
#define ADD(x, y) _mm512_add_round_ps(x, y, _MM_FROUND_CUR_DIRECTION)
    for (int64_t g = 0; g < keys; g += 16) {
        const float *k = kt + g;
        __m512 x[QK_TREE_QUERIES], y[QK_TREE_QUERIES], u[QK_TREE_QUERIES], v[QK_TREE_QUERIES];
        lane_pair(q, k, 0, nqt, x);
        lane_pair(q, k, 4, nqt, y);
        for (int r = 0; r < nqt; r++) u[r] = ADD(x[r], y[r]);
        lane_pair(q, k, 2, nqt, x);
        lane_pair(q, k, 6, nqt, y);
        for (int r = 0; r < nqt; r++) u[r] = ADD(u[r], ADD(x[r], y[r]));
        lane_pair(q, k, 1, nqt, x);
        lane_pair(q, k, 5, nqt, y);
        for (int r = 0; r < nqt; r++) v[r] = ADD(x[r], y[r]);
        lane_pair(q, k, 3, nqt, x);
        lane_pair(q, k, 7, nqt, y);
        for (int r = 0; r < nqt; r++) {
            v[r] = ADD(v[r], ADD(x[r], y[r]));
            _mm512_storeu_ps(s + r * ps + g, ADD(u[r], v[r]));
        }
    }
#undef ADD
}
#endif

#if DPBF16
/* q.K from bf16 queries and keys. Every score follows one chain, whatever shares the call:
 * acc = 0, then for each pair of dims p in order, acc = vdpbf16ps(acc, q pair p, k pair p) (two
 * exact bf16 products added to fp32). The lanes hold either 16 queries (qk_queries: an item of
 * many rows) or 16 keys (qk_keys: a few rows); the instruction treats its two sources alike,
 * so both give a score the same bits, and a row's result does not depend on the other rows of
 * its item or step. */

/* out[p][0:16] = the 16 rows' bf16 pair p (rows past n: zeros) */
static inline void pairs_transposed(const uint16_t *const *row, int n, uint32_t out[D / 2][16]) {
    for (int h = 0; h < D / 32; h++) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = i < n ? _mm512_loadu_si512(row[i] + h * 32) : _mm512_setzero_si512();
        transpose16(r);
        for (int pp = 0; pp < 16; pp++) _mm512_store_si512(out[h * 16 + pp], r[pp]);
    }
}

/* s[m * ps + 0:16] = query m . keys k[0:16] (rows D apart), for m < nq <= 16 queries given as
 * their pairs in lanes (qt, from pairs_transposed) */
static inline void qk_queries(const uint32_t qt[D / 2][16], const uint16_t *k, int nq, float *s, int64_t ps) {
    __m512 acc[16];
    for (int kk = 0; kk < 16; kk++) acc[kk] = _mm512_setzero_ps();
    const uint32_t *kp = (const uint32_t *)k;
    for (int p = 0; p < D / 2; p++) {
        __m512bh qp = (__m512bh)_mm512_load_si512(qt[p]);
        for (int kk = 0; kk < 16; kk++)
            acc[kk] = _mm512_dpbf16_ps(acc[kk], qp, (__m512bh)_mm512_set1_epi32((int)kp[kk * (D / 2) + p]));
    }
    __m512i r[16];
    for (int kk = 0; kk < 16; kk++) r[kk] = _mm512_castps_si512(acc[kk]);
    transpose16(r); /* r[m]: query m's 16 scores */
    for (int m = 0; m < nq; m++) _mm512_storeu_si512(s + m * ps, r[m]);
}

/* the same for nq <= KEYS_IN_LANES queries given by their rows: the 16 keys' pairs in lanes
 * instead. nq is a literal at each call (qk_keys_for), so the query loop unrolls into registers
 * with no test a step: with nq a variable a decode step's attention was measurably slower
 * (docs/benchmarks.md, which also gives two things tried and dropped: two runs of 16 keys a call,
 * to interleave their chains, and the transposed keys kept in registers instead of stored). */
static inline __attribute__((always_inline)) void qk_keys(const uint16_t *const *qrow, const int nq, const uint16_t *k,
                                                          float *s, int64_t ps) {
    uint32_t kt[D / 2][16] __attribute__((aligned(64)));
    const uint16_t *krow[16];
    for (int kk = 0; kk < 16; kk++) krow[kk] = k + kk * D;
    pairs_transposed(krow, 16, kt);
    __m512 acc[KEYS_IN_LANES];
    for (int m = 0; m < nq; m++) acc[m] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        __m512bh kv = (__m512bh)_mm512_load_si512(kt[p]);
        for (int m = 0; m < nq; m++)
            acc[m] = _mm512_dpbf16_ps(acc[m], kv, (__m512bh)_mm512_set1_epi32(((const int *)qrow[m])[p]));
    }
    for (int m = 0; m < nq; m++) _mm512_storeu_ps(s + m * ps, acc[m]);
}

/* qk_keys with nq (1 to KEYS_IN_LANES) as a literal */
static void qk_keys_for(const uint16_t *const *qrow, int nq, const uint16_t *k, float *s, int64_t ps) {
#define QK_KEYS(q) case q: qk_keys(qrow, q, k, s, ps); break;
    switch (nq) {
        QK_KEYS(1) QK_KEYS(2) QK_KEYS(3) QK_KEYS(4) QK_KEYS(5) QK_KEYS(6) QK_KEYS(7) QK_KEYS(8)
        QK_KEYS(9) QK_KEYS(10) QK_KEYS(11) QK_KEYS(12)
    }
#undef QK_KEYS
}
#endif

/* Where rows [from, from + n) of a buffer are read: the shared prefix entry's copy (`entry`,
 * holding `shared` rows) when they all lie inside it, else the sequence's own (`own`). */
static inline const char *rows_at(const char *own, const char *entry, int64_t shared, int64_t from, int64_t n,
                                  int64_t row_bytes) {
    return (entry && from + n <= shared ? entry : own) + from * row_bytes;
}

#if DPBF16
/* Ask for the first PREFETCH_KEYS rows (of row_bytes) of an item's span [lo, lo + span) into L2,
 * from wherever rows_at reads them. q.K requests its keys PREFETCH_KEYS ahead of itself, so
 * without this an item's first keys arrive one demand miss at a time (the same for the values
 * before P.V measured no gain: docs/benchmarks.md). */
static inline void prefetch_first(const char *own, const char *entry, int64_t shared, int64_t lo, int64_t span,
                                  int64_t row_bytes) {
    const int64_t first = span < PREFETCH_KEYS ? span : PREFETCH_KEYS;
    const char *at = rows_at(own, entry, shared, lo, first, row_bytes);
    for (int64_t l = 0; l < first * row_bytes; l += 64) __builtin_prefetch(at + l, 0, 2);
}

/* While 16 bf16 keys from row `at` are read: ask for the keys PREFETCH_KEYS ahead (into L1) and for
 * the values of these keys (into L2, for P.V), from wherever rows_at reads them. */
static inline void prefetch_bf16_run(const char *keys, const char *skeys, const char *values, const char *svalues,
                                     int64_t shared, int64_t at) {
    const char *ahead = rows_at(keys, skeys, shared, at + PREFETCH_KEYS, 16, 2 * D);
    for (int l = 0; l < 16 * D * 2; l += 64) __builtin_prefetch(ahead + l, 0, 3);
#if AMX
    const char *vals = rows_at(values, svalues, shared, at, 16, 2 * DV);
    for (int l = 0; l < 16 * DV * 2; l += 64) __builtin_prefetch(vals + l, 0, 2);
#else
    (void)values, (void)svalues;
#endif
}

#if AMX
/* The tile's 16 x 16 scores, stored [key][query], written to the first `nq` query rows of
 * `scores` (row stride `stride` floats) as [query][key]: a transpose in registers (two rounds of
 * unpacks, two of 128-bit lane shuffles). A scalar copy of each column read the tile's memory
 * 256 times a block, ~13% of a prefill chunk's attention. Moves bits only. */
static inline void store_transposed(const float c16[16][16], float *scores, int64_t stride, int64_t nq) {
    __m512 r[16], t[16], u[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(c16[i]);
    for (int i = 0; i < 16; i += 2) { /* per 128-bit lane L: t[i] keys i, i+1 at queries 4L, 4L+1 */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]); /* ... at queries 4L+2, 4L+3 */
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + c], lane L: keys g..g+3 at query 4L + c */
        __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 2]);
        __m512d c = _mm512_castps_pd(t[g + 1]), d = _mm512_castps_pd(t[g + 3]);
        u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int c = 0; c < 4; c++) { /* query 4L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c] */
        __m512 lo01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), hi01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
        __m512 lo23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
        __m512 hi23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
        __m512 col[4] = {_mm512_shuffle_f32x4(lo01, lo23, 0x88), _mm512_shuffle_f32x4(lo01, lo23, 0xDD),
                         _mm512_shuffle_f32x4(hi01, hi23, 0x88), _mm512_shuffle_f32x4(hi01, hi23, 0xDD)};
        for (int L = 0; L < 4; L++)
            if (4 * L + c < nq) _mm512_storeu_ps(scores + (4 * L + c) * stride, col[L]);
    }
}
#endif

/* Keys [b, b + 16) of an item's span (which starts at key `lo`) as 16 rows of D: where rows_at
 * reads them, or, for the last run of fewer, copied into `tail` (16 * D) and padded with zeros.
 * The first pass over the keys (`stream`) prefetches ahead (prefetch_bf16_run). */
static inline const uint16_t *key_run(const char *keys, const char *skeys, const char *values, const char *svalues,
                                      int64_t shared, int64_t lo, int64_t b, int64_t span, int stream,
                                      uint16_t *tail) {
    if (b + 16 <= span) {
        if (stream) prefetch_bf16_run(keys, skeys, values, svalues, shared, lo + b);
        return (const uint16_t *)rows_at(keys, skeys, shared, lo + b, 16, 2 * D);
    }
    memset(tail, 0, sizeof(uint16_t) * 16 * D);
    memcpy(tail, rows_at(keys, skeys, shared, lo + b, span - b, 2 * D), 2 * D * (span - b));
    return tail;
}
#endif

#if DPBF16
/* Two value rows as the pairs vdpbf16ps takes, DV / 16 vectors (r1 NULL: the odd key out, paired
 * with zeros): each lane (value[r0][d], value[r1][d]). For each 32 dims, unpacklo/hi interleave
 * within 128-bit lanes, so vector 2h holds dims 32h + {0-3, 8-11, 16-19, 24-27} and 2h + 1 the
 * other 16 (store_in_dim_order puts sums over them back in order); a last 16 dims (DV % 32) are
 * paired by widening, in order. */
static inline __attribute__((always_inline)) void value_pairs(const uint16_t *r0, const uint16_t *r1,
                                                              __m512i x[DV / 16]) {
    for (int h = 0; h < DV / 32; h++) {
        __m512i v0 = _mm512_loadu_si512(r0 + h * 32);
        __m512i v1 = r1 ? _mm512_loadu_si512(r1 + h * 32) : _mm512_setzero_si512();
        x[2 * h] = _mm512_unpacklo_epi16(v0, v1);
        x[2 * h + 1] = _mm512_unpackhi_epi16(v0, v1);
    }
#if DV % 32
    __m512i w0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r0 + DV - 16)));
    __m512i w1 = r1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r1 + DV - 16)))
                    : _mm512_setzero_si512();
    x[DV / 16 - 1] = _mm512_or_si512(w0, _mm512_slli_epi32(w1, 16));
#endif
}

/* o[0:32] = the sums `lo`, `hi` over vectors 2h, 2h + 1 of value_pairs, in dim order */
static inline void store_in_dim_order(float *o, __m512 lo, __m512 hi) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, second, hi));
}

/* queries per pass of pv_bf16: QG x DV / 16 accumulators, with a key pair's DV / 16 vectors and a
 * broadcast probability pair, stay in the 32 registers */
#define QG (DV <= 32 ? 8 : DV <= 64 ? 6 : DV <= 96 ? 4 : 3)
/* acc[m][0:DV] = sum over keys n < span of pb[m][n] * value[lo + n], for m < nq (<= QG) queries of
 * bf16 probabilities pb (rows `ps` apart, zero past the span up to an even count), values bf16
 * read where rows_at says: vdpbf16ps on two keys at a time, each lane the pair (value[n][d],
 * value[n + 1][d]) against (pb[n], pb[n + 1]). The probabilities are rounded to bf16 as the GPU
 * kernel's P.V rounds them (kernels/attention.py); the products are exact and summed in fp32. The
 * pairs come from interleaving two value rows (unpacklo/hi: 32 dims give two vectors whose lanes
 * hold dims 8j + 0..3 and 8j + 4..7), so the accumulators are put back in dim order once at the
 * end; a last 16 dims (DV % 32) are paired by widening, in order. One chain per dim, key pairs in
 * order, so a query's sums do not depend on the other queries of the pass. `stream`: the item's
 * first pass over these values (which prefetches ahead, see PREFETCH_VALUES). */
static inline __attribute__((always_inline)) void pv_bf16(const char *values, const char *svalues, int64_t shared,
                                                          int64_t lo, int64_t span, const uint16_t *pb, int64_t ps,
                                                          const int nq, float *acc, int stream) {
    __m512 a[QG][DV / 16];
    for (int m = 0; m < QG; m++)
        for (int c = 0; c < DV / 16; c++) a[m][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < span; b += 16) {
        int64_t nb = span - b < 16 ? span - b : 16;
        const uint16_t *vb = (const uint16_t *)rows_at(values, svalues, shared, lo + b, nb, 2 * DV);
#if !AMX
        if (stream && b + PREFETCH_VALUES + 16 <= span) {
            const char *ahead = rows_at(values, svalues, shared, lo + b + PREFETCH_VALUES, 16, 2 * DV);
            for (int l = 0; l < 16 * DV * 2; l += 64) __builtin_prefetch(ahead + l, 0, 3);
        }
#else
        (void)stream;
#endif
        for (int64_t n = 0; n < nb; n += 2) {
            const uint16_t *r0 = vb + n * DV;
            __m512i x[DV / 16]; /* the odd key out pairs with zeros (never read past the span) */
            value_pairs(r0, n + 1 < nb ? r0 + DV : NULL, x);
            for (int m = 0; m < QG; m++) {
                if (m >= nq) break;
                int32_t pair;
                memcpy(&pair, pb + m * ps + b + n, 4);
                __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
                for (int c = 0; c < DV / 16; c++) a[m][c] = _mm512_dpbf16_ps(a[m][c], pp, (__m512bh)x[c]);
            }
        }
    }
    for (int64_t m = 0; m < nq; m++) {
        for (int h = 0; h < DV / 32; h++) store_in_dim_order(acc + m * DV + h * 32, a[m][2 * h], a[m][2 * h + 1]);
#if DV % 32
        _mm512_storeu_ps(acc + m * DV + DV - 16, a[m][DV / 16 - 1]);
#endif
    }
}

#if AMX && PV_TILES && DV % 16 == 0
#define AMX_PV 1
/* P.V on the matrix units, for every item of an AMX build (whatever its size: a query's sums must
 * not depend on the rows beside it, and the tiles' fp32 sums are not vdpbf16ps's bits, so the two
 * never mix). The values of the item's span are laid out once as B tiles (`vt`: for each 32 keys
 * and 16 dims, 16 rows of (value[2r][d], value[2r + 1][d]) pairs, keys past the span zero; the
 * dims in value_pairs's order, put back in order when C is stored); then
 * for each 16 queries, A = their bf16 probabilities (pb, rows `ps` apart, readable for a whole 16
 * rows, zero past the span up to a multiple of 32), C = up to 64 dims of their sums (tiles 0, 3,
 * 4, 5), B alternating in tiles 2 and 6, A in 1. Each output is an fp32 sum of exact products of
 * its own query's probabilities; a query's result does not depend on the others of its tile.
 * A prefill chunk's P.V, ~half of its attention with vdpbf16ps (192 queries an item), takes a
 * fraction of that here; a decode item (3 queries) about what pv_bf16 takes. */
static void pv_tiles(const char *values, const char *svalues, int64_t shared, int64_t lo, int64_t span,
                     const uint16_t *pb, int64_t ps, int64_t nq, float *acc, uint32_t *vt) {
    const int64_t blocks = (span + 31) / 32;
    for (int64_t blk = 0; blk < blocks; blk++)
        for (int r = 0; r < 16; r++) {
            int64_t n0 = blk * 32 + 2 * r, run = n0 / 16 * 16; /* runs of 16 keys read as pv_bf16 reads them */
            const uint16_t *vb = (const uint16_t *)rows_at(values, svalues, shared, lo + run,
                                                           span - run < 16 ? span - run : 16, 2 * DV);
            const uint16_t *r0 = n0 < span ? vb + (n0 - run) * DV : NULL;
            const uint16_t *r1 = n0 + 1 < span ? vb + (n0 + 1 - run) * DV : NULL;
            uint32_t *row = vt + (blk * (DV / 16) * 16 + r) * 16; /* row r of the block's first B tile */
            __m512i x[DV / 16];
            if (r0)
                value_pairs(r0, r1, x);
            else /* keys past the span */
                for (int c = 0; c < DV / 16; c++) x[c] = _mm512_setzero_si512();
            for (int c = 0; c < DV / 16; c++) _mm512_store_si512(row + c * 256, x[c]);
        }
    float part[4][16][16] __attribute__((aligned(64))); /* a group's C tiles: [tile][query][column] */
    for (int64_t q0 = 0; q0 < nq; q0 += 16) {
        const int64_t rows = nq - q0 < 16 ? nq - q0 : 16;
        for (int c0 = 0; c0 < DV / 16; c0 += 4) {
            const int nc = DV / 16 - c0 < 4 ? DV / 16 - c0 : 4;
            _tile_zero(0);
            if (nc > 1) _tile_zero(3);
            if (nc > 2) _tile_zero(4);
            if (nc > 3) _tile_zero(5);
            for (int64_t blk = 0; blk < blocks; blk++) {
                const uint32_t *b = vt + (blk * (DV / 16) + c0) * 256;
                _tile_loadd(1, pb + q0 * ps + blk * 32, 2 * ps);
                _tile_loadd(2, b, 64);
                _tile_dpbf16ps(0, 1, 2);
                if (nc > 1) { _tile_loadd(6, b + 256, 64); _tile_dpbf16ps(3, 1, 6); }
                if (nc > 2) { _tile_loadd(2, b + 512, 64); _tile_dpbf16ps(4, 1, 2); }
                if (nc > 3) { _tile_loadd(6, b + 768, 64); _tile_dpbf16ps(5, 1, 6); }
            }
            _tile_stored(0, part[0], 64);
            if (nc > 1) _tile_stored(3, part[1], 64);
            if (nc > 2) _tile_stored(4, part[2], 64);
            if (nc > 3) _tile_stored(5, part[3], 64);
            for (int64_t m = 0; m < rows; m++) {
                float *o = acc + (q0 + m) * DV + c0 * 16;
                int c = 0;
                for (; c + 1 < nc && c0 + c + 1 < DV / 32 * 2; c += 2)
                    store_in_dim_order(o + 16 * c, _mm512_load_ps(part[c][m]), _mm512_load_ps(part[c + 1][m]));
                if (c < nc) memcpy(o + 16 * c, part[c][m], 64); /* the widened last 16 dims */
            }
        }
    }
}
#endif

/* pb[0:n] = x[0:n] rounded to bf16 (to nearest even), n a multiple of 32 */
static inline void to_bf16(const float *x, uint16_t *pb, int64_t n) {
    for (int64_t i = 0; i < n; i += 32)
        _mm512_storeu_si512(pb + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i)));
}
#endif

/* Where sequence j's KV for kv head g lies, and its row counts, from the table */
struct item_kv {
    char *keys, *values;               /* this head's [capacity, dim] buffers */
    int64_t start, rows, past, cap;
};
static inline struct item_kv item_kv(const int64_t *table, int64_t num_seqs, int64_t layers, int64_t layer, int64_t j,
                                     int g, int64_t es) {
    const int64_t *meta = table + 2 * layers * num_seqs;
    struct item_kv it = {(char *)(intptr_t)table[layer * num_seqs + j],
                         (char *)(intptr_t)table[(layers + layer) * num_seqs + j],
                         meta[j], meta[num_seqs + j], meta[2 * num_seqs + j], meta[3 * num_seqs + j]};
    it.keys += (int64_t)g * it.cap * D * es;
    it.values += (int64_t)g * it.cap * DV * es;
    return it;
}

/* Append sequence j's new keys and values for kv head g to its buffers. */
static void append_item(int kv_bf16, int64_t j, int g, int64_t num_seqs, const int64_t *table, int64_t layers,
                        int64_t layer, const void *k, int64_t k_st, int64_t k_sh, const void *v, int64_t v_st,
                        int64_t v_sh, int in_bf16) {
    struct item_kv it = item_kv(table, num_seqs, layers, layer, j, g, kv_bf16 ? 2 : 4);
    for (int64_t i = 0; i < it.rows; i++) {
        int64_t at = it.past + i, src = it.start + i;
        if (kv_bf16) {
            memcpy(it.keys + at * D * 2, (const uint16_t *)k + src * k_st + g * k_sh, 2 * D);
            memcpy(it.values + at * DV * 2, (const uint16_t *)v + src * v_st + g * v_sh, 2 * DV);
        } else {
            load_row(k, in_bf16, src * k_st + g * k_sh, (float *)it.keys + at * D, D);
            load_row(v, in_bf16, src * v_st + g * v_sh, (float *)it.values + at * DV, DV);
        }
    }
}

/* Rows per work item: a longer segment (a prefill chunk) is split into blocks of this many rows,
 * each its own item, so that one long chunk keeps every thread busy. */
/* P.V over one block of nb values (fp32, rows of DV) for nqb queries (a literal: the loops
 * unroll), each query's probabilities p + r * padded and sums acc + r * DV (zero when `first`).
 * Every loaded vector of values meets all nqb queries; each query's sums follow the same chains
 * as alone (even keys into the running sum, odd keys into a second chain from zero, added at the
 * block's end), so the same bits for any nqb. `ahead`: the rows PREFETCH_VALUES_F32 past the
 * block's first, requested as the pairs are read (or NULL). */
#define PV_QUERIES (VW != 16 ? 1 : PV_VECS <= 2 ? 6 : PV_VECS <= 4 ? 3 : 1) /* 2 x PV_VECS x this: at most 24 */
static inline __attribute__((always_inline)) void pv_f32(const float *vals, const float *p, int64_t padded, int64_t nb,
                                                         float *acc, int first, const int nqb, const char *ahead) {
    for (int h = 0; h < VDV; h += PV_VECS) { /* PV_VECS vectors of dims at a time */
        vf a0[PV_QUERIES][PV_VECS], a1[PV_QUERIES][PV_VECS];
        for (int r = 0; r < nqb; r++)
            for (int c = 0; c < PV_VECS; c++) {
                a1[r][c] = (vf){0};
                if (first) a0[r][c] = (vf){0}; else memcpy(&a0[r][c], acc + r * DV + (h + c) * VW, sizeof(vf));
            }
        const float *vh = vals + h * VW;
        int64_t n = 0;
        for (; n + 1 < nb; n += 2) {
            if (ahead && h == 0)
                for (int l = 0; l < 2 * DV * 4; l += 64) __builtin_prefetch(ahead + n * DV * 4 + l, 0, 3);
            for (int c = 0; c < PV_VECS; c++) {
                vf x0, x1;
                memcpy(&x0, vh + n * DV + c * VW, sizeof x0);
                memcpy(&x1, vh + (n + 1) * DV + c * VW, sizeof x1);
                for (int r = 0; r < nqb; r++) {
                    a0[r][c] = fmadd((vf){0} + p[r * padded + n], x0, a0[r][c]);
                    a1[r][c] = fmadd((vf){0} + p[r * padded + n + 1], x1, a1[r][c]);
                }
            }
        }
        for (; n < nb; n++)
            for (int c = 0; c < PV_VECS; c++) {
                vf x0;
                memcpy(&x0, vh + n * DV + c * VW, sizeof x0);
                for (int r = 0; r < nqb; r++) a0[r][c] = fmadd((vf){0} + p[r * padded + n], x0, a0[r][c]);
            }
        for (int r = 0; r < nqb; r++)
            for (int c = 0; c < PV_VECS; c++) {
                a0[r][c] += a1[r][c];
                memcpy(acc + r * DV + (h + c) * VW, &a0[r][c], sizeof(vf));
            }
    }
}

#define ROW_BLOCK 64

#ifndef AMX_PV
#define AMX_PV 0 /* P.V with vdpbf16ps (pv_bf16) or in fp32 */
#endif

/* One work item: rows [r0, r1) of sequence j for kv head g (their keys and values already
 * appended); KV buffers of bf16 (kv_bf16) or fp32. Always inlined, and called with a literal
 * kv_bf16, so that each case's loops are specialised. */
static inline __attribute__((always_inline)) void attend_item(
        const int kv_bf16, int64_t j, int g, int64_t r0, int64_t r1, int64_t num_seqs, const int64_t *table,
        int64_t layers, int64_t layer, const void *q, int64_t q_st, int64_t q_sh, int in_bf16, float *out,
        int64_t o_st, int64_t o_sh, int group, float scale, int64_t window, int with_shared, int amx) {
    const int64_t es = kv_bf16 ? 2 : 4; /* bytes per stored element */
    struct item_kv it = item_kv(table, num_seqs, layers, layer, j, g, es);
    char *keys = it.keys, *values = it.values;
    int64_t start = it.start, rows = it.rows, past = it.past;
    if (rows <= 0) return;
    const char *skeys = NULL, *svalues = NULL; /* the shared prefix entry's rows of this head, if any */
    int64_t shared = 0;
    if (with_shared) {
        const int64_t *sh = table + (2 * layers + 4) * num_seqs;
        shared = sh[(2 * layers) * num_seqs + j];
        int64_t scap = sh[(2 * layers + 1) * num_seqs + j];
        if (shared > 0) {
            skeys = (const char *)(intptr_t)sh[layer * num_seqs + j] + (int64_t)g * scap * D * es;
            svalues = (const char *)(intptr_t)sh[(layers + layer) * num_seqs + j] + (int64_t)g * scap * DV * es;
        }
    }
    if (r1 > rows) r1 = rows;
    if (r0 >= r1) return;
    /* rows [r0, r1): attended as a sequence of r1 - r0 rows whose past holds r0 more tokens */
    start += r0;
    past += r0;
    rows = r1 - r0;
    int64_t end = past + rows;
    int64_t nq = (int64_t)group * rows; /* query index qi = head_in_group * rows + row */
    int64_t lo = 0;                     /* the first key any row of the item sees */
    if (window > 0 && past - window + 1 > 0) lo = past - window + 1;
    int64_t span = end - lo, padded = (span + NB - 1) / NB * NB;
    /* queries [nq][D], scores [nq][padded], sums [nq][DV], 1/l [nq], a block of keys or values,
     * and for bf16 KV the probabilities in bf16: one allocation an item */
    int64_t block_at = (nq * D + nq * padded + nq * DV + nq + 15) / 16 * 16; /* 64-byte aligned, as qs */
    int64_t pb_at = block_at + NB * (D > DV ? D : DV); /* a multiple of 16 floats too (D, DV: of 8) */
    /* with P.V on the tiles, pb holds whole tiles of 16 queries (the rows past nq are read, not used),
     * then the values laid out as B tiles (pv_tiles: 32 keys x DV pairs-of-bf16 a block) */
    int64_t pb_rows = AMX_PV && amx ? (nq + 15) / 16 * 16 : nq;
    int64_t pb_floats = DPBF16 && kv_bf16 ? (pb_rows * padded / 2 + 15) / 16 * 16 : 0;
    int64_t vt_floats = AMX_PV && amx && kv_bf16 ? (span + 31) / 32 * 16 * DV : 0;
    float *qs = aligned_alloc(64, sizeof(float) * (pb_at + pb_floats + vt_floats));
    float *scores = qs + nq * D, *acc = scores + nq * padded, *inv = acc + nq * DV;
    float *block = qs + block_at; /* aligned: its vector loads never straddle a cache line */
#if DPBF16
    uint16_t *pb = (uint16_t *)(qs + pb_at); /* the probabilities in bf16 [nq][padded], for pv_bf16 */
#endif
    const int direct = DPBF16 && kv_bf16 && in_bf16; /* q.K from bf16 queries and keys as they are */
#if DPBF16 && !AMX
    if (direct) /* the keys q.K reads first: its own requests run PREFETCH_KEYS ahead of it */
        prefetch_first(keys, skeys, shared, lo, span, 2 * D);
#endif
    if (!direct) /* else the queries are read as bf16 below, and qs is not used */
        for (int hl = 0; hl < group; hl++)
            for (int64_t i = 0; i < rows; i++)
                load_row(q, in_bf16, (start + i) * q_st + ((int64_t)g * group + hl) * q_sh, qs + (hl * rows + i) * D,
                         D);
#if VW == 16
    float kt[D * NB] __attribute__((aligned(64))); /* a block of fp32 keys transposed, for qk_tree */
#endif
#if AMX
    if (direct && amx) {
        uint16_t tail[16 * D] __attribute__((aligned(64)));
        uint32_t qt[4][16][16] __attribute__((aligned(64))); /* [32-dim chunk][dim pair][query] */
        float c16[16][16] __attribute__((aligned(64)));     /* [key][query] */
        for (int64_t q0 = 0; q0 < nq; q0 += 16) {
            int64_t nqt = nq - q0 < 16 ? nq - q0 : 16;
            const uint16_t *qrow[16];
            for (int64_t m = 0; m < nqt; m++) {
                int64_t qi = q0 + m;
                qrow[m] = (const uint16_t *)q + (start + qi % rows) * q_st + ((int64_t)g * group + qi / rows) * q_sh;
            }
            pairs_transposed(qrow, (int)nqt, (uint32_t (*)[16])qt); /* rows past nqt: zeros */
            _tile_loadd(3, qt[0], 64);
#if D > 32
            _tile_loadd(4, qt[1], 64);
#endif
#if D > 64
            _tile_loadd(5, qt[2], 64);
#endif
#if D > 96
            _tile_loadd(6, qt[3], 64);
#endif
            for (int64_t b = 0; b < span; b += 16) {
                const uint16_t *kb = key_run(keys, skeys, values, svalues, shared, lo, b, span, q0 == 0, tail);
                _tile_zero(0);
                _tile_loadd(1, kb, 2 * D);
                _tile_dpbf16ps(0, 1, 3);
#if D > 32
                _tile_loadd(2, kb + 32, 2 * D);
                _tile_dpbf16ps(0, 2, 4);
#endif
#if D > 64
                _tile_loadd(1, kb + 64, 2 * D);
                _tile_dpbf16ps(0, 1, 5);
#endif
#if D > 96
                _tile_loadd(2, kb + 96, 2 * D);
                _tile_dpbf16ps(0, 2, 6);
#endif
                _tile_stored(0, c16, 64);
                store_transposed((const float (*)[16])c16, scores + q0 * padded + b, padded, nqt);
            }
            for (int64_t m = 0; m < nqt; m++) { /* the block's rest past the last 16: zeros, as below */
                int64_t done = (span + 15) / 16 * 16;
                memset(scores + (q0 + m) * padded + done, 0, sizeof(float) * (padded - done));
            }
        }
    } else
#endif
#if DPBF16
    if (direct) { /* no conversion pass: up to 16 queries at a time (see qk_queries, qk_keys) */
        uint16_t tail[16 * D] __attribute__((aligned(64)));
        uint32_t qt[D / 2][16] __attribute__((aligned(64)));
        const uint16_t *qrow[16];
        int64_t done = (span + 15) / 16 * 16;
        for (int64_t q0 = 0; q0 < nq; q0 += 16) {
            int nqt = nq - q0 < 16 ? (int)(nq - q0) : 16;
            for (int m = 0; m < nqt; m++) {
                int64_t qi = q0 + m;
                qrow[m] = (const uint16_t *)q + (start + qi % rows) * q_st + ((int64_t)g * group + qi / rows) * q_sh;
            }
            if (nqt > KEYS_IN_LANES) pairs_transposed(qrow, nqt, qt);
            float *s = scores + q0 * padded;
            for (int64_t b = 0; b < span; b += 16) {
                const uint16_t *kb = key_run(keys, skeys, values, svalues, shared, lo, b, span, q0 == 0, tail);
                if (nqt > KEYS_IN_LANES)
                    qk_queries(qt, kb, nqt, s + b, padded);
                else
                    qk_keys_for(qrow, nqt, kb, s + b, padded);
            }
            for (int m = 0; m < nqt; m++) /* the block's rest: zeros, as below */
                memset(s + m * padded + done, 0, sizeof(float) * (padded - done));
        }
    } else
#endif
    for (int64_t b = 0; b < span; b += NB) { /* q.K: each block of keys once, for every query */
        int64_t nb = span - b < NB ? span - b : NB;
        const char *ahead = rows_at(keys, skeys, shared, lo + b + PREFETCH_KEYS, NB, D * es);
        const char *vals = rows_at(values, svalues, shared, lo + b, nb, DV * es);
        if (kv_bf16 || PREFETCH_KEYS_F32)
            for (int64_t l = 0; l < NB * D * es; l += 64) __builtin_prefetch(ahead + l, 0, 3);
        if (kv_bf16) /* converted to fp32 below before P.V; fp32 values are prefetched by P.V itself */
            for (int64_t l = 0; l < NB * DV * es; l += 64) __builtin_prefetch(vals + l, 0, 2);
        const char *kb = rows_at(keys, skeys, shared, lo + b, nb, D * es);
        const float *kf = block; /* fp32 keys of a whole block are read where they are */
        if (kv_bf16) {
            for (int64_t e = 0; e < nb * D; e++) block[e] = bf16_to_f32(((const uint16_t *)kb)[e]);
        } else if (nb == NB) {
            kf = (const float *)kb;
        } else {
            memcpy(block, kb, sizeof(float) * nb * D);
        }
        if (kf == block) memset(block + nb * D, 0, sizeof(float) * (NB - nb) * D);
#if VW == 16
        if (nq >= QK_TREE_MIN) {
            for (int64_t g = 0; g < nb; g += 16) /* kt[d][key] = kf[key][d], 16 x 16 at a time */
                for (int c = 0; c < VD; c++) {
                    __m512i r[16];
                    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(kf + (g + i) * D + c * 16);
                    transpose16(r);
                    for (int i = 0; i < 16; i++) _mm512_store_si512(kt + (c * 16 + i) * NB + g, r[i]);
                }
            for (int64_t q0 = 0; q0 < nq; q0 += QK_TREE_QUERIES) {
                const float *qq = qs + q0 * D;
                float *sq = scores + q0 * padded + b;
                switch (nq - q0 < QK_TREE_QUERIES ? nq - q0 : QK_TREE_QUERIES) {
                case 1: qk_tree(qq, 1, kt, nb, sq, padded); break;
                case 2: qk_tree(qq, 2, kt, nb, sq, padded); break;
                case 3: qk_tree(qq, 3, kt, nb, sq, padded); break;
                default: qk_tree(qq, 4, kt, nb, sq, padded); break;
                }
            }
            continue;
        }
#endif
        for (int64_t qi = 0; qi < nq; qi++) {
            vf qv[VD];
            memcpy(qv, qs + qi * D, sizeof qv);
            for (int64_t kk = 0; kk < nb; kk += VW) dot_block(qv, kf + kk * D, scores + qi * padded + b + kk);
        }
    }
    for (int64_t qi = 0; qi < nq; qi++) { /* softmax over each row's visible keys [first, pos] */
        int64_t pos = past + qi % rows;
        int64_t first = (window > 0 && pos - window + 1 > lo) ? pos - window + 1 : lo;
        float *s = scores + qi * padded;
        float m = row_max(s + (first - lo), pos - first + 1) * scale;
        inv[qi] = 1.0f / softmax_row(s, padded, first - lo, pos - lo + 1, scale, m);
#if DPBF16
        if (kv_bf16) to_bf16(s, pb + qi * padded, padded);
#endif
    }
#if DPBF16
#if AMX_PV
    if (kv_bf16 && amx) {
        pv_tiles(values, svalues, shared, lo, span, pb, padded, nq, acc, (uint32_t *)(qs + pb_at + pb_floats));
    } else
#endif
    if (kv_bf16) { /* P.V straight from bf16 values, QG queries at a time (see pv_bf16) */
        for (int64_t q0 = 0; q0 < nq; q0 += QG) {
            const uint16_t *pq = pb + q0 * padded;
            float *aq = acc + q0 * DV;
            switch (nq - q0 < QG ? nq - q0 : QG) { /* a literal count each: the query loop unrolled */
#define PV_CASE(c) case c: pv_bf16(values, svalues, shared, lo, span, pq, padded, c, aq, q0 == 0); break;
            PV_CASE(1) PV_CASE(2) PV_CASE(3)
#if QG > 3
            PV_CASE(4)
#endif
#if QG > 4
            PV_CASE(5) PV_CASE(6)
#endif
#if QG > 6
            PV_CASE(7) PV_CASE(8)
#endif
#undef PV_CASE
            }
        }
    } else
#endif
    for (int64_t b = 0; b < span; b += NB) { /* P.V: each block of values once, for every query */
        int64_t nb = span - b < NB ? span - b : NB;
        const char *vb = rows_at(values, svalues, shared, lo + b, nb, DV * es);
        const float *vf32 = block; /* fp32 values are read where they are */
        if (kv_bf16)
            for (int64_t e = 0; e < nb * DV; e++) block[e] = bf16_to_f32(((const uint16_t *)vb)[e]);
        else
            vf32 = (const float *)vb;
        const char *vnext = kv_bf16 ? NULL : rows_at(values, svalues, shared, lo + b + PREFETCH_VALUES_F32, nb, DV * es);
        for (int64_t q0 = 0; q0 < nq; q0 += PV_QUERIES) {
            const float *p = scores + q0 * padded + b;
            float *aq = acc + q0 * DV;
            const char *ahead = q0 == 0 ? vnext : NULL; /* the first pass over these values requests them */
            switch (nq - q0 < PV_QUERIES ? nq - q0 : PV_QUERIES) { /* a literal count each */
#define PV_F32_CASE(c) case c: pv_f32(vf32, p, padded, nb, aq, b == 0, c, ahead); break;
            PV_F32_CASE(1)
#if PV_QUERIES > 1
            PV_F32_CASE(2) PV_F32_CASE(3)
#endif
#if PV_QUERIES > 3
            PV_F32_CASE(4) PV_F32_CASE(5) PV_F32_CASE(6)
#endif
#undef PV_F32_CASE
            }
        }
    }
    for (int hl = 0; hl < group; hl++)
        for (int64_t i = 0; i < rows; i++) {
            int64_t qi = hl * rows + i;
            float *o = out + (start + i) * o_st + ((int64_t)g * group + hl) * o_sh;
            for (int d = 0; d < DV; d += VW) { /* whole vectors: GCC had made this a loop of 8 lanes */
                vf a;
                memcpy(&a, acc + qi * DV + d, sizeof a);
                a = a * inv[qi];
                memcpy(o + d, &a, sizeof a);
            }
        }
    free(qs);
}

/* Append and attend, for one layer, every sequence in `table` (see the top of the file; with
 * `with_shared`, the table's shared-prefix rows too).
 * q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, DV]: fp32 (in_bf16 = 0) or bf16, strides
 * in elements; KV buffers fp32 (kv_bf16 = 0) or bf16 (only with bf16 inputs); out [T, heads, DV]
 * fp32. window <= 0: no sliding window. */
void structspec_attend(const void *q, int64_t q_st, int64_t q_sh, const void *k, int64_t k_st, int64_t k_sh,
                       const void *v, int64_t v_st, int64_t v_sh, int in_bf16, int kv_bf16, float *out,
                       int64_t o_st, int64_t o_sh, const int64_t *table, int64_t num_seqs, int64_t layers,
                       int64_t layer, int heads, int kv_heads, float scale, int64_t window, int with_shared,
                       int threads) {
    int group = heads / kv_heads;
    int64_t items = num_seqs * kv_heads;
#if AMX
    int amx = kv_bf16 && in_bf16 && amx_usable(); /* q.K on the tiles (the direct bf16 path only) */
#else
    int amx = 0;
#endif
    /* work items: (row block, kv head) of every sequence; blocks[b] = (sequence, first row) */
    int64_t nblocks = 0;
    const int64_t *meta = table + 2 * layers * num_seqs;
    for (int64_t j = 0; j < num_seqs; j++) nblocks += (meta[num_seqs + j] + ROW_BLOCK - 1) / ROW_BLOCK;
    int64_t *blocks = malloc(sizeof(int64_t) * 2 * (nblocks > 0 ? nblocks : 1));
    int64_t b = 0;
    for (int64_t j = 0; j < num_seqs; j++)
        for (int64_t r = 0; r < meta[num_seqs + j]; r += ROW_BLOCK) {
            blocks[2 * b] = j;
            blocks[2 * b + 1] = r;
            b++;
        }
    int64_t work = nblocks * kv_heads;
#pragma omp parallel num_threads(threads) if (threads > 1 && work > 1)
    {
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) /* every new key and value in place before any is read */
            append_item(kv_bf16, it / kv_heads, (int)(it % kv_heads), num_seqs, table, layers, layer, k, k_st, k_sh, v,
                        v_st, v_sh, in_bf16);
#if AMX
        if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < work; u++) {
            /* the last blocks first: a sequence's later row blocks see more keys, and the largest
             * items taken last had left one thread finishing while the other waited */
            const int64_t w = work - 1 - u;
            int64_t j = blocks[2 * (w / kv_heads)], r0 = blocks[2 * (w / kv_heads) + 1];
            int g = (int)(w % kv_heads);
            if (kv_bf16) /* a literal first argument: each call inlines a copy specialised for its KV type */
                attend_item(1, j, g, r0, r0 + ROW_BLOCK, num_seqs, table, layers, layer, q, q_st, q_sh, in_bf16, out,
                            o_st, o_sh, group, scale, window, with_shared, amx);
            else
                attend_item(0, j, g, r0, r0 + ROW_BLOCK, num_seqs, table, layers, layer, q, q_st, q_sh, in_bf16, out,
                            o_st, o_sh, group, scale, window, with_shared, amx);
        }
#if AMX
        if (amx) _tile_release();
#endif
    }
    free(blocks);
}

int structspec_attend_dims(void) { return D * 10000 + DV; }
int structspec_attend_version(void) { return 2; } /* 2: the shared-prefix rows */
int structspec_attend_p_bf16(void) { return DPBF16; } /* 1: P.V of bf16 KV rounds P to bf16 (pv_bf16) */
int structspec_attend_amx(void) { /* 1 when q.K runs on the matrix units (AMX) */
#if AMX
    return amx_usable();
#else
    return 0;
#endif
}
