/* The matrix units (AMX) for this project's C kernels: whether the OS lets this process use them,
 * and a tile configuration. Included by kernels/cpu_attention.c and kernels/cpu_linear.c (the
 * build keys each library by the headers it includes too: kernels/native.py). */
#ifndef STRUCTSPEC_CPU_AMX_H
#define STRUCTSPEC_CPU_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int amx_state = 0; /* 0: not asked yet; 1: the OS lets this process use the tiles; -1: not */
static int amx_usable(void) {
    int state = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (state == 0) { /* ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA (idempotent; oneDNN asks the same) */
        state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, state, __ATOMIC_RELEASE);
    }
    return state == 1;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0 .. tiles - 1 configured with rows[t] rows of 64 bytes each (palette 1). The
 * configuration is per thread: a kernel loads it on each thread at the start of every call and
 * releases the tiles at its end, since oneDNN's GEMMs on the same threads configure them their
 * own way in between. */
static inline void amx_configure_rows(const uint8_t *rows, int tiles) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < tiles; t++) {
        c.colsb[t] = 64;
        c.rows[t] = rows[t];
    }
    _tile_loadconfig(&c);
}
#endif
