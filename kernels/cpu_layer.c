/* The elementwise steps of a Llama-shaped decoder layer, fused, for the CPU (bf16 or fp32), and
 * greedy verification's masked argmax over the logits (structspec_masked_argmax, at the end).
 *
 * Eager torch runs each of these as several operators (a residual add, then RMSNorm as a cast,
 * a square, a mean, an rsqrt, two multiplies and a cast back; rotary as two multiplies, a
 * negation, a concatenation and an add; SiLU and a multiply), each a pass over memory and a few
 * microseconds of dispatch. Here each is one pass and one call. The arithmetic follows
 * transformers' Llama code operation by operation, rounding to bf16 where it rounds:
 *
 *   add_rms_norm  x = x + y (rounded to x's dtype); h = w * round(x * rsqrt(mean(x^2) + eps))
 *                 with the normalisation in fp32 (fp32 models: h = x * rstd * w in fp32)
 *   rotary        q' = round(q * cos) + round(rotate_half(q) * sin), rounded, in place
 *   silu_mul      out = round(round(silu(gate)) * up)
 *
 * Rotary and the residual add are bit-identical to eager torch (built with -ffp-contract=off:
 * no product is fused into an add). The RMSNorm mean sums in another order and SiLU's exp is
 * this file's own polynomial (within 2 ulp of expf), so those differ from torch's in the last
 * fp32 bits, and in bf16 by one unit of the last place where a value lies at a rounding
 * boundary. Rows are split over OpenMP threads when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define PARALLEL_MIN_ELEMENTS 65536 /* below this, one thread: a fork costs more than the work */

/* 16 lanes (one AVX-512 register; two AVX2 ones) through gcc's vector extensions */
#define W 16
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint32_t vu __attribute__((vector_size(4 * W)));
typedef uint16_t vh __attribute__((vector_size(2 * W)));

static inline vf bits_f(vu u) { vf f; memcpy(&f, &u, sizeof f); return f; }
static inline vu f_bits(vf f) { vu u; memcpy(&u, &f, sizeof u); return u; }

/* mask ? a : b, lane by lane (mask: a comparison's all-ones or zero lanes) */
static inline vf choose(vi mask, vf a, vf b) { return bits_f((f_bits(a) & (vu)mask) | (f_bits(b) & ~(vu)mask)); }

/* fp32 -> bf16 bits, round to nearest even, as torch's conversion (NaN: a quiet NaN) */
static inline vu bf16_bits(vf f) {
    vu u = f_bits(f);
    vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    vu nan = (vu)(f != f);
    return (r & ~nan) | (nan & 0x7fc0u);
}

/* The same conversion on a CPU with AVX512-BF16: one vcvtneps2bf16 (also nearest even) for
 * vectors where it gives those bits, bf16_bits's seven instructions for the rest: those with a
 * NaN (the instruction keeps its sign and payload; torch's conversion gives 0x7fc0) or an fp32
 * denormal (the instruction reads it as zero). The conversions were a third of a prefill chunk's
 * fused steps (SiLU rounds twice an element, RMSNorm three times). */
static inline vh bf16_half(vf f) {
#if defined(__AVX512BF16__)
    if (!_mm512_fpclass_ps_mask((__m512)f, 0x01 | 0x20 | 0x80)) { /* QNaN, denormal, SNaN */
        __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)f);
        vh r;
        memcpy(&r, &h, sizeof r);
        return r;
    }
#endif
    return __builtin_convertvector(bf16_bits(f), vh);
}

/* Partial vectors (a row's last m < W elements) go through a zeroed copy on the stack, in functions
 * of their own: a variable-size copy makes its buffer live in memory, and when it shared one
 * buffer with the whole-vector path, every full load and store went through the stack too. */
static __attribute__((noinline)) vf load_part(const void *p, int64_t i, int64_t m, int bf16) {
    if (bf16) {
        vh h = {0};
        memcpy(&h, (const uint16_t *)p + i, 2 * m);
        return bits_f(__builtin_convertvector(h, vu) << 16);
    }
    vf f = {0};
    memcpy(&f, (const float *)p + i, 4 * m);
    return f;
}

