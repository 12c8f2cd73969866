/* Every decoder layer of one forward pass in one call, for the CPU (bf16 and fp32 models).
 *
 * The lean forward (structspec/engine/lean.py) runs a layer as eight C calls: two fused
 * RMSNorms and the gated SiLU and rotary (kernels/cpu_layer.c), four GEMMs through packed
 * weights (kernels/cpu_linear.c) and the attention (kernels/cpu_attention.c). From Python each
 * call costs microseconds of argument conversion, tensor allocation and view bookkeeping, which
 * is a large part of a decode pass whose GEMMs read the weights once. This file makes the same
 * calls, in the same order, with the same arguments, from C: the per-layer loop without Python
 * in between. It computes nothing of its own but the attention output's rounding to bf16 (which
 * the library of cpu_layer.c does too; an fp32 model's o projection takes the attention's fp32
 * output as it is), so its results are bit for bit those of the per-call loop.
 *
 * The three libraries are built with different flags (cpu_layer.c rounds as torch does, without
 * fused multiply-adds; cpu_attention.c reassociates), so they stay separate shared objects; the
 * caller passes their entry points as addresses (kernels/cpu_forward.py takes them from ctypes).
 */
#include <stdint.h>
#include <string.h>

typedef void (*linear_fn)(const uint16_t *x, int64_t ldx, int64_t m, int64_t k, const uint32_t *p, const float *bias,
                          uint16_t *y, int64_t ldy, int64_t n, int threads);
typedef void (*linear_f32_fn)(const float *x, int64_t ldx, int64_t m, int64_t k, const float *p, const float *bias,
                              float *y, int64_t ldy, int64_t n, int threads);
typedef void (*norm_fn)(void *x, int64_t xs, const void *y, int64_t ys, const void *w, void *h, int64_t hs,
                        int64_t rows, int64_t n, float eps, int bf16, int threads);
typedef void (*rotary_fn)(void *qk, int64_t qs, int64_t heads, int64_t d, const void *cos, const void *sin,
                          int64_t cs, int64_t rows, int bf16, int threads);
typedef void (*silu_fn)(const void *gu, int64_t gs, void *out, int64_t os, int64_t rows, int64_t n, int bf16,
                        int threads);
typedef void (*round_fn)(const float *src, uint16_t *dst, int64_t n, int threads);
typedef void (*attend_fn)(const void *q, int64_t q_st, int64_t q_sh, const void *k, int64_t k_st, int64_t k_sh,
                          const void *v, int64_t v_st, int64_t v_sh, int in_bf16, int kv_bf16, float *out,
                          int64_t o_st, int64_t o_sh, const int64_t *table, int64_t num_seqs, int64_t layers,
                          int64_t layer, int heads, int kv_heads, float scale, int64_t window, int with_shared,
                          int threads);

/* entry points, in this order, as addresses (F_LINEAR: structspec_linear for bf16 rows,
 * structspec_linear_f32 for fp32 ones) */
enum { F_LINEAR, F_NORM, F_ROTARY, F_SILU, F_ROUND, F_ATTEND, F_COUNT };
/* the model's sizes */
enum { S_LAYERS, S_HIDDEN, S_HEADS, S_KV_HEADS, S_HEAD_DIM, S_VALUE_DIM, S_INTERMEDIATE, S_COUNT };
/* per layer, as addresses: the two norms' weights, then each GEMM's packed words and bias (0: none) */
enum { W_NORM1, W_NORM2, W_QKV, W_QKV_BIAS, W_O, W_O_BIAS, W_GATE_UP, W_GATE_UP_BIAS, W_DOWN, W_DOWN_BIAS, W_COUNT };
/* the pass's buffers, as addresses: x [T, hidden] (the residual stream, updated in place), y [T,
 * hidden] (the last layer's MLP output, not yet added to x), then scratch: h [T, hidden], qkv [T,
 * (heads + 2 kv_heads) d], attention [T, heads, dv] fp32 and bf16, o [T, hidden], gate_up
 * [T, 2 intermediate], act [T, intermediate]; then, for a pass that keeps only some rows' output
 * (out_rows), those rows' residual stream xo [R, hidden] and attention output [R, heads, dv]; all
 * of the model's dtype (bf16 or fp32) but the fp32 attention (an fp32 model's B_ATT is not used),
 * rows contiguous */
enum { B_X, B_Y, B_H, B_QKV, B_ATT32, B_ATT, B_O, B_GATE_UP, B_ACT, B_XO, B_ATTO, B_COUNT };

int structspec_forward_version(void) { return 3; } /* 3: out_rows (the last layer's output for some rows) */

/* Layers [0, S_LAYERS) over T rows: what LeanForward._fused does between the embedding and the
 * final norm, with rows, weights and cos, sin [T, head_dim] (row stride cs) of bf16, or of fp32
 * with `fp32` set, the attention's step table (num_seqs sequences; with_shared: its shared-prefix
 * rows) and KV buffers of bf16 (kv_bf16; bf16 rows only) or fp32. eps: [layers][2] (each layer's
 * two norms).
 *
 * out_rows (out_count row indices; NULL: every row): the rows whose output the caller reads (the
 * ones it takes logits of). Every row's keys and values are still written, so the last layer runs
 * its norm, qkv, rotary and attention over all rows; what follows the attention there (o, the
 * second norm, the MLP) only feeds those rows' output, so it runs over them alone: their residual
 * stream is copied to xo and their attention output to atto, in out_rows' order, and y's first
 * out_count rows become their MLP output. Each row's arithmetic is the same whatever rows run
 * beside it (the kernels' chains do not depend on the row count), so the same bits. */
