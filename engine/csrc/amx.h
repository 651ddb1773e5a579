/* AMX tiles for Tandem's CPU kernels (quant_linear.c, paged_attention.c): HAVE_AMX where the
 * compiler targets AMX-BF16 (-march=native on such a CPU), the tile configuration every kernel
 * here uses (tiles of 16 rows x 64 bytes) and the kernel-side permission request. */
#ifndef TANDEM_AMX_H
#define TANDEM_AMX_H
#include "avx512.h"
#if HAVE_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Whether this process may use AMX: Linux hands out the tile state only on request
 * (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); asked once per library. */
static inline int amx_permitted(void) {
    static int state = 0;
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return state == 1;
}

/* Tiles 0..num_tiles-1 as 16 rows x 64 bytes, on the calling thread (the configuration is per thread). */
static inline void amx_configure(int num_tiles) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < num_tiles; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#else
#define HAVE_AMX 0
#endif
#endif