static __attribute__((noinline)) void store_part(void *p, int64_t i, int64_t m, vf v, int bf16) {
    if (bf16) {
        vh h = bf16_half(v);
        memcpy((uint16_t *)p + i, &h, 2 * m);
    } else {
        memcpy((float *)p + i, &v, 4 * m);
    }
}

/* `m` elements at p (fp32, or bf16 when bf16) as fp32 lanes, the lanes past m zero (m >= W: a
 * whole vector, one unaligned load) */
static inline vf load(const void *p, int64_t i, int64_t m, int bf16) {
    if (m < W)
        return load_part(p, i, m, bf16);
    if (bf16) {
#if defined(__AVX512F__)
        /* one widening load (gcc's convertvector splits it in halves: five instructions) */
        __m256i h = _mm256_loadu_si256((const void *)((const uint16_t *)p + i));
        __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
        vf f;
        memcpy(&f, &u, sizeof f);
        return f;
#else
        vh h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        return bits_f(__builtin_convertvector(h, vu) << 16);
#endif
    }
    vf f;
    memcpy(&f, (const float *)p + i, sizeof f);
    return f;
}

/* the first min(m, W) lanes of v to p, rounded to bf16 when bf16 */
static inline void store(void *p, int64_t i, int64_t m, vf v, int bf16) {
    if (m < W) {
        store_part(p, i, m, v, bf16);
    } else if (bf16) {
        vh h = bf16_half(v);
        memcpy((uint16_t *)p + i, &h, sizeof h);
    } else {
        memcpy((float *)p + i, &v, sizeof v);
    }
}

/* v rounded to the element type (bf16: to the nearest bf16, as an eager bf16 operator's result) */
static inline vf rounded(vf v, int bf16) {
    if (!bf16)
        return v;
#if defined(__AVX512BF16__)
    __m256i h;
    vh half = bf16_half(v);
    memcpy(&h, &half, sizeof h);
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    vf f;
    memcpy(&f, &u, sizeof f);
    return f;
#else
    return bits_f(bf16_bits(v) << 16);
#endif
}

/* e^x for x <= 0: Cody-Waite reduction and a degree-6 polynomial, within 2 ulp of expf; the
 * power of two applied with one rounding (scalef on AVX-512; elsewhere in two halves, the first
 * exact), so results below 2^-126 come out as expf's denormals */
static inline vf exp_nonpos(vf x) {
    x = choose(x < -104.0f, (vf){0} - 104.0f, x); /* e^-104 is below the smallest denormal */
#if defined(__AVX512F__) /* the same bits in fewer instructions: k by roundscale (nearest even, as the
                           * shifter below rounds), p 2^k by scalef (one rounding: p 2^k1 is exact) */
    vf k = (vf)_mm512_roundscale_ps((__m512)(x * 1.44269504088896341f), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    vf k = (x * 1.44269504088896341f + shifter) - shifter;
#endif
    vf r = x - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    vf p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f
           + r * 0.00138888892f)))));
#if defined(__AVX512F__)
    return (vf)_mm512_scalef_ps((__m512)p, (__m512)k);
#else
    vi ki = __builtin_convertvector(k, vi), k1 = ki >> 1, k2 = ki - k1;
    return p * bits_f((vu)((k1 + 127) << 23)) * bits_f((vu)((k2 + 127) << 23));
#endif
}

/* x / (1 + e^-x), without overflow: for x < 0 as x e^x / (1 + e^x) */
static inline vf silu(vf x) {
    vi neg = x < 0.0f;
    vf e = exp_nonpos(choose(neg, x, -x));
    return choose(neg, x * e, x) / (1.0f + e);
}

static inline int parallel(int64_t rows, int64_t width, int threads) {
    return threads > 1 && rows > 1 && rows * width >= PARALLEL_MIN_ELEMENTS;
}

/* The rows' bodies below are always inlined and called with a literal `bf16` inside each
 * parallel loop (OpenMP outlines the loop before constants propagate), so that every load,
 * rounding and store is specialised to its element type. */
#define ROW static inline __attribute__((always_inline)) void

