/* bfloat16 <-> float32 for Tandem's CPU kernels (engine/csrc/*.c). */
#ifndef TANDEM_BF16_H
#define TANDEM_BF16_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16; /* bfloat16 is the high half of a float32 */
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

#endif
