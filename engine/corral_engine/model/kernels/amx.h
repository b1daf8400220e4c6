/* AMX tiles (Intel Sapphire Rapids and later) for the native kernels: whether the build targets
 * them (HAVE_AMX: -march=native on such a CPU) and Linux grants this process their state, and the
 * one tile configuration every kernel here uses. Included by paged_decode.c and amx_linear.c;
 * native.build() hashes the headers and sources in this folder into each library's cache key. */
#ifndef CORRAL_AMX_H
#define CORRAL_AMX_H

#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>

long syscall(long number, ...); /* <unistd.h> declares it only for _GNU_SOURCE / _DEFAULT_SOURCE */

/* Linux gives a process AMX tile state only once it asks (PyTorch's oneDNN may have asked already:
 * asking again is harmless). A race between threads is benign: every asker gets the same answer. */
static int amx_usable(void) {
    static int state; /* 0 unknown, 1 granted, -1 refused */
    if (state == 0)
        state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}

/* Palette 1, all eight tiles 16 rows of 64 bytes (16 float32, or 32 bf16). Tile state is per
 * thread: each thread configures it before its tile instructions and releases it after. */
static void amx_begin(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.rows[i] = 16, cfg.colsb[i] = 64;
    _tile_loadconfig(&cfg);
}

static void amx_end(void) { _tile_release(); }
#else
static int amx_usable(void) { return 0; }
static void amx_begin(void) {}
static void amx_end(void) {}
#endif

#endif
