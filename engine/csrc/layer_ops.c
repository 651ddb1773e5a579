/*
 * Fused elementwise ops of a Llama decoder layer for Tandem's CPU path (engine/models/cpu_ops.py).
 *
 * Loaded with ctypes into a worker process and called from its engine thread (ctypes drops the
 * GIL). Each op replaces 4-10 small torch ops whose dispatch cost dominates at decode batch
 * sizes: a 576-wide RMSNorm costs ~15 us through torch and ~1 us here. Math is float32;
 * activations are bfloat16 or float32 (dtype 1 / 0). Each op takes num_threads: 1 runs it on the
 * caller's thread without entering OpenMP at all (decode steps: the ops take microseconds there,
 * and an OpenMP region per op, a team of 1 between torch's teams of N, once made 2-thread decode
 * steps stall for hundreds of ms); more splits the token rows over a team of that size, which
 * the caller makes torch's own thread count (prefill chunks: ~17% of a 1024-token step on one
 * thread, engine/models/cpu_ops.PARALLEL_MIN_TOKENS).
 */
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include "avx512.h"
#include "bf16.h"

#define ABI_VERSION 5
enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };

int tandem_layer_ops_abi_version(void) { return ABI_VERSION; }

/* fn(args, begin, end) over the rows [0, num_tokens): here when num_threads <= 1, else split in
 * contiguous ranges over an OpenMP team of num_threads. */
typedef void (*rows_fn)(const void *args, int64_t begin, int64_t end);

static void for_rows(rows_fn fn, const void *args, int64_t num_tokens, int num_threads) {
    if (num_threads <= 1 || num_tokens < 2) {
        fn(args, 0, num_tokens);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
        fn(args, num_tokens * i / n, num_tokens * (i + 1) / n);
    }
}


/* Bind each thread of the caller's OpenMP team of num_threads (torch's and these ops' team: one
 * libgomp in the process) to one CPU: thread i to cpus[i]. What vLLM's CPU backend does with
 * VLLM_CPU_OMP_THREADS_BIND; a thread that stays on its core keeps its caches between layers.
 * Returns how many threads were bound (the team may be smaller than asked), or -1 when a bind
 * failed (then nothing is left bound: every thread of the team gets every CPU of `all` back). */
int tandem_bind_team(const int *cpus, int num_threads, const int *all, int num_all) {
    int bound = 0, failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : bound, failed)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        if (sched_setaffinity(0, sizeof(set), &set) == 0) bound++;
        else failed++;
    }
    if (!failed) return bound;
#pragma omp parallel num_threads(num_threads)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int i = 0; i < num_all; i++) CPU_SET(all[i], &set);
        sched_setaffinity(0, sizeof(set), &set);
    }
    return -1;
}


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

/* sum of r[i]^2: 16 running lanes with AVX-512 (a scalar sum is one serial chain of adds). */
static inline float sum_squares(const float *restrict r, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if HAVE_AVX512
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(r + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) sum += r[i] * r[i];
    return sum;
}

/*
 * residual[t] = (residual_in ? residual[t] : 0) + x[t]  (float32, [T, H] contiguous)
 * out[t] = residual[t] * rsqrt(mean(residual[t]^2) + eps) * weight   (dtype, [T, H] contiguous)
 * x rows are x_stride elements apart (x may be a column slice). hidden <= 16384.
 */
struct norm_args {
    const void *x;
    int64_t x_stride;
    float *residual;
    int residual_in;
    const float *weight;
    void *out;
    int64_t hidden;
    float eps;
    int dtype;
};

static void add_rms_norm_rows(const void *args, int64_t begin, int64_t end) {
    const struct norm_args *a = args;
    const int64_t hidden = a->hidden;
    const size_t es = elem_size(a->dtype);
    for (int64_t t = begin; t < end; t++) {
        float xf[16384];
        float *restrict r = a->residual + t * hidden;
        row_to_f32((const char *)a->x + (size_t)(t * a->x_stride) * es, xf, hidden, a->dtype);
        if (a->residual_in)
            for (int64_t i = 0; i < hidden; i++) r[i] += xf[i];
        else
            for (int64_t i = 0; i < hidden; i++) r[i] = xf[i];
        const float sum = sum_squares(r, hidden);
        const float scale = 1.0f / sqrtf(sum / (float)hidden + a->eps);
        for (int64_t i = 0; i < hidden; i++) xf[i] = r[i] * scale * a->weight[i];
        row_from_f32(xf, (char *)a->out + (size_t)(t * hidden) * es, hidden, a->dtype);
    }
}

void tandem_add_rms_norm(const void *x, int64_t x_stride, float *residual, int residual_in,
                         const float *weight, void *out, int64_t num_tokens, int64_t hidden, float eps,
                         int dtype, int num_threads) {
    const struct norm_args args = {x, x_stride, residual, residual_in, weight, out, hidden, eps, dtype};
    for_rows(add_rms_norm_rows, &args, num_tokens, num_threads);
}

/*
 * Rotate-half rotary embedding in place on the first num_heads heads of each row of x
 * ([T, row_stride] elements; head h of token t starts at t * row_stride + h * head_dim):
 * x = x * cos[pos] + rotate_half(x) * sin[pos], with cos/sin tables [max_pos, head_dim]
 * float32 stored full width and sin's first half negated (engine/models/layers.RotaryEmbedding).
 * head_dim <= 1024.
 */