void structspec_forward_layers(const int64_t *fns, const int64_t *sizes, const int64_t *weights, const float *eps,
                               const int64_t *buffers, int64_t rows, const void *cos, const void *sin, int64_t cs,
                               const int64_t *table, int64_t num_seqs, int with_shared, int kv_bf16, float scale,
                               int fp32, const int64_t *out_rows, int64_t out_count, int threads) {
    linear_fn linear = (linear_fn)(intptr_t)fns[F_LINEAR];
    linear_f32_fn linear_f32 = (linear_f32_fn)(intptr_t)fns[F_LINEAR];
    norm_fn norm = (norm_fn)(intptr_t)fns[F_NORM];
    rotary_fn rotary = (rotary_fn)(intptr_t)fns[F_ROTARY];
    silu_fn silu = (silu_fn)(intptr_t)fns[F_SILU];
    round_fn round_bf16 = (round_fn)(intptr_t)fns[F_ROUND];
    attend_fn attend = (attend_fn)(intptr_t)fns[F_ATTEND];
    const int64_t layers = sizes[S_LAYERS], n = sizes[S_HIDDEN], heads = sizes[S_HEADS], kvh = sizes[S_KV_HEADS];
    const int64_t d = sizes[S_HEAD_DIM], dv = sizes[S_VALUE_DIM], inter = sizes[S_INTERMEDIATE];
    const int64_t qkv_n = (heads + kvh) * d + kvh * dv, att_n = heads * dv;
    void *x = (void *)(intptr_t)buffers[B_X], *y = (void *)(intptr_t)buffers[B_Y];
    void *h = (void *)(intptr_t)buffers[B_H], *qkv = (void *)(intptr_t)buffers[B_QKV];
    float *att32 = (float *)(intptr_t)buffers[B_ATT32];
    void *att = fp32 ? (void *)att32 : (void *)(intptr_t)buffers[B_ATT], *o = (void *)(intptr_t)buffers[B_O];
    void *gu = (void *)(intptr_t)buffers[B_GATE_UP], *act = (void *)(intptr_t)buffers[B_ACT];
    char *xo = (char *)(intptr_t)buffers[B_XO], *atto = (char *)(intptr_t)buffers[B_ATTO];
    const int64_t es = fp32 ? 4 : 2; /* bytes an element of the rows */
    const int bf16 = !fp32;
    /* y = a @ the packed weight, in the rows' type */
#define LINEAR(a, lda, k, wi, out, ldo, nn)                                                          \
    (fp32 ? linear_f32((const float *)(a), lda, m, k, (const float *)PTR(wi), (const float *)PTR(wi + 1), \
                       (float *)(out), ldo, nn, threads)                                             \
          : linear((const uint16_t *)(a), lda, m, k, (const uint32_t *)PTR(wi), (const float *)PTR(wi + 1), \
                   (uint16_t *)(out), ldo, nn, threads))
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *w = weights + l * W_COUNT;
#define PTR(i) ((const void *)(intptr_t)w[i])
        int64_t m = rows; /* the rows the GEMMs run */
        norm(x, n, l ? y : 0, n, PTR(W_NORM1), h, n, rows, n, eps[2 * l], bf16, threads);
        LINEAR(h, n, n, W_QKV, qkv, qkv_n, qkv_n);
        rotary(qkv, qkv_n, heads + kvh, d, cos, sin, cs, rows, bf16, threads);
        attend(qkv, qkv_n, d, (char *)qkv + heads * d * es, qkv_n, d, (char *)qkv + (heads + kvh) * d * es, qkv_n, dv,
               bf16, kv_bf16, att32, att_n, dv, table, num_seqs, layers, l, (int)heads, (int)kvh, scale, 0,
               with_shared, threads);
        void *xl = x, *al = att; /* this layer's residual stream and attention output from here on */
        if (out_rows && l == layers - 1) { /* the rows the caller reads, alone */
            for (int64_t i = 0; i < out_count; i++) {
                const int64_t r = out_rows[i];
                memcpy(xo + i * n * es, (const char *)x + r * n * es, n * es);
                if (bf16) round_bf16(att32 + r * att_n, (uint16_t *)(atto + i * att_n * es), att_n, 1);
                else memcpy(atto + i * att_n * es, att32 + r * att_n, att_n * es);
            }
            xl = xo, al = atto, m = out_count;
            if (!m) break;
        } else if (bf16) {
            round_bf16(att32, (uint16_t *)att, rows * att_n, threads);
        }
        LINEAR(al, att_n, att_n, W_O, o, n, n);
        norm(xl, n, o, n, PTR(W_NORM2), h, n, m, n, eps[2 * l + 1], bf16, threads);
        LINEAR(h, n, n, W_GATE_UP, gu, 2 * inter, 2 * inter);
        silu(gu, 2 * inter, act, inter, m, inter, bf16, threads);
        LINEAR(act, inter, inter, W_DOWN, y, n, n);
#undef PTR
    }
#undef LINEAR
}
