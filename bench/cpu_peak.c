/* The CPU's arithmetic peak, measured: independent chains of one multiply-add instruction, as
 * many as keep its units busy, on every thread at once, with nothing read from memory. What a
 * GEMM or a pass of this project's kernels can reach at most on this machine, so that a benchmark
 * can state its rate as a share of it (bench/bound.py), next to the GEMM rate and the
 * memory bandwidth it measures the same way.
 *
 * Kinds: 0, fp32 FMA (AVX-512, else AVX2); 1, bf16 pairs on the vector units (vdpbf16ps,
 * AVX512-BF16); 2, bf16 on the matrix units (AMX tdpbf16ps, where the OS lets this process use
 * them). structspec_peak_gflops returns 0 for a kind this build or this CPU lacks. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

int structspec_peak_version(void) { return 1; }

#define CHAINS 16 /* independent accumulators: more than latency x throughput of each instruction here */
#define CHAINS_AVX2 12 /* AVX2 has 16 registers: 12 chains and the two sources, nothing spilled */

static double fp32_thread(int64_t iters) {
#ifdef __AVX512F__
    __m512 acc[CHAINS], a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(0x1p-30f);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a)); /* a is not known to stay 1: every step is computed */
    }
    float sum = 0;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    return sum;
#else
    __m256 acc[CHAINS_AVX2], a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(0x1p-30f);
    for (int i = 0; i < CHAINS_AVX2; i++) acc[i] = _mm256_set1_ps((float)i);
    for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS_AVX2; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        __asm__ volatile("" : "+x"(a));
    }
    float lanes[8], sum = 0;
    for (int i = 0; i < CHAINS_AVX2; i++) {
        _mm256_storeu_ps(lanes, acc[i]);
        for (int l = 0; l < 8; l++) sum += lanes[l];
    }
    return sum;
#endif
}

#ifdef __AVX512BF16__
static double bf16_thread(int64_t iters) {
    __m512 acc[CHAINS];
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x30003000);
    for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_set1_ps((float)i);
    for (int64_t it = 0; it < iters; it++) {
#pragma GCC unroll 16
        for (int i = 0; i < CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));
    }
    float sum = 0;
    for (int i = 0; i < CHAINS; i++) sum += _mm512_reduce_add_ps(acc[i]);
    return sum;
}
#endif

/* Only in a build with AVX512-BF16, as in cpu_linear.c and cpu_attention.c (every AMX CPU has it):
 * a build without AVX-512 stands for a CPU with neither, and GCC's -mno-avx512f leaves AMX on */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "cpu_amx.h"
#define PEAK_AMX 1
/* Tiles 0-5: six 16 x 16 fp32 accumulators; 6: A, 16 rows of 32 bf16; 7: B, 16 rows of 16 pairs.
 * Each tdpbf16ps is 16 x 16 x 32 multiply-adds. */
static double amx_thread(int64_t iters) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    uint16_t src[16 * 32] __attribute__((aligned(64)));
    float out[16 * 16] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++) src[i] = 0x3000; /* 2^-31: the sums stay small */
    amx_configure_rows(rows, 8);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    _tile_loadd(6, src, 64);
    _tile_loadd(7, src, 64);
    for (int64_t it = 0; it < iters; it++) {
        _tile_dpbf16ps(0, 6, 7);
        _tile_dpbf16ps(1, 6, 7);
        _tile_dpbf16ps(2, 6, 7);
        _tile_dpbf16ps(3, 6, 7);
        _tile_dpbf16ps(4, 6, 7);
        _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}
#else
#define PEAK_AMX 0
#endif

/* GFLOP/s of `kind` on `threads` threads, each running `iters` steps (0: not in this build/CPU) */
double structspec_peak_gflops(int kind, int64_t iters, int threads) {
    double flops_per_step; /* per thread */
    switch (kind) {
    case 0:
#ifdef __AVX512F__
        flops_per_step = CHAINS * 16 * 2;
#else
        flops_per_step = CHAINS_AVX2 * 8 * 2;
#endif
        break;
#ifdef __AVX512BF16__
    case 1: flops_per_step = CHAINS * 32 * 2; break;
#endif
#if PEAK_AMX
    case 2:
        if (!amx_usable()) return 0;
        flops_per_step = 6.0 * 16 * 16 * 32 * 2;
        break;
#endif
    default: return 0;
    }
    double sum = 0;
    int ran = 1;
    double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : sum)
    {
#pragma omp single
        ran = omp_get_num_threads();
        switch (kind) {
        case 0: sum += fp32_thread(iters); break;
#ifdef __AVX512BF16__
        case 1: sum += bf16_thread(iters); break;
#endif
#if PEAK_AMX
        case 2: sum += amx_thread(iters); break;
#endif
        }
    }
    double seconds = omp_get_wtime() - t0;
    __asm__ volatile("" : : "x"(sum)); /* the sums are used: no chain is dropped */
    return flops_per_step * iters * ran / seconds / 1e9;
}