ROW norm_row(char *xr, const char *yr, const void *w, char *hr, int64_t n, float eps, const int bf16) {
    vf sq = {0};
    for (int64_t i = 0; i < n; i += W) {
        vf v = load(xr, i, n - i, bf16);
        if (yr) {
            v = rounded(v + load(yr, i, n - i, bf16), bf16);
            store(xr, i, n - i, v, bf16);
        }
        sq += v * v;
    }
    float sum = 0.0f;
    for (int j = 0; j < W; j++) sum += sq[j];
    float rstd = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i += W) {
        vf v = load(xr, i, n - i, bf16), wv = load(w, i, n - i, bf16);
        /* bf16: round(x * rstd), then times the weight (rounded by store); fp32: x * rstd * w */
        store(hr, i, n - i, bf16 ? wv * rounded(v * rstd, 1) : v * rstd * wv, bf16);
    }
}

/* x [rows, n] (row stride xs) += y [rows, n] (row stride ys; none when y is NULL), then
 * h [rows, n] (row stride hs) = RMSNorm(x) * w. */
void structspec_add_rms_norm(void *x, int64_t xs, const void *y, int64_t ys, const void *w, void *h, int64_t hs,
                             int64_t rows, int64_t n, float eps, int bf16, int threads) {
    int64_t size = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(threads) if (parallel(rows, n, threads))
    for (int64_t t = 0; t < rows; t++) {
        char *xr = (char *)x + t * xs * size, *hr = (char *)h + t * hs * size;
        const char *yr = y ? (const char *)y + t * ys * size : NULL;
        if (bf16)
            norm_row(xr, yr, w, hr, n, eps, 1);
        else
            norm_row(xr, yr, w, hr, n, eps, 0);
    }
}

ROW rotary_row(char *row, int64_t heads, int64_t d, const char *c, const char *s, const int bf16) {
    int64_t half = d / 2, size = bf16 ? 2 : 4;
    for (int64_t hh = 0; hh < heads; hh++) {
        char *q = row + hh * d * size;
        for (int64_t i = 0; i < half; i += W) {
            int64_t m = half - i;
            vf a = load(q, i, m, bf16), b = load(q, half + i, m, bf16);
            /* q * cos + cat(-q[half:], q[:half]) * sin, each product rounded as torch rounds it */
            vf lo = rounded(a * load(c, i, m, bf16), bf16) + rounded(-b * load(s, i, m, bf16), bf16);
            vf hi = rounded(b * load(c, half + i, m, bf16), bf16) + rounded(a * load(s, half + i, m, bf16), bf16);
            store(q, i, m, lo, bf16);
            store(q, half + i, m, hi, bf16);
        }
    }
}

/* Rotary embedding in place on `heads` heads of `d` values each at the start of every row of
 * qk (row stride qs; heads contiguous), with cos and sin [rows, d] (row stride cs). */
void structspec_rotary(void *qk, int64_t qs, int64_t heads, int64_t d, const void *cos, const void *sin,
                       int64_t cs, int64_t rows, int bf16, int threads) {
    int64_t size = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(threads) if (parallel(rows, heads * d, threads))
    for (int64_t t = 0; t < rows; t++) {
        char *row = (char *)qk + t * qs * size;
        const char *c = (const char *)cos + t * cs * size, *s = (const char *)sin + t * cs * size;
        if (bf16)
            rotary_row(row, heads, d, c, s, 1);
        else
            rotary_row(row, heads, d, c, s, 0);
    }
}

ROW silu_row(const char *g, const char *u, char *o, int64_t n, const int bf16) {
    int64_t i = 0;
    for (; i + 4 * W <= n; i += 4 * W) { /* four vectors a pass: four exponentials' chains in flight */
        vf a[4];
        for (int k = 0; k < 4; k++) a[k] = rounded(silu(load(g, i + k * W, W, bf16)), bf16);
        for (int k = 0; k < 4; k++) store(o, i + k * W, W, a[k] * load(u, i + k * W, W, bf16), bf16);
    }
    for (; i < n; i += W) {
        vf act = rounded(silu(load(g, i, n - i, bf16)), bf16);
        store(o, i, n - i, act * load(u, i, n - i, bf16), bf16);
    }
}

/* out [rows, n] (row stride os) = silu(gu[:, :n]) * gu[:, n:2n] (gu's row stride gs). */
void structspec_silu_mul(const void *gu, int64_t gs, void *out, int64_t os, int64_t rows, int64_t n, int bf16,
                         int threads) {
    int64_t size = bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) num_threads(threads) if (parallel(rows, n, threads))
    for (int64_t t = 0; t < rows; t++) {
        const char *g = (const char *)gu + t * gs * size;
        char *o = (char *)out + t * os * size;
        if (bf16)
            silu_row(g, g + n * 2, o, n, 1);
        else
            silu_row(g, g + n * 4, o, n, 0);
    }
}