static void rotary_row(void *x, int64_t row_stride, int64_t t, int64_t num_heads, int64_t head_dim,
                       const int64_t *positions, const float *cos_table, const float *sin_table, int dtype) {
    const int64_t half = head_dim / 2;
    const size_t es = elem_size(dtype);
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

/*
 * Rotary (rotary_row) on the first num_heads + num_kv_heads heads of each row of qkv (the q
 * heads, then the k heads), then each token's k and v heads (the num_kv_heads heads after the q
 * heads, and the num_kv_heads after those) copied to its slot of the caches: k_cache + slots[t]
 * * k_slot_stride, a slot's heads side by side (num_kv_heads * head_dim elements, the qkv dtype).
 * One call for what rotary and an index_copy_ into each cache did. Returns how many slots were
 * outside [0, num_slots) (their tokens are not stored).
 */
struct rotary_store_args {
    void *qkv;
    int64_t row_stride, num_heads, num_kv_heads, head_dim;
    const int64_t *positions;
    const float *cos_table, *sin_table;
    const int64_t *slots;
    int64_t num_slots;
    void *k_cache;
    int64_t k_slot_stride;
    void *v_cache;
    int64_t v_slot_stride;
    int dtype;
};

static void rotary_store_kv_rows(const void *args, int64_t begin, int64_t end) {
    const struct rotary_store_args *a = args;
    const size_t es = elem_size(a->dtype), kv_bytes = (size_t)(a->num_kv_heads * a->head_dim) * es;
    for (int64_t t = begin; t < end; t++) {
        rotary_row(a->qkv, a->row_stride, t, a->num_heads + a->num_kv_heads, a->head_dim, a->positions,
                   a->cos_table, a->sin_table, a->dtype);
        const int64_t slot = a->slots[t];
        if (slot < 0 || slot >= a->num_slots)
            continue;
        const char *row = (const char *)a->qkv + (size_t)(t * a->row_stride) * es;
        const char *k = row + (size_t)(a->num_heads * a->head_dim) * es;
        memcpy((char *)a->k_cache + (size_t)(slot * a->k_slot_stride) * es, k, kv_bytes);
        memcpy((char *)a->v_cache + (size_t)(slot * a->v_slot_stride) * es, k + kv_bytes, kv_bytes);
    }
}

int tandem_rotary_store_kv(void *qkv, int64_t row_stride, int64_t num_tokens, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, const int64_t *positions,
                           const float *cos_table, const float *sin_table, const int64_t *slots,
                           int64_t num_slots, void *k_cache, int64_t k_slot_stride, void *v_cache,
                           int64_t v_slot_stride, int dtype, int num_threads) {
    const struct rotary_store_args args = {qkv, row_stride, num_heads, num_kv_heads, head_dim, positions,
                                           cos_table, sin_table, slots, num_slots, k_cache, k_slot_stride,
                                           v_cache, v_slot_stride, dtype};
    for_rows(rotary_store_kv_rows, &args, num_tokens, num_threads);
    int bad = 0;
    for (int64_t t = 0; t < num_tokens; t++)
        bad += slots[t] < 0 || slots[t] >= num_slots;
    return bad;
}

#if HAVE_AVX512
static inline __m512 silu_512(__m512 g) {
    const __m512 e = exp_512(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* float32 rounded to the nearest bfloat16 (ties to even), as f32_to_bf16; NaN stays NaN. */
static inline __m512 round_bf16_512(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(
        _mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_mov_epi32(rounded, nan, quiet),
                                                _mm512_set1_epi32((int)0xffff0000u)));
}
#endif

/*
 * out[t, i] = silu(gate[t, i]) * up[t, i] for gate_up rows [gate | up] (2 * inter elements, rows
 * row_stride apart); out is [T, inter] contiguous. bfloat16 rounds twice, as torch's
 * F.silu(gate).mul_(up) on bfloat16 tensors does: silu to bfloat16, then the product.
 */
struct silu_args {
    const void *gate_up;
    int64_t row_stride, inter;
    void *out;
    int dtype;
};

static void silu_mul_rows(const void *args, int64_t begin, int64_t end) {
    const struct silu_args *a = args;
    const void *gate_up = a->gate_up;
    const int64_t row_stride = a->row_stride, inter = a->inter;
    void *out = a->out;
    const int dtype = a->dtype;
    const size_t es = elem_size(dtype);
    for (int64_t t = begin; t < end; t++) {
        const char *row = (const char *)gate_up + (size_t)(t * row_stride) * es;
        char *o = (char *)out + (size_t)(t * inter) * es;
        int64_t i = 0;
#if HAVE_AVX512
        if (dtype == DTYPE_BFLOAT16) {
            const uint16_t *g = (const uint16_t *)row, *u = g + inter;
            for (; i + 16 <= inter; i += 16) {
                const __m512 s = round_bf16_512(silu_512(bf16x16_to_f32(g + i)));
                const __m512 prod = _mm512_mul_ps(s, bf16x16_to_f32(u + i));
                _mm256_storeu_si256((__m256i *)((uint16_t *)o + i),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16_512(prod)), 16)));
            }
        } else {
            const float *g = (const float *)row, *u = g + inter;
            for (; i + 16 <= inter; i += 16)
                _mm512_storeu_ps((float *)o + i, _mm512_mul_ps(silu_512(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
        }
#endif
        for (; i < inter; i++) {
            if (dtype == DTYPE_BFLOAT16) {
                const uint16_t *g = (const uint16_t *)row, *u = g + inter;
                const float gf = bf16_to_f32(g[i]);
                const float s = bf16_to_f32(f32_to_bf16(gf / (1.0f + expf(-gf))));
                ((uint16_t *)o)[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
            } else {
                const float *g = (const float *)row, *u = g + inter;
                ((float *)o)[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
            }
        }
    }
}

void tandem_silu_mul(const void *gate_up, int64_t row_stride, int64_t num_tokens, int64_t inter, void *out,
                     int dtype, int num_threads) {
    const struct silu_args args = {gate_up, row_stride, inter, out, dtype};
    for_rows(silu_mul_rows, &args, num_tokens, num_threads);
}
