/* Ragged decode/verification attention over per-sequence KV buffers, for the CPU.
 *
 * The same step description as kernels/attention.py (the Triton kernels): a table of int64
 * [2 * layers + 4, S]: every layer's key buffer addresses, then every layer's value buffer
 * addresses, then each sequence's first row, row count, past length and capacity. A sequence's
 * buffer for one layer is [KVH, capacity, D] contiguous, fp32 or bf16 (bf16 halves what a step
 * reads; the arithmetic is fp32 either way). One call appends every listed
 * sequence's new keys/values for one layer and attends its new rows over its buffer, in fp32.
 *
 * Work item: one (sequence, kv head). Its G = H / KVH query heads times its rows share every
 * key and value read: K and V are read once per item, whatever the rows (the blocking that a
 * loop over (query, key) pairs lacks). Items run in parallel under OpenMP (the runtime torch
 * already loaded: the same soname, so one thread pool).
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

/* e^x for x <= 0 (scores minus their row's maximum): Cody-Waite reduction and a degree-6
 * polynomial, within 2 ulp of expf; branch-free so the compiler vectorises the loops using it. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = __builtin_roundf(x * 1.44269504088896341f);
    float r = x - k * 0.693359375f;
    r = r + k * 2.12194440e-4f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f
              + r * 0.00138888892f)))));
    int32_t bits = ((int32_t)k + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return p * s;
}

typedef float v8 __attribute__((vector_size(32)));
#define NB 64    /* keys per block: a block's keys (or values) in fp32 stay in L1 for every query */
#define VD (D / 8)
#define VDV (DV / 8)

/* The eight sums of a0..a7's lanes, as one vector (the vhaddps tree). */
static inline v8 sum8(v8 a0, v8 a1, v8 a2, v8 a3, v8 a4, v8 a5, v8 a6, v8 a7) {
#define HADD(a, b) (__builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + \
                    __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15))
    v8 t0 = HADD(a0, a1), t1 = HADD(a2, a3), t2 = HADD(a4, a5), t3 = HADD(a6, a7);
    v8 u0 = HADD(t0, t1), u1 = HADD(t2, t3);
#undef HADD
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

/* scores[0:8] = q . kf[0:8] (kf: 8 keys of D fp32, contiguous), eight independent chains */
static inline void dot8(const v8 *q, const float *kf, float *scores) {
    v8 a[8] = {0};
    for (int c = 0; c < VD; c++)
        for (int kk = 0; kk < 8; kk++) {
            v8 k;
            memcpy(&k, kf + kk * D + c * 8, sizeof k);
            a[kk] += q[c] * k;
        }
    v8 r = sum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
    memcpy(scores, &r, sizeof r);
}