/* dst[i] = src[i] rounded to bf16 (nearest even; NaN: a quiet NaN), as torch's fp32 -> bf16 .to() */
void structspec_round_bf16(const float *src, uint16_t *dst, int64_t n, int threads) {
    int64_t vectors = (n + W - 1) / W;
    #pragma omp parallel for schedule(static) num_threads(threads) if (parallel(vectors, W, threads))
    for (int64_t v = 0; v < vectors; v++) {
        int64_t i = v * W;
        store(dst, i, n - i, load(src, i, n - i, 0), 1);
    }
}

/* Greedy verification's masked argmax over the logits. For each of n rows (rows[i], or i when
 * rows is NULL) of logits [*, vocab] (row stride ls) and its grammar mask (int32 words, row
 * stride ms; bit t % 32 of word t / 32 set: token t allowed): over the allowed tokens whose logit
 * is neither NaN nor -inf, idx[i] = the argmax (the lowest id on ties; -1 when there is none) and,
 * when logz is not NULL, logz[i] = log sum e^logit (the masked softmax's log-partition; -inf
 * when there is none). The argmax is exact (comparisons only), as torch's masked argmax; logz sums
 * in another order than torch's logsumexp (last fp32 bits). Words of zero, most of a mask inside
 * JSON's structure, are skipped unread. */
/* The mask's 16 bits for tokens [at, at + 16) (at a multiple of 16), and as lanes: all-ones where
 * the token is allowed and below `vocab` */
static inline uint32_t mask_bits(const uint32_t *m, int64_t at) { return (m[at >> 5] >> (at & 31)) & 0xffffu; }
static inline vi allowed_lanes(uint32_t bits, int64_t at, int64_t vocab, vi iota) {
    return ((((vi){0} + (int32_t)bits) >> iota & 1) != 0) & (iota < (int32_t)(vocab - at));
}

void structspec_masked_argmax(const void *logits, int64_t ls, const int32_t *mask, int64_t ms, const int64_t *rows,
                              int64_t n, int64_t vocab, int64_t *idx, float *logz, int bf16, int threads) {
    int64_t size = bf16 ? 2 : 4;
    vi iota;
    for (int j = 0; j < W; j++) iota[j] = j;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (parallel(n, vocab, threads))
    for (int64_t i = 0; i < n; i++) {
        int64_t r = rows ? rows[i] : i;
        const char *x = (const char *)logits + r * ls * size;
        const uint32_t *m = (const uint32_t *)mask + r * ms;
        vf best = (vf){0} - INFINITY;
        vi best_at = (vi){0} - 1;
        for (int64_t at = 0; at < vocab; at += W) {
            uint32_t bits = mask_bits(m, at);
            if (!bits)
                continue;
            vf v = load(x, at, vocab - at, bf16);
            vi better = allowed_lanes(bits, at, vocab, iota) & (v > best);
            best = choose(better, v, best);
            best_at = (better & (iota + (int32_t)at)) | (~better & best_at);
        }
        float top = -INFINITY;
        int64_t top_at = -1;
        for (int j = 0; j < W; j++)
            if (best_at[j] >= 0 && (best[j] > top || (best[j] == top && best_at[j] < top_at))) {
                top = best[j];
                top_at = best_at[j];
            }
        idx[i] = top_at;
        if (!logz)
            continue;
        if (top_at < 0 || top == INFINITY) {
            logz[i] = top;
            continue;
        }
        vf sum = {0};
        for (int64_t at = 0; at < vocab; at += W) {
            uint32_t bits = mask_bits(m, at);
            if (!bits)
                continue;
            vf v = load(x, at, vocab - at, bf16);
            vi on = allowed_lanes(bits, at, vocab, iota) & (v > -INFINITY);
            sum += choose(on, exp_nonpos(choose(on, v - top, (vf){0})), (vf){0});
        }
        float total = 0.0f;
        for (int j = 0; j < W; j++) total += sum[j];
        logz[i] = top + logf(total);
    }
}

int structspec_layer_version(void) { return 3; }
