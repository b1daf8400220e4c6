/* Fused elementwise ops for bfloat16 activations on the CPU: one pass over memory instead of the
 * four to six PyTorch makes (float32 round trips, separate multiplies).
 *
 * Each reproduces the rounding of the PyTorch expression it replaces, step by step:
 *   silu_and_mul:  bf16(bf16(silu(gate)) * up)                       x = [T, 2I] -> out [T, I]
 *   rms_norm:      bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))         x, out [T, H]; w [H]
 * where every intermediate is computed in float32, as PyTorch does for bf16 tensors. Rows run in
 * parallel (OpenMP, torch's thread count). Built with -O3 -march=native -ffast-math.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

int silu_and_mul_bf16(const uint16_t *x, uint16_t *out, int64_t num_rows, int64_t size, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        const uint16_t *gate = x + r * 2 * size, *up = gate + size;
        uint16_t *o = out + r * size;
        for (int64_t i = 0; i < size; i++) {
            const float g = bf16_to_f32(gate[i]);
            const float s = round_bf16(g / (1.0f + expf(-g)));
            o[i] = f32_to_bf16(s * bf16_to_f32(up[i]));
        }
    }
    return 0;
}

int rms_norm_bf16(const uint16_t *x, const uint16_t *weight, uint16_t *out, int64_t num_rows, int64_t size,
                  float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        const uint16_t *xr = x + r * size;
        uint16_t *o = out + r * size;
        float sum = 0.0f;
        for (int64_t i = 0; i < size; i++) {
            const float v = bf16_to_f32(xr[i]);
            sum += v * v;
        }
        const float inv = 1.0f / sqrtf(sum / (float)size + eps);
        for (int64_t i = 0; i < size; i++) {
            const float normed = round_bf16(bf16_to_f32(xr[i]) * inv);
            o[i] = f32_to_bf16(bf16_to_f32(weight[i]) * normed);
        }
    }
    return 0;
}
