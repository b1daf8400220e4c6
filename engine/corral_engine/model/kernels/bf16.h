/* bfloat16 <-> float32 for the native kernels, rounding as torch does. Included by every kernel
 * source; native.build() hashes the headers and sources in this folder into each library's cache key. */
#ifndef CORRAL_BF16_H
#define CORRAL_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); } /* x.to(bf16).float() */

#endif