/* One (sequence, kv head) work item, for KV buffers of element type KV_T read through TO_F32. */
#define DEFINE_ATTEND_ITEM(NAME, KV_T, TO_F32, APPEND)                                                        \
static void NAME(int64_t j, int g, int64_t num_seqs, const int64_t *table, int64_t layers, int64_t layer,      \
                 const void *q, int64_t q_st, int64_t q_sh, const void *k, int64_t k_st, int64_t k_sh,         \
                 const void *v, int64_t v_st, int64_t v_sh, int in_bf16, float *out, int64_t o_st,             \
                 int64_t o_sh, int group, float scale, int64_t window) {                                       \
    KV_T *keys = (KV_T *)(intptr_t)table[layer * num_seqs + j];                                                \
    KV_T *values = (KV_T *)(intptr_t)table[(layers + layer) * num_seqs + j];                                   \
    const int64_t *meta = table + 2 * layers * num_seqs;                                                       \
    int64_t start = meta[j], rows = meta[num_seqs + j], past = meta[2 * num_seqs + j];                         \
    int64_t cap = meta[3 * num_seqs + j];                                                                      \
    if (rows <= 0) return;                                                                                     \
    keys += (int64_t)g * cap * D;                                                                              \
    values += (int64_t)g * cap * DV;                                                                           \
    int64_t end = past + rows;                                                                                 \
    for (int64_t i = 0; i < rows; i++) { /* append this item's new keys and values */                          \
        APPEND(k, in_bf16, (start + i) * k_st + g * k_sh, keys + (past + i) * D, D);                           \
        APPEND(v, in_bf16, (start + i) * v_st + g * v_sh, values + (past + i) * DV, DV);                       \
    }                                                                                                          \
    int64_t nq = (int64_t)group * rows; /* query index qi = head_in_group * rows + row */                      \
    int64_t lo = 0;                     /* the first key any row of the item sees */                           \
    if (window > 0 && past - window + 1 > 0) lo = past - window + 1;                                           \
    int64_t span = end - lo, padded = (span + NB - 1) / NB * NB;                                               \
    /* queries [nq][D], scores [nq][padded], sums [nq][DV], 1/l [nq], a block of keys or values */             \
    float *qs = aligned_alloc(64, sizeof(float) * (nq * D + nq * padded + nq * DV + nq + 8 + NB * (D > DV ? D : DV))); \
    float *scores = qs + nq * D, *acc = scores + nq * padded, *inv = acc + nq * DV;                            \
    float *block = inv + nq + 8;                                                                               \
    for (int hl = 0; hl < group; hl++)                                                                         \
        for (int64_t i = 0; i < rows; i++)                                                                     \
            load_row(q, in_bf16, (start + i) * q_st + ((int64_t)g * group + hl) * q_sh,                        \
                     qs + (hl * rows + i) * D, D);                                                             \
    for (int64_t b = 0; b < span; b += NB) { /* q.K: each block of keys once, for every query */               \
        int64_t nb = span - b < NB ? span - b : NB;                                                            \
        const KV_T *kb = keys + (lo + b) * D;                                                                  \
        for (int64_t e = 0; e < nb * D; e++) block[e] = TO_F32(kb[e]);                                         \
        memset(block + nb * D, 0, sizeof(float) * (NB - nb) * D);                                              \
        for (int64_t qi = 0; qi < nq; qi++) {                                                                  \
            v8 qv[VD];                                                                                         \
            memcpy(qv, qs + qi * D, sizeof qv);                                                                \
            for (int64_t kk = 0; kk < nb; kk += 8) dot8(qv, block + kk * D, scores + qi * padded + b + kk);    \
        }                                                                                                      \
    }                                                                                                          \
    for (int64_t qi = 0; qi < nq; qi++) { /* softmax over each row's visible keys [first, pos] */              \
        int64_t pos = past + qi % rows;                                                                        \
        int64_t first = (window > 0 && pos - window + 1 > lo) ? pos - window + 1 : lo;                         \
        float *s = scores + qi * padded;                                                                       \
        float m = -INFINITY;                                                                                   \
        for (int64_t n = first - lo; n <= pos - lo; n++) m = s[n] > m ? s[n] : m;                              \
        m *= scale;                                                                                            \
        float l = 0.0f;                                                                                        \
        for (int64_t n = 0; n < padded; n++) {                                                                 \
            float p = exp_nonpos(s[n] * scale - m);                                                            \
            p = (n >= first - lo && n <= pos - lo) ? p : 0.0f;                                                 \
            s[n] = p;                                                                                          \
            l += p;                                                                                            \
        }                                                                                                      \
        inv[qi] = 1.0f / l;                                                                                    \
    }                                                                                                          \
    for (int64_t b = 0; b < span; b += NB) { /* P.V: each block of values once, for every query */             \
        int64_t nb = span - b < NB ? span - b : NB;                                                            \
        const KV_T *vb = values + (lo + b) * DV;                                                               \
        for (int64_t e = 0; e < nb * DV; e++) block[e] = TO_F32(vb[e]);                                        \
        for (int64_t qi = 0; qi < nq; qi++) {                                                                  \
            v8 a[VDV];                                                                                         \
            if (b == 0) memset(a, 0, sizeof a); else memcpy(a, acc + qi * DV, sizeof a);                       \
            const float *p = scores + qi * padded + b;                                                         \
            for (int64_t n = 0; n < nb; n++)                                                                   \
                for (int c = 0; c < VDV; c++) {                                                                \
                    v8 x;                                                                                      \
                    memcpy(&x, block + n * DV + c * 8, sizeof x);                                              \
                    a[c] += p[n] * x;                                                                          \
                }                                                                                              \
            memcpy(acc + qi * DV, a, sizeof a);                                                                \
        }                                                                                                      \
    }                                                                                                          \
    for (int hl = 0; hl < group; hl++)                                                                         \
        for (int64_t i = 0; i < rows; i++) {                                                                   \
            int64_t qi = hl * rows + i;                                                                        \
            float *o = out + (start + i) * o_st + ((int64_t)g * group + hl) * o_sh;                            \
            for (int d = 0; d < DV; d++) o[d] = acc[qi * DV + d] * inv[qi];                                    \
        }                                                                                                      \
    free(qs);                                                                                                  \
}

static inline float f32_id(float x) { return x; }
/* bf16 buffers take bf16 rows as they are (the model's own values: no rounding anywhere) */
static inline void copy_bf16_row(const void *base, int in_bf16, int64_t off, uint16_t *dst, int dim) {
    (void)in_bf16;
    memcpy(dst, (const uint16_t *)base + off, sizeof(uint16_t) * dim);
}
DEFINE_ATTEND_ITEM(attend_item_f32, float, f32_id, load_row)
DEFINE_ATTEND_ITEM(attend_item_bf16, uint16_t, bf16_to_f32, copy_bf16_row)

/* Append and attend, for one layer, every sequence in `table` (see the top of the file).
 * q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, DV]: fp32 (in_bf16 = 0) or bf16, strides
 * in elements; KV buffers fp32 (kv_bf16 = 0) or bf16 (only with bf16 inputs); out [T, heads, DV]
 * fp32. window <= 0: no sliding window. */
void structspec_attend(const void *q, int64_t q_st, int64_t q_sh, const void *k, int64_t k_st, int64_t k_sh,
                       const void *v, int64_t v_st, int64_t v_sh, int in_bf16, int kv_bf16, float *out,
                       int64_t o_st, int64_t o_sh, const int64_t *table, int64_t num_seqs, int64_t layers,
                       int64_t layer, int heads, int kv_heads, float scale, int64_t window, int threads) {
    int group = heads / kv_heads;
    int64_t items = num_seqs * kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && items > 1)
    for (int64_t it = 0; it < items; it++) {
        if (kv_bf16)
            attend_item_bf16(it / kv_heads, (int)(it % kv_heads), num_seqs, table, layers, layer, q, q_st, q_sh, k,
                             k_st, k_sh, v, v_st, v_sh, in_bf16, out, o_st, o_sh, group, scale, window);
        else
            attend_item_f32(it / kv_heads, (int)(it % kv_heads), num_seqs, table, layers, layer, q, q_st, q_sh, k,
                            k_st, k_sh, v, v_st, v_sh, in_bf16, out, o_st, o_sh, group, scale, window);
    }
}

int structspec_attend_dims(void) { return D * 10000 + DV; }
