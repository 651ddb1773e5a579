/*
 * Fused elementwise ops of a Llama decoder layer for Tandem's CPU path (engine/models/cpu_ops.py).
 *
 * Loaded with ctypes into a worker process and called from its engine thread (ctypes drops the
 * GIL). Each op replaces 4-10 small torch ops whose dispatch cost dominates at decode batch
 * sizes: a 576-wide RMSNorm costs ~15 us through torch and ~1 us here. Math is float32;
 * activations are bfloat16 or float32 (dtype 1 / 0). Single-threaded on purpose: these ops
 * take microseconds even at batch 64, and an OpenMP region per op (a team of 1 at small batches
 * between torch's teams of N) made 2-thread decode steps stall for hundreds of ms.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#define ABI_VERSION 2
enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

int tandem_layer_ops_abi_version(void) { return ABI_VERSION; }


/* The dtype-specialized loops below are plain enough for gcc to vectorize at -O3. */
static inline void row_to_f32(const void *x, float *restrict dst, int64_t n, int dtype) {
    if (dtype == DTYPE_BFLOAT16) {
        const uint16_t *restrict xs = (const uint16_t *)x;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(xs[i]);
    } else {
        memcpy(dst, x, (size_t)n * sizeof(float));
    }
}

static inline void row_from_f32(const float *restrict src, void *out, int64_t n, int dtype) {
    if (dtype == DTYPE_BFLOAT16) {
        uint16_t *restrict o = (uint16_t *)out;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(out, src, (size_t)n * sizeof(float));
    }
}

static inline size_t elem_size(int dtype) { return dtype == DTYPE_BFLOAT16 ? 2 : 4; }

/*
 * residual[t] = (residual_in ? residual[t] : 0) + x[t]  (float32, [T, H] contiguous)
 * out[t] = residual[t] * rsqrt(mean(residual[t]^2) + eps) * weight   (dtype, [T, H] contiguous)
 * x rows are x_stride elements apart (x may be a column slice). hidden <= 16384.
 */
void tandem_add_rms_norm(const void *x, int64_t x_stride, float *residual, int residual_in,
                         const float *weight, void *out, int64_t num_tokens, int64_t hidden, float eps,
                         int dtype) {
    const size_t es = elem_size(dtype);
    for (int64_t t = 0; t < num_tokens; t++) {
        float xf[16384];
        float *restrict r = residual + t * hidden;
        row_to_f32((const char *)x + (size_t)(t * x_stride) * es, xf, hidden, dtype);
        if (residual_in)
            for (int64_t i = 0; i < hidden; i++) r[i] += xf[i];
        else
            for (int64_t i = 0; i < hidden; i++) r[i] = xf[i];
        float sum = 0.0f;
        for (int64_t i = 0; i < hidden; i++) sum += r[i] * r[i];
        const float scale = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++) xf[i] = r[i] * scale * weight[i];
        row_from_f32(xf, (char *)out + (size_t)(t * hidden) * es, hidden, dtype);
    }
}

/*
 * Rotate-half rotary embedding in place on the first num_heads heads of each row of x
 * ([T, row_stride] elements; head h of token t starts at t * row_stride + h * head_dim):
 * x = x * cos[pos] + rotate_half(x) * sin[pos], with cos/sin tables [max_pos, head_dim]
 * float32 stored full width and sin's first half negated (engine/models/layers.RotaryEmbedding).
 * head_dim <= 1024.
 */
void tandem_rotary(void *x, int64_t row_stride, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
                   const int64_t *positions, const float *cos_table, const float *sin_table, int dtype) {
    const int64_t half = head_dim / 2;
    const size_t es = elem_size(dtype);
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *restrict c = cos_table + positions[t] * head_dim;
        const float *restrict s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < num_heads; h++) {
            float v[1024], o[1024];
            char *head = (char *)x + (size_t)(t * row_stride + h * head_dim) * es;
            row_to_f32(head, v, head_dim, dtype);
            for (int64_t i = 0; i < half; i++) {
                o[i] = v[i] * c[i] + v[half + i] * s[i];
                o[half + i] = v[half + i] * c[half + i] + v[i] * s[half + i];
            }
            row_from_f32(o, head, head_dim, dtype);
        }
    }
}
