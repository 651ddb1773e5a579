/*
 * Paged attention kernels for Tandem's CPU backend (engine/attention/cpu_backend.py).
 *
 * Loaded with ctypes into a worker process and called from its engine thread (ctypes drops
 * the GIL for the call). K/V are read where they lie in the paged pool: a cache is
 * [num_blocks, block_size, num_kv_heads, head_dim] with head_dim contiguous, and a sequence's
 * token at position p lives in block block_table[p / block_size] at offset p % block_size.
 * Query head h reads kv head h / (num_heads / num_kv_heads). Softmax and accumulation are
 * float32; scores are float32 products too, except for bfloat16 queries and caches on CPUs with
 * AVX512-BF16, where scores and values are vdpbf16ps products read from the cache as they lie
 * (bfloat16 pairs summed in float32, the softmax weights rounded to bfloat16 for the values).
 * Outputs have the query's dtype. Only slots inside a sequence's context are read, so the rest
 * of the pool may hold anything.
 *
 * Both kernels walk a sequence's context in tiles of KEY_TILE tokens with an online softmax:
 * scores for the tile, then one rescale of the running sums, then the tile's values. The vdpbf16ps
 * prefill packs every tile (keys transposed, values paired) once per call for all its work items. Decode may
 * cut a long context into partitions (by its length alone) whose partial results are merged by
 * log-sum-exp. Every output row, or partition, is computed by one thread in a fixed order and
 * partitions merge in order, so results do not depend on the number of threads. The hot loops have an AVX-512 version (head_dim a multiple of 16) and a
 * portable one. Plain C with OpenMP and no torch headers: it builds in about a second.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "avx512.h"
#include "amx.h"

#define ABI_VERSION 3
enum { DTYPE_FLOAT32 = 0, DTYPE_BFLOAT16 = 1 };
/* Return codes; engine/attention/cpu_kernels.py turns them into exceptions. */
enum { OK = 0, ERR_NO_MEMORY = 1, ERR_BAD_SHAPE = 2, ERR_BAD_SEQ_LEN = 3, ERR_BAD_BLOCK_ID = 4, ERR_UNSUPPORTED = 5 };

#define KEY_TILE 64       /* keys per tile; also the row stride of score and transposed-K tiles */
#define PREFILL_ROWS 64   /* at most this many (query token, head) rows per prefill work item */
#define LOG2E 1.4426950408889634f

typedef struct {
    const void *k, *v;
    int64_t k_block_stride, k_slot_stride, k_head_stride; /* in elements */
    int64_t v_block_stride, v_slot_stride, v_head_stride;
    int64_t num_blocks;
    int32_t dtype, block_size, num_kv_heads, head_dim;
} kv_cache_t;

typedef struct {
    const void *q;
    void *out;
    int64_t q_token_stride, q_head_stride; /* in elements; head_dim is contiguous */
    int64_t out_token_stride, out_head_stride;
    int32_t dtype, num_heads;
} queries_t;

typedef struct {
    const int32_t *block_tables; /* [num_seqs, >= max_blocks_per_seq], rows block_table_stride apart */
    int64_t block_table_stride, max_blocks_per_seq;
    const int32_t *seq_lens;        /* context length incl. the new tokens */
    const int32_t *query_start_loc; /* prefill: [num_seqs + 1] offsets into the query rows */
    int32_t num_seqs;
} seqs_t;

int tandem_abi_version(void) { return ABI_VERSION; }

/* ------------------------------------------------------------------------ conversions */

static inline void bf16_row_to_f32(float *restrict dst, const uint16_t *restrict src, int n) {
    int i = 0;
#if HAVE_AVX512
    for (; i + 16 <= n; i += 16) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
#endif
    for (; i < n; i++) dst[i] = bf16_to_f32(src[i]);
}

/* A row of a float32 or bfloat16 buffer as float32: a pointer into the buffer itself when it is
 * float32, else the row converted into `scratch`. `row` is an offset in elements. */
static inline const float *row_f32(const void *base, int32_t dtype, int64_t row, int n,
                                   float *restrict scratch) {
    if (dtype == DTYPE_FLOAT32) return (const float *)base + row;
    bf16_row_to_f32(scratch, (const uint16_t *)base + row, n);
    return scratch;
}

static inline void store_row(void *base, int32_t dtype, int64_t row, const float *restrict src,
                             float factor, int n) {
    if (dtype == DTYPE_FLOAT32) {
        float *dst = (float *)base + row;
        for (int i = 0; i < n; i++) dst[i] = src[i] * factor;
    } else {
        uint16_t *dst = (uint16_t *)base + row;
        for (int i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i] * factor);
    }
}

/* ------------------------------------------------------------------------------ exp2 */

/* 2^x for x <= 0 (softmax arguments), relative error ~2e-7: 2^n * 2^f with n = round(x),
 * f in [-0.5, 0.5] and a degree-6 Taylor polynomial of e^(f ln 2). Branch-free so loops
 * calling it vectorize; libm's exp2f would not without -ffast-math. */
static inline float exp2_nonpositive(float x) {
    x = x < -126.0f ? -126.0f : x;
    float n = (x + 12582912.0f) - 12582912.0f; /* round to nearest via the 1.5 * 2^23 trick */
    float f = (x - n) * 0.6931471805599453f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120
                  + f * (1.0f / 720))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#if HAVE_AVX512
/* 2^x as exp2_nonpositive, 16 lanes, for any x up to 127: the AMX prefill's lazily rescaled
 * softmax passes arguments up to AMX_RESCALE_LOG2 above 0. */
static inline __m512 exp2_softmax_512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f)); /* also maps -inf to a finite argument */
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.6931471805599453f));
    return exp_reduced_512(f, n);
}

/* 2^x for finite x up to 127, for softmax weights that are rounded to bfloat16 next (8
 * significant bits, a relative step of 2^-8): 2^n * 2^f with n = round(x) and a degree-3
 * polynomial of 2^f on [-0.5, 0.5] fitted for the least largest relative error (7.5e-5, against
 * exp2_softmax_512's 2e-7 from twice the work). -inf gives NaN: mask such lanes afterwards. */
static inline __m512 exp2_weights_512(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.05517080361273978f), f, _mm512_set1_ps(0.24260927398462456f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6932609565340911f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999281901548591f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* Online softmax over one row's tile of log2-domain scores: turns scores[0..n) into weights
 * relative to the new running max, zeroes scores[n..width) (keys this row may not see) and
 * returns the factor that rescales the row's earlier sum and accumulator. */
static float softmax_tile(float *restrict scores, int n, int width, float *running_max,
                          float *running_sum) {
    if (n <= 0) {
        memset(scores, 0, sizeof(float) * width);
        return 1.0f;
    }
    float tile_max = -INFINITY, sum = 0.0f;
    int j = 0;
#if HAVE_AVX512
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(scores + j));
    tile_max = _mm512_reduce_max_ps(vmax);
#endif
    for (; j < n; j++) tile_max = scores[j] > tile_max ? scores[j] : tile_max;
    const float new_max = tile_max > *running_max ? tile_max : *running_max;
    const float alpha = *running_max == -INFINITY ? 0.0f : exp2_nonpositive(*running_max - new_max);
    j = 0;
#if HAVE_AVX512
    __m512 vsum = _mm512_setzero_ps();
    const __m512 vnew_max = _mm512_set1_ps(new_max);
    for (; j < n; j += 16) {
        const __mmask16 live = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, scores + j), vnew_max);
        const __m512 p = _mm512_maskz_mov_ps(live, exp2_softmax_512(x));
        vsum = _mm512_add_ps(vsum, p);
        _mm512_mask_storeu_ps(scores + j, live, p);
    }
    sum = _mm512_reduce_add_ps(vsum);
#else
    for (; j < n; j++) {
        scores[j] = exp2_nonpositive(scores[j] - new_max);
        sum += scores[j];
    }
#endif
    for (j = n; j < width; j++) scores[j] = 0.0f;
    *running_max = new_max;
    *running_sum = *running_sum * alpha + sum;
    return alpha;
}

/* ------------------------------------------------------------------------- tile products */

#if HAVE_AVX512
/* out[j] = the sum of v[j]'s 16 lanes, for 16 vectors: a transposing tree of adds instead of
 * 16 separate horizontal sums. */
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 quads[4];
    for (int g = 0; g < 4; g++) {
        const __m512 *w = v + 4 * g;
        /* pairs: [w0 w1 w0 w1] partial sums per 128-bit lane, then [w0 w1 w2 w3] */
        const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
        const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(w[2], w[3]), _mm512_unpackhi_ps(w[2], w[3]));
        quads[g] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    }
    /* each 128-bit lane of quads[g] holds that lane's sums of vectors 4g..4g+3: add the lanes */
    const __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xdd));
    const __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xdd));
}
#endif

/* scores[r * KEY_TILE + j] = q_r . k_j for `rows` query rows against n key rows (decode: few
 * rows, so dots of whole rows beat transposing the tile). k must hold n rounded up to 16
 * pointers; scores past n are garbage. */
static void tile_dots(float *restrict scores, const float *restrict q, const float *const *k,
                      int rows, int n, int d) {
#if HAVE_AVX512
    if (d % 16 == 0) {
        for (int r = 0; r < rows; r++) {
            const float *restrict qr = q + (int64_t)r * d;
            for (int j0 = 0; j0 < n; j0 += 16) {
                __m512 acc[16];
                for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
                for (int i = 0; i < d; i += 16) {
                    const __m512 qi = _mm512_loadu_ps(qr + i);
                    for (int j = 0; j < 16; j++)
                        acc[j] = _mm512_fmadd_ps(qi, _mm512_loadu_ps(k[j0 + j] + i), acc[j]);
                }
                _mm512_storeu_ps(scores + r * KEY_TILE + j0, sum_lanes16(acc));
            }
        }
        return;
    }
#endif
    for (int j = 0; j < n; j++) {
        const float *restrict kj = k[j];
        for (int r = 0; r < rows; r++) {
            const float *restrict qr = q + (int64_t)r * d;
            float s = 0.0f;
            for (int i = 0; i < d; i++) s += qr[i] * kj[i];
            scores[r * KEY_TILE + j] = s;
        }
    }
}

/* scores[r * KEY_TILE + j] = q_r . k_j for all KEY_TILE columns of a transposed K tile
 * (kt[i * KEY_TILE + j] is element i of key j): prefill's many rows share each loaded column. */
static void tile_scores_transposed(float *restrict scores, const float *restrict q,
                                   const float *restrict kt, int rows, int d) {
    int r = 0;
#if HAVE_AVX512
    for (; r + 4 <= rows; r += 4) { /* 4 rows x 64 keys = 16 accumulators */
        __m512 acc[4][4];
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < 4; c++) acc[a][c] = _mm512_setzero_ps();
        for (int i = 0; i < d; i++) {
            const float *col = kt + (int64_t)i * KEY_TILE;
            const __m512 k0 = _mm512_loadu_ps(col), k1 = _mm512_loadu_ps(col + 16);
            const __m512 k2 = _mm512_loadu_ps(col + 32), k3 = _mm512_loadu_ps(col + 48);
            for (int a = 0; a < 4; a++) {
                const __m512 qa = _mm512_set1_ps(q[(int64_t)(r + a) * d + i]);
                acc[a][0] = _mm512_fmadd_ps(qa, k0, acc[a][0]);
                acc[a][1] = _mm512_fmadd_ps(qa, k1, acc[a][1]);
                acc[a][2] = _mm512_fmadd_ps(qa, k2, acc[a][2]);
                acc[a][3] = _mm512_fmadd_ps(qa, k3, acc[a][3]);
            }
        }
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(scores + (r + a) * KEY_TILE + 16 * c, acc[a][c]);
    }
#endif
    for (; r < rows; r++) {
        float s[KEY_TILE] = {0};
        const float *restrict qr = q + (int64_t)r * d;
        for (int i = 0; i < d; i++) {
            const float *restrict col = kt + (int64_t)i * KEY_TILE;
            for (int j = 0; j < KEY_TILE; j++) s[j] += qr[i] * col[j];
        }
        memcpy(scores + r * KEY_TILE, s, sizeof s);
    }
}

#if HAVE_AVX512
/* tile_values for rows [r, r + R) and columns [c0, c0 + 16 * C), R and C at most 4: the R x C
 * accumulators stay in registers while each value row is loaded once for all R rows. Always
 * inlined with constant R and C, so the loops unroll completely. */
static inline __attribute__((always_inline)) void values_block(
        float *restrict acc, const float *restrict alpha, const float *restrict p,
        const float *const *v, int n, int d, int r, int c0, const int R, const int C) {
    __m512 o[4][4], vj[4];
    for (int a = 0; a < R; a++)
        for (int c = 0; c < C; c++)
            o[a][c] = _mm512_mul_ps(_mm512_set1_ps(alpha[r + a]),
                                    _mm512_loadu_ps(acc + (int64_t)(r + a) * d + c0 + 16 * c));
    for (int j = 0; j < n; j++) {
        for (int c = 0; c < C; c++) vj[c] = _mm512_loadu_ps(v[j] + c0 + 16 * c);
        for (int a = 0; a < R; a++) {
            const __m512 pa = _mm512_set1_ps(p[(r + a) * KEY_TILE + j]);
            for (int c = 0; c < C; c++) o[a][c] = _mm512_fmadd_ps(pa, vj[c], o[a][c]);
        }
    }
    for (int a = 0; a < R; a++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + (int64_t)(r + a) * d + c0 + 16 * c, o[a][c]);
}

/* values_block over all columns for rows [r, r + rows), rows at most 4: the switch turns the
 * run-time row count into the constant values_block unrolls for. */
static void values_rows(float *restrict acc, const float *restrict alpha, const float *restrict p,
                        const float *const *v, int n, int d, int r, int rows) {
    int c0 = 0;
    for (; c0 + 64 <= d; c0 += 64) {
        switch (rows) {
        case 4: values_block(acc, alpha, p, v, n, d, r, c0, 4, 4); break;
        case 3: values_block(acc, alpha, p, v, n, d, r, c0, 3, 4); break;
        case 2: values_block(acc, alpha, p, v, n, d, r, c0, 2, 4); break;
        default: values_block(acc, alpha, p, v, n, d, r, c0, 1, 4); break;
        }
    }
    for (; c0 < d; c0 += 16) {
        switch (rows) {
        case 4: values_block(acc, alpha, p, v, n, d, r, c0, 4, 1); break;
        case 3: values_block(acc, alpha, p, v, n, d, r, c0, 3, 1); break;
        case 2: values_block(acc, alpha, p, v, n, d, r, c0, 2, 1); break;
        default: values_block(acc, alpha, p, v, n, d, r, c0, 1, 1); break;
        }
    }
}
#endif

/* acc_r = acc_r * alpha_r + sum_j p[r * KEY_TILE + j] * v_j for `rows` rows and n value rows. */
static void tile_values(float *restrict acc, const float *restrict alpha, const float *restrict p,
                        const float *const *v, int rows, int n, int d) {
#if HAVE_AVX512
    if (d % 16 == 0) {
        for (int r = 0; r < rows; r += 4) values_rows(acc, alpha, p, v, n, d, r, rows - r < 4 ? rows - r : 4);
        return;
    }
#endif
    for (int r = 0; r < rows; r++) {
        float *restrict ar = acc + (int64_t)r * d;
        const float *restrict pr = p + r * KEY_TILE;
        for (int i = 0; i < d; i++) ar[i] *= alpha[r];
        for (int j = 0; j < n; j++) {
            const float *restrict vj = v[j];
            for (int i = 0; i < d; i++) ar[i] += pr[j] * vj[i];
        }
    }
}

/* --------------------------------------------------------------------------- paging */

/* Whether the blocks holding positions [start, start + n) are real blocks of the cache. */
static inline int blocks_valid(const int32_t *block_table, int32_t start, int n,
                               const kv_cache_t *kv) {
    for (int32_t b = start / kv->block_size; b <= (start + n - 1) / kv->block_size; b++)
        if (block_table[b] < 0 || block_table[b] >= kv->num_blocks) return 0;
    return 1;
}

/* Whether sequence `seq`'s context fits its block-table row. */
static inline int context_valid(const seqs_t *seqs, const kv_cache_t *kv, int seq) {
    const int32_t seq_len = seqs->seq_lens[seq];
    return seq_len >= 0 && seq_len <= seqs->max_blocks_per_seq * kv->block_size;
}

/* Element offsets of the K (`which` 0) or V (1) rows of positions [start, start + n) in their
 * cache, each row prefetched together with the rows of the next `more_heads` KV heads (which a
 * caller walking several heads reads next: one token's heads lie side by side). */
static void tile_offsets(int64_t *restrict offsets, const kv_cache_t *kv, int which,
                         const int32_t *table, int32_t start, int n, int kv_head, int more_heads) {
    const void *cache = which ? kv->v : kv->k;
    const int64_t block_stride = which ? kv->v_block_stride : kv->k_block_stride;
    const int64_t slot_stride = which ? kv->v_slot_stride : kv->k_slot_stride;
    const int64_t head_stride = which ? kv->v_head_stride : kv->k_head_stride;
    const int elem_bytes = kv->dtype == DTYPE_FLOAT32 ? 4 : 2;
    const int64_t span_bytes = ((int64_t)more_heads * head_stride + kv->head_dim) * elem_bytes;
    /* position p is slot p % block_size of block block_table[p / block_size]; walk the slots
     * instead of dividing per row */
    int32_t block_index = start / kv->block_size, slot = start % kv->block_size;
    int64_t block_base = (int64_t)table[block_index] * block_stride + (int64_t)kv_head * head_stride;
    for (int j = 0; j < n; j++) {
        if (slot == kv->block_size) {
            slot = 0;
            block_base = (int64_t)table[++block_index] * block_stride + (int64_t)kv_head * head_stride;
        }
        offsets[j] = block_base + (int64_t)slot++ * slot_stride;
        /* Rows are scattered over blocks: ask for all of them before the first is used, so
         * their cache misses overlap instead of stalling the products one row at a time. */
        const char *bytes = (const char *)cache + offsets[j] * elem_bytes;
        for (int64_t b = 0; b < span_bytes; b += 64) __builtin_prefetch(bytes + b);
    }
}

/* Float32 views of the K (`which` 0) or V (1) rows of positions [start, start + n): pointers
 * into the cache when it is float32, else rows converted into buf (row j at buf + j * d). */
static void tile_rows(const float **rows, float *restrict buf, const kv_cache_t *kv, int which,
                      const int32_t *table, int32_t start, int n, int kv_head, int more_heads) {
    int64_t offsets[KEY_TILE];
    tile_offsets(offsets, kv, which, table, start, n, kv_head, more_heads);
    const void *cache = which ? kv->v : kv->k;
    const int d = kv->head_dim;
    for (int j = 0; j < n; j++) rows[j] = row_f32(cache, kv->dtype, offsets[j], d, buf + (int64_t)j * d);
}

/* Query rows [0, rows) scaled into the log2 domain: row r is token first_token + r / group,
 * head first_head + r % group. */
static void load_queries(float *restrict q, float *restrict scratch, const queries_t *qs,
                         int64_t first_token, int first_head, int group, int rows, int d,
                         float q_scale) {
    for (int r = 0; r < rows; r++) {
        const int64_t token = first_token + r / group;
        const int head = first_head + r % group;
        const float *src = row_f32(qs->q, qs->dtype, token * qs->q_token_stride + head * qs->q_head_stride,
                                   d, scratch);
        for (int i = 0; i < d; i++) q[(int64_t)r * d + i] = src[i] * q_scale;
    }
}

static void store_outputs(const queries_t *qs, const float *acc, const float *running_sum,
                          int64_t first_token, int first_head, int group, int rows, int d) {
    for (int r = 0; r < rows; r++) {
        const int64_t token = first_token + r / group;
        const int head = first_head + r % group;
        /* a row that saw no keys (an empty context: batch padding) yields zeros */
        const float inv_sum = running_sum[r] > 0.0f ? 1.0f / running_sum[r] : 0.0f;
        store_row(qs->out, qs->dtype, token * qs->out_token_stride + head * qs->out_head_stride,
                  acc + (int64_t)r * d, inv_sum, d);
    }
}

/* Per-thread buffers. */
typedef struct {
    float *q, *acc, *scores, *k_buf, *v_buf, *kt, *row, *alpha, *running_max, *running_sum;
    const float **k_rows, **v_rows;
} scratch_t;

static void *alloc_bytes(size_t n) {
    return aligned_alloc(64, (n + 63) & ~(size_t)63);
}

/* kt (the transposed K tile) only for prefill. */
static int scratch_alloc(scratch_t *s, int max_rows, int d, int with_kt) {
    memset(s, 0, sizeof *s);
    s->q = alloc_bytes(sizeof(float) * max_rows * d);
    s->acc = alloc_bytes(sizeof(float) * max_rows * d);
    s->scores = alloc_bytes(sizeof(float) * max_rows * KEY_TILE);
    s->k_buf = alloc_bytes(sizeof(float) * KEY_TILE * d);
    s->v_buf = alloc_bytes(sizeof(float) * KEY_TILE * d);
    s->kt = with_kt ? alloc_bytes(sizeof(float) * KEY_TILE * d) : NULL;
    s->row = alloc_bytes(sizeof(float) * d);
    s->alpha = alloc_bytes(sizeof(float) * max_rows);
    s->running_max = alloc_bytes(sizeof(float) * max_rows);
    s->running_sum = alloc_bytes(sizeof(float) * max_rows);
    s->k_rows = alloc_bytes(sizeof(float *) * KEY_TILE);
    s->v_rows = alloc_bytes(sizeof(float *) * KEY_TILE);
    if (!(s->q && s->acc && s->scores && s->k_buf && s->v_buf && (s->kt || !with_kt) && s->row && s->alpha
          && s->running_max && s->running_sum && s->k_rows && s->v_rows))
        return 0;
    /* columns of a short last tile are multiplied but never used: keep them finite */
    if (with_kt) memset(s->kt, 0, sizeof(float) * KEY_TILE * d);
    return 1;
}

static void scratch_free(scratch_t *s) {
    free(s->q); free(s->acc); free(s->scores); free(s->k_buf); free(s->v_buf); free(s->kt);
    free(s->row); free(s->alpha); free(s->running_max); free(s->running_sum);
    free(s->k_rows); free(s->v_rows);
}

static void reset_rows(scratch_t *s, int rows, int d) {
    memset(s->acc, 0, sizeof(float) * rows * d);
    for (int r = 0; r < rows; r++) {
        s->running_max[r] = -INFINITY;
        s->running_sum[r] = 0.0f;
    }
}

/* -------------------------------------------------------------------- bfloat16 products */

#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
/* A bfloat16 item's buffers: queries, the V tile as key pairs (decode; prefill packs its tiles
 * once per call), the softmax weights in bfloat16. */
typedef struct {
    uint16_t *q;   /* [rows][d] */
    uint16_t *vp;  /* [KEY_TILE / 2][d][2]: key pair m, dim i = (v[2m][i], v[2m + 1][i]) */
    uint16_t *p;   /* [rows][KEY_TILE] */
} bf16_scratch_t;

static int bf16_scratch_alloc(bf16_scratch_t *b, int max_rows, int d) {
    b->q = alloc_bytes(sizeof(uint16_t) * max_rows * d);
    b->vp = alloc_bytes(sizeof(uint16_t) * KEY_TILE * d);
    b->p = alloc_bytes(sizeof(uint16_t) * max_rows * KEY_TILE);
    if (!(b->q && b->vp && b->p)) return 0;
    /* key pairs past a short last tile are multiplied by zero weights: keep them finite */
    memset(b->vp, 0, sizeof(uint16_t) * KEY_TILE * d);
    return 1;
}

static void bf16_scratch_free(bf16_scratch_t *b) { free(b->q); free(b->vp); free(b->p); }

/* scores[r * KEY_TILE + j] = scale * q_r . k_j over the transposed tile, `rows` rows: each
 * vdpbf16ps multiplies 16 keys by a pair of query dimensions, summing in float32. */
static void tile_scores_bf16(float *restrict scores, const uint16_t *restrict q, const uint32_t *restrict kt,
                             int rows, int d, float scale) {
    const __m512 vscale = _mm512_set1_ps(scale);
    int r = 0;
    for (; r < rows; r += 4) {
        const int R = rows - r < 4 ? rows - r : 4;
        __m512 acc[4][4];
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < 4; c++) acc[a][c] = _mm512_setzero_ps();
        const uint32_t *q32[4];
        for (int a = 0; a < 4; a++) q32[a] = (const uint32_t *)(q + (int64_t)(r + (a < R ? a : 0)) * d);
        for (int pi = 0; pi < d / 2; pi++) {
            const uint32_t *col = kt + (int64_t)pi * KEY_TILE;
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(col), k1 = (__m512bh)_mm512_loadu_si512(col + 16);
            const __m512bh k2 = (__m512bh)_mm512_loadu_si512(col + 32), k3 = (__m512bh)_mm512_loadu_si512(col + 48);
            for (int a = 0; a < 4; a++) {
                const __m512bh qa = (__m512bh)_mm512_set1_epi32((int)q32[a][pi]);
                acc[a][0] = _mm512_dpbf16_ps(acc[a][0], k0, qa);
                acc[a][1] = _mm512_dpbf16_ps(acc[a][1], k1, qa);
                acc[a][2] = _mm512_dpbf16_ps(acc[a][2], k2, qa);
                acc[a][3] = _mm512_dpbf16_ps(acc[a][3], k3, qa);
            }
        }
        for (int a = 0; a < R; a++)
            for (int c = 0; c < 4; c++)
                _mm512_storeu_ps(scores + (r + a) * KEY_TILE + 16 * c, _mm512_mul_ps(acc[a][c], vscale));
    }
}

/* scores[r * KEY_TILE + j] = scale * q_r . k_j for `rows` query rows against n keys read where
 * they lie in the bfloat16 cache (decode: few rows, so dots of whole rows, as tile_dots): each
 * vdpbf16ps multiplies 32 dimensions of a key by the query's, summing pairs in float32. offsets
 * must hold n rounded up to 16 entries; scores past n are garbage. d is a multiple of 32. */
static void tile_dots_bf16(float *restrict scores, const uint16_t *restrict q, const void *cache,
                           const int64_t *offsets, int rows, int n, int d, float scale) {
    const uint16_t *k = cache;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < rows; r++) {
        const uint16_t *restrict qr = q + (int64_t)r * d;
        for (int j0 = 0; j0 < n; j0 += 16) {
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int i = 0; i < d; i += 32) {
                const __m512bh qi = (__m512bh)_mm512_loadu_si512(qr + i);
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(k + offsets[j0 + j] + i), qi);
            }
            _mm512_storeu_ps(scores + r * KEY_TILE + j0, _mm512_mul_ps(sum_lanes16(acc), vscale));
        }
    }
}

/* The K rows of a tile, bfloat16 in the cache, transposed into dimension pairs; columns past n
 * zero. */
static void transpose_keys_bf16(uint32_t *restrict kt, const uint16_t *cache, const int64_t *offsets, int n, int d) {
    for (int j = 0; j < n; j++) {
        const uint32_t *row = (const uint32_t *)(cache + offsets[j]);
        for (int pi = 0; pi < d / 2; pi++) kt[(int64_t)pi * KEY_TILE + j] = row[pi];
    }
    for (int pi = 0; pi < d / 2; pi++)
        for (int j = n; j < KEY_TILE; j++) kt[(int64_t)pi * KEY_TILE + j] = 0;
}

/* The V rows of a tile, bfloat16 in the cache, interleaved in key pairs: for pair m and 16
 * dimensions one vector (v[2m][i], v[2m + 1][i]) for i in those 16. An odd last key pairs with
 * zeros. d is a multiple of 32. */
static void pair_values_bf16(uint16_t *restrict vp, const uint16_t *cache, const int64_t *offsets, int n, int d) {
    /* lane 2i takes element i of the first row, lane 2i + 1 element i of the second (+32) */
    static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                        24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_loadu_si512(lo_idx), hi = _mm512_loadu_si512(hi_idx);
    for (int m = 0; 2 * m < n; m++) {
        const uint16_t *a = cache + offsets[2 * m];
        const uint16_t *b = 2 * m + 1 < n ? cache + offsets[2 * m + 1] : NULL;
        uint16_t *dst = vp + (int64_t)m * 2 * d;
        for (int i = 0; i < d; i += 32) {
            const __m512i va = _mm512_loadu_si512(a + i);
            const __m512i vb = b ? _mm512_loadu_si512(b + i) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + 2 * i, _mm512_permutex2var_epi16(va, lo, vb));
            _mm512_storeu_si512(dst + 2 * i + 32, _mm512_permutex2var_epi16(va, hi, vb));
        }
    }
}

/* acc_r = acc_r * alpha_r + sum_j p_r[j] v_j with the weights in bfloat16, key pairs at a time. */
static inline __attribute__((always_inline)) void values_block_bf16(
        float *restrict acc, const float *restrict alpha, const uint16_t *restrict p,
        const uint16_t *restrict vp, int pairs, int d, int r, int c0, const int R, const int C) {
    __m512 o[4][4];
    for (int a = 0; a < R; a++)
        for (int c = 0; c < C; c++)
            o[a][c] = _mm512_mul_ps(_mm512_set1_ps(alpha[r + a]),
                                    _mm512_loadu_ps(acc + (int64_t)(r + a) * d + c0 + 16 * c));
    for (int m = 0; m < pairs; m++) {
        __m512bh vm[4];
        for (int c = 0; c < C; c++)
            vm[c] = (__m512bh)_mm512_loadu_si512(vp + (int64_t)m * 2 * d + 2 * (c0 + 16 * c));
        for (int a = 0; a < R; a++) {
            const __m512bh pa = (__m512bh)_mm512_set1_epi32(((const int32_t *)(p + (r + a) * KEY_TILE))[m]);
            for (int c = 0; c < C; c++) o[a][c] = _mm512_dpbf16_ps(o[a][c], vm[c], pa);
        }
    }
    for (int a = 0; a < R; a++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + (int64_t)(r + a) * d + c0 + 16 * c, o[a][c]);
}

static void tile_values_bf16(float *restrict acc, const float *restrict alpha, const float *restrict scores,
                             uint16_t *restrict p, const uint16_t *restrict vp, int rows, int n, int d) {
    for (int r = 0; r < rows; r++) {           /* weights to bfloat16, (p_2m, p_2m+1) adjacent */
        const float *sr = scores + r * KEY_TILE;
        __m512i *pr = (__m512i *)(p + r * KEY_TILE);
        _mm512_storeu_si512(pr, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + 16), _mm512_loadu_ps(sr)));
        _mm512_storeu_si512(pr + 1, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + 48), _mm512_loadu_ps(sr + 32)));
    }
    const int pairs = (n + 1) / 2;
    /* columns past n are not weights (softmax_tile leaves them as they were): an odd tile's last
     * pair reads column n, against the zero row, so it must be a real 0 */
    if (n % 2)
        for (int r = 0; r < rows; r++) p[r * KEY_TILE + n] = 0;
    for (int r = 0; r < rows; r += 4) {
        const int R = rows - r < 4 ? rows - r : 4;
        for (int c0 = 0; c0 < d; c0 += 64) {
            if (d - c0 >= 64) {
                switch (R) {
                case 4: values_block_bf16(acc, alpha, p, vp, pairs, d, r, c0, 4, 4); break;
                case 3: values_block_bf16(acc, alpha, p, vp, pairs, d, r, c0, 3, 4); break;
                case 2: values_block_bf16(acc, alpha, p, vp, pairs, d, r, c0, 2, 4); break;
                default: values_block_bf16(acc, alpha, p, vp, pairs, d, r, c0, 1, 4); break;
                }
            } else {                            /* d % 64 == 32: the last 32 dimensions */
                switch (R) {
                case 4: values_block_bf16(acc, alpha, p, vp, pairs, d, r, c0, 4, 2); break;
                case 3: values_block_bf16(acc, alpha, p, vp, pairs, d, r, c0, 3, 2); break;
                case 2: values_block_bf16(acc, alpha, p, vp, pairs, d, r, c0, 2, 2); break;
                default: values_block_bf16(acc, alpha, p, vp, pairs, d, r, c0, 1, 2); break;
                }
            }
        }
    }
}
#else
#define HAVE_BF16_DOT 0
#endif

/* ------------------------------------------------------------------------------ decode */

/* A decode unit: keys [start, end) of sequence seq's context, all of it or one partition of a
 * long one. partial is the partition's slot in partials_t, or -1 for a whole context, whose
 * items write the output rows themselves. */
typedef struct {
    int32_t seq, start, end, partial;
} unit_t;

/* A split context: its partitions hold partial slots [first_partial, + num_parts). */
typedef struct {
    int32_t seq, first_partial, num_parts;
} split_t;

/* What all decode items of one call share. A split context's partitions leave, per query head,
 * their accumulator (not divided by the sum), running max (log2 domain) and sum in
 * partial_acc / partial_max_sum, for the log-sum-exp merge. */
typedef struct {
    const queries_t *qs;
    const kv_cache_t *kv;
    const seqs_t *seqs;
    float *partial_acc;     /* [num_partials][num_heads][d] */
    float *partial_max_sum; /* [num_partials][num_heads][2] */
    float scale;
    int group, d, heads_per_item, use_bf16;
} decode_job_t;

/* Scores, softmax and values of one tile of n keys at `start` for one KV head's GQA group,
 * rows [row0, row0 + group) of the item's scratch; float32 products (bfloat16 rows converted). */
static void decode_tile_f32(scratch_t *s, const decode_job_t *job, const int32_t *table, int32_t start,
                            int n, int kv_head, int more_heads, int row0) {
    const int group = job->group, d = job->d;
    tile_rows(s->k_rows, s->k_buf, job->kv, 0, table, start, n, kv_head, more_heads);
    for (int j = n; j % 16; j++) s->k_rows[j] = s->k_rows[0]; /* tile_dots reads 16 at a time */
    tile_rows(s->v_rows, s->v_buf, job->kv, 1, table, start, n, kv_head, more_heads);
    tile_dots(s->scores + row0 * KEY_TILE, s->q + (int64_t)row0 * d, s->k_rows, group, n, d);
    for (int r = row0; r < row0 + group; r++)
        s->alpha[r] = softmax_tile(s->scores + r * KEY_TILE, n, n, &s->running_max[r], &s->running_sum[r]);
    tile_values(s->acc + (int64_t)row0 * d, s->alpha + row0, s->scores + row0 * KEY_TILE, s->v_rows, group, n, d);
}

#if HAVE_BF16_DOT
/* decode_tile_f32 with vdpbf16ps products straight from the bfloat16 cache: queries as they
 * came (bfloat16, exact), the softmax weights rounded to bfloat16 for the values. */
static void decode_tile_bf16(scratch_t *s, bf16_scratch_t *b, const decode_job_t *job, const int32_t *table,
                             int32_t start, int n, int kv_head, int more_heads, int row0) {
    const int group = job->group, d = job->d;
    int64_t k_offsets[KEY_TILE], v_offsets[KEY_TILE];
    tile_offsets(k_offsets, job->kv, 0, table, start, n, kv_head, more_heads);
    for (int j = n; j % 16; j++) k_offsets[j] = k_offsets[0]; /* tile_dots_bf16 reads 16 at a time */
    tile_offsets(v_offsets, job->kv, 1, table, start, n, kv_head, more_heads);
    tile_dots_bf16(s->scores + row0 * KEY_TILE, b->q + (int64_t)row0 * d, job->kv->k, k_offsets, group, n, d,
                   job->scale * LOG2E);
    for (int r = row0; r < row0 + group; r++)
        s->alpha[r] = softmax_tile(s->scores + r * KEY_TILE, n, n, &s->running_max[r], &s->running_sum[r]);
    pair_values_bf16(b->vp, job->kv->v, v_offsets, n, d);
    tile_values_bf16(s->acc + (int64_t)row0 * d, s->alpha + row0, s->scores + row0 * KEY_TILE, b->p, b->vp,
                     group, n, d);
}
#endif

/* One decode work item: unit u's keys for KV heads [first_kv_head, + heads_per_item). */
static void decode_item(scratch_t *s, void *bf16_scratch, const decode_job_t *job, const unit_t *u,
                        int first_kv_head, int *status) {
    const queries_t *qs = job->qs;
    const int group = job->group, d = job->d, heads = job->heads_per_item, rows = group * heads;
    const int first_head = first_kv_head * group;
    const int32_t *table = job->seqs->block_tables + u->seq * job->seqs->block_table_stride;
#if HAVE_BF16_DOT
    bf16_scratch_t *b = bf16_scratch;
    if (job->use_bf16)
        for (int r = 0; r < rows; r++)
            memcpy(b->q + (int64_t)r * d, (const uint16_t *)qs->q + u->seq * qs->q_token_stride
                   + (first_head + r) * qs->q_head_stride, sizeof(uint16_t) * d);
    else
#else
    (void)bf16_scratch;
#endif
        load_queries(s->q, s->row, qs, u->seq, first_head, rows, rows, d, job->scale * LOG2E);
    reset_rows(s, rows, d);
    for (int32_t start = u->start; start < u->end; start += KEY_TILE) {
        const int n = u->end - start < KEY_TILE ? u->end - start : KEY_TILE;
        if (!blocks_valid(table, start, n, job->kv)) {
#pragma omp atomic write
            *status = ERR_BAD_BLOCK_ID;
            break;
        }
        for (int h = 0; h < heads; h++) {
            const int more = h == 0 ? heads - 1 : 0;
#if HAVE_BF16_DOT
            if (job->use_bf16)
                decode_tile_bf16(s, b, job, table, start, n, first_kv_head + h, more, h * group);
            else
#endif
                decode_tile_f32(s, job, table, start, n, first_kv_head + h, more, h * group);
        }
    }
    if (u->partial < 0) {
        store_outputs(qs, s->acc, s->running_sum, u->seq, first_head, rows, rows, d);
        return;
    }
    /* query head first_head + r of partition u->partial: slot u->partial * num_heads + that head */
    const int64_t slot = (int64_t)u->partial * qs->num_heads + first_head;
    memcpy(job->partial_acc + slot * d, s->acc, sizeof(float) * rows * d);
    for (int r = 0; r < rows; r++) {
        job->partial_max_sum[2 * (slot + r)] = s->running_max[r];
        job->partial_max_sum[2 * (slot + r) + 1] = s->running_sum[r];
    }
}

/* A split context's output rows from its partitions: each partition's accumulator and sum
 * rescaled to the largest of their maxima (log-sum-exp), summed in partition order. */
static void merge_partitions(const decode_job_t *job, const split_t *sp, float *restrict acc) {
    const queries_t *qs = job->qs;
    const int d = job->d;
    for (int head = 0; head < qs->num_heads; head++) {
        float max = -INFINITY, sum = 0.0f;
        for (int p = 0; p < sp->num_parts; p++) {
            const float m = job->partial_max_sum[2 * ((int64_t)(sp->first_partial + p) * qs->num_heads + head)];
            max = m > max ? m : max;
        }
        memset(acc, 0, sizeof(float) * d);
        for (int p = 0; p < sp->num_parts; p++) {
            const int64_t slot = (int64_t)(sp->first_partial + p) * qs->num_heads + head;
            const float m = job->partial_max_sum[2 * slot];
            const float w = m == -INFINITY ? 0.0f : exp2_nonpositive(m - max);
            const float *restrict part = job->partial_acc + slot * d;
            sum += w * job->partial_max_sum[2 * slot + 1];
            for (int i = 0; i < d; i++) acc[i] += w * part[i];
        }
        store_row(qs->out, qs->dtype, sp->seq * qs->out_token_stride + head * qs->out_head_stride, acc,
                  sum > 0.0f ? 1.0f / sum : 0.0f, d);
    }
}

/* Longest unit first; ties in sequence and position order, so the order is the same every call. */
static int longer_unit_first(const void *a, const void *b) {
    const unit_t *x = a, *y = b;
    const int32_t lx = x->end - x->start, ly = y->end - y->start;
    if (lx != ly) return lx > ly ? -1 : 1;
    if (x->seq != y->seq) return x->seq < y->seq ? -1 : 1;
    return x->start < y->start ? -1 : x->start > y->start;
}

/* One query token per sequence over its whole context: row i of the queries belongs to
 * sequence i. A context longer than partition_tokens (> 0) is split into partitions of that
 * many keys (the last one shorter), each its own work unit, merged by log-sum-exp once all are
 * done (flash-decoding), so one long context no longer leaves a thread idle. How a context is
 * split depends on its length alone, so results depend neither on the thread count nor on the
 * other sequences in the batch. A work item is a unit and a run of its KV heads, each read once
 * for its whole GQA group: all of them when there are units enough to keep every thread busy
 * and no unit is more than a thread's share of all of them (a token's heads lie side by side in
 * the pool, so the item streams whole blocks), else one. When the units' lengths are mixed,
 * items go to the threads longest first, each to the next free thread, so the threads end
 * together. */
int tandem_paged_decode(const queries_t *qs, const kv_cache_t *kv, const seqs_t *seqs, float scale,
                        int32_t num_threads, int32_t partition_tokens) {
    const int group = kv->num_kv_heads > 0 ? qs->num_heads / kv->num_kv_heads : 0;
    const int d = kv->head_dim;
    if (group < 1 || group * kv->num_kv_heads != qs->num_heads || d < 1) return ERR_BAD_SHAPE;
    int64_t total_len = 0, num_units = 0, num_partials = 0, num_splits = 0;
    for (int s = 0; s < seqs->num_seqs; s++) {
        if (!context_valid(seqs, kv, s)) return ERR_BAD_SEQ_LEN;
        const int32_t len = seqs->seq_lens[s];
        const int32_t parts = partition_tokens > 0 && len > partition_tokens
                              ? (len + partition_tokens - 1) / partition_tokens : 1;
        total_len += len;
        num_units += parts;
        if (parts > 1) {
            num_partials += parts;
            num_splits++;
        }
    }
    unit_t *units = malloc(sizeof(unit_t) * (num_units + 1));
    split_t *splits = malloc(sizeof(split_t) * (num_splits + 1));
    float *partial_acc = malloc(sizeof(float) * (num_partials * qs->num_heads * d + 1));
    float *partial_max_sum = malloc(sizeof(float) * (num_partials * qs->num_heads * 2 + 1));
    if (!(units && splits && partial_acc && partial_max_sum)) {
        free(units); free(splits); free(partial_acc); free(partial_max_sum);
        return ERR_NO_MEMORY;
    }
    int64_t u = 0, next_partial = 0, next_split = 0;
    int32_t max_unit = 0;
    for (int s = 0; s < seqs->num_seqs; s++) {
        const int32_t len = seqs->seq_lens[s];
        const int32_t step = partition_tokens > 0 && len > partition_tokens ? partition_tokens : (len > 0 ? len : 1);
        const int split = len > step;
        if (split) splits[next_split++] = (split_t){s, (int32_t)next_partial, (len + step - 1) / step};
        for (int32_t start = 0; start < len || start == 0; start += step) {
            const int32_t end = len - start < step ? len : start + step;
            units[u++] = (unit_t){s, start, end, split ? (int32_t)next_partial++ : -1};
            if (end - start > max_unit) max_unit = end - start;
        }
    }
    const int heads_per_item = num_units >= 2 * num_threads && (int64_t)max_unit * num_threads <= total_len
                               ? kv->num_kv_heads : 1;
    const int items_per_unit = kv->num_kv_heads / heads_per_item;
    const int64_t num_items = num_units * items_per_unit;
    /* Mixed lengths (a split context, whose last part is shorter and whose neighbours usually
     * are, or the longest unit over twice the mean): longest first, each item to the next free
     * thread. Else in order, in even shares: for equal contexts that measured up to 8% faster. */
    const int mixed = num_splits > 0 || (num_units > 0 && (int64_t)max_unit * num_units > 2 * total_len);
    if (mixed) qsort(units, num_units, sizeof(unit_t), longer_unit_first);
    const decode_job_t job = {qs, kv, seqs, partial_acc, partial_max_sum, scale, group, d, heads_per_item,
                              HAVE_BF16_DOT && kv->dtype == DTYPE_BFLOAT16 && qs->dtype == DTYPE_BFLOAT16
                              && d % 32 == 0};
    int status = OK;

#pragma omp parallel num_threads(num_threads)
    {
        scratch_t s;
        const int rows = group * heads_per_item;
#if HAVE_BF16_DOT
        bf16_scratch_t b = {0};
        const int ok = scratch_alloc(&s, rows, d, 0) && (!job.use_bf16 || bf16_scratch_alloc(&b, rows, d));
        void *bf16_scratch = &b;
#else
        const int ok = scratch_alloc(&s, rows, d, 0);
        void *bf16_scratch = NULL;
#endif
        if (!ok) {
#pragma omp atomic write
            status = ERR_NO_MEMORY;
        }
        if (mixed) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < num_items; item++)
                if (ok) decode_item(&s, bf16_scratch, &job, &units[item / items_per_unit],
                                    (int)(item % items_per_unit) * heads_per_item, &status);
        } else {
#pragma omp for schedule(static)
            for (int64_t item = 0; item < num_items; item++)
                if (ok) decode_item(&s, bf16_scratch, &job, &units[item / items_per_unit],
                                    (int)(item % items_per_unit) * heads_per_item, &status);
        }
        /* the loops' barrier: every partition is done */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_splits; i++)
            if (ok && status == OK) merge_partitions(&job, &splits[i], s.row);
        scratch_free(&s);
#if HAVE_BF16_DOT
        if (job.use_bf16) bf16_scratch_free(&b);
#endif
    }
    free(units); free(splits); free(partial_acc); free(partial_max_sum);
    return status;
}

/* ----------------------------------------------------------------------------- prefill */

/* Index of the sequence whose items include `item`: first_item is ascending, first_item[0] = 0. */
static int seq_of_item(const int64_t *first_item, int num_seqs, int64_t item) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first_item[mid] <= item) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Query tokens per prefill work item: as many as fit PREFILL_ROWS rows, rounded so the rows
 * fill the 4-row blocks of the tile products where that is possible. */
static int prefill_tokens_per_item(int group) {
    int tokens = group >= PREFILL_ROWS ? 1 : PREFILL_ROWS / group;
    while (tokens > 1 && (tokens * group) % 4) tokens--;
    return tokens;
}

/* Causal attention of prefill chunks over the cached prefix plus the chunk: query i of a chunk
 * of length L in a context of length S sits at position S - L + i and sees keys 0..S-L+i.
 * Work items are (sequence, kv head, run of query tokens). An item's rows are (query token,
 * head of the GQA group) pairs, row r = token r / group, head r % group, so each K/V tile is
 * loaded and transposed once for the whole group. */
int tandem_paged_prefill(const queries_t *qs, const kv_cache_t *kv, const seqs_t *seqs,
                         float scale, int32_t num_threads) {
    const int group = kv->num_kv_heads > 0 ? qs->num_heads / kv->num_kv_heads : 0;
    const int d = kv->head_dim;
    const int num_seqs = seqs->num_seqs;
    if (group < 1 || group * kv->num_kv_heads != qs->num_heads || d < 1) return ERR_BAD_SHAPE;
    const int tokens_per_item = prefill_tokens_per_item(group);
    const int max_rows = tokens_per_item * group;

    int64_t *first_item = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (!first_item) return ERR_NO_MEMORY;
    first_item[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int32_t q_len = seqs->query_start_loc[s + 1] - seqs->query_start_loc[s];
        if (q_len < 0 || q_len > seqs->seq_lens[s] || !context_valid(seqs, kv, s)) {
            free(first_item);
            return ERR_BAD_SEQ_LEN;
        }
        const int64_t runs = (q_len + tokens_per_item - 1) / tokens_per_item;
        first_item[s + 1] = first_item[s] + runs * kv->num_kv_heads;
    }
    const int64_t num_items = first_item[num_seqs];
    int status = OK;
    /* bfloat16 cache and queries: products in vdpbf16ps (weights rounded to bfloat16 for the
     * values, as GPU flash attention does), about twice the float32 FMAs' rate */
    const int use_bf16 = HAVE_BF16_DOT && kv->dtype == DTYPE_BFLOAT16 && qs->dtype == DTYPE_BFLOAT16 && d % 32 == 0;
#if HAVE_BF16_DOT
    /* ... and every (sequence, kv head)'s key tiles transposed and value tiles paired once per
     * call, before the items: tile t of kv head h of sequence s is packed tile first_tile[s] + h *
     * (its tiles) + t. Items of one kv head each read every tile up to their last query (a
     * 512-token chunk has 26 of them), so packing per item repeated the work that many times. */
    const int64_t kt_elems = (int64_t)(d / 2) * KEY_TILE, vp_elems = (int64_t)KEY_TILE * d;
    int64_t *first_tile = NULL;
    uint32_t *kt_all = NULL;
    uint16_t *vp_all = NULL;
    if (use_bf16) {
        first_tile = malloc(sizeof(int64_t) * (num_seqs + 1));
        if (first_tile) {
            first_tile[0] = 0;
            for (int s = 0; s < num_seqs; s++)
                first_tile[s + 1] = first_tile[s] + (int64_t)(seqs->seq_lens[s] + KEY_TILE - 1) / KEY_TILE
                                    * kv->num_kv_heads;
            kt_all = alloc_bytes(sizeof(uint32_t) * kt_elems * (first_tile[num_seqs] + 1));
            vp_all = alloc_bytes(sizeof(uint16_t) * vp_elems * (first_tile[num_seqs] + 1));
        }
        if (!(first_tile && kt_all && vp_all)) {
            free(first_tile); free(kt_all); free(vp_all); free(first_item);
            return ERR_NO_MEMORY;
        }
    }
#endif

#pragma omp parallel num_threads(num_threads)
    {
        scratch_t s;
#if HAVE_BF16_DOT
        bf16_scratch_t b = {0};
        const int ok = scratch_alloc(&s, max_rows, d, 1) && (!use_bf16 || bf16_scratch_alloc(&b, max_rows, d));
#else
        const int ok = scratch_alloc(&s, max_rows, d, 1);
#endif
        if (!ok) {
#pragma omp atomic write
            status = ERR_NO_MEMORY;
        }
#if HAVE_BF16_DOT
        if (use_bf16) {
#pragma omp for schedule(dynamic, 4)
            for (int64_t tile = 0; tile < first_tile[num_seqs]; tile++) {
                const int seq = seq_of_item(first_tile, num_seqs, tile);
                const int64_t local = tile - first_tile[seq], tiles = (first_tile[seq + 1] - first_tile[seq]) / kv->num_kv_heads;
                const int32_t k0 = (int32_t)(local % tiles) * KEY_TILE;
                const int n = seqs->seq_lens[seq] - k0 < KEY_TILE ? seqs->seq_lens[seq] - k0 : KEY_TILE;
                const int32_t *table = seqs->block_tables + seq * seqs->block_table_stride;
                if (!blocks_valid(table, k0, n, kv)) continue;   /* the items report it */
                int64_t k_offsets[KEY_TILE], v_offsets[KEY_TILE];
                tile_offsets(k_offsets, kv, 0, table, k0, n, (int)(local / tiles), 0);
                tile_offsets(v_offsets, kv, 1, table, k0, n, (int)(local / tiles), 0);
                transpose_keys_bf16(kt_all + tile * kt_elems, kv->k, k_offsets, n, d);
                pair_values_bf16(vp_all + tile * vp_elems, kv->v, v_offsets, n, d);
            }
        }
#endif
        /* dynamic: causal items differ in cost; each sequence's costliest (last) runs go first */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            if (!ok) continue;
            const int seq = seq_of_item(first_item, num_seqs, item);
            const int64_t local = item - first_item[seq];
            const int32_t q_begin = seqs->query_start_loc[seq];
            const int32_t q_len = seqs->query_start_loc[seq + 1] - q_begin;
            const int32_t context = seqs->seq_lens[seq] - q_len; /* cached tokens before the chunk */
            const int64_t num_runs = (q_len + tokens_per_item - 1) / tokens_per_item;
            const int32_t t0 = (int32_t)(num_runs - 1 - local / kv->num_kv_heads) * tokens_per_item;
            const int32_t t1 = t0 + tokens_per_item < q_len ? t0 + tokens_per_item : q_len;
            const int kv_head = (int)(local % kv->num_kv_heads);
            const int rows = (t1 - t0) * group;
            const int32_t *table = seqs->block_tables + seq * seqs->block_table_stride;

#if HAVE_BF16_DOT
            if (use_bf16)
                for (int r = 0; r < rows; r++)
                    memcpy(b.q + (int64_t)r * d, (const uint16_t *)qs->q + (q_begin + t0 + r / group) * qs->q_token_stride
                           + (kv_head * group + r % group) * qs->q_head_stride, sizeof(uint16_t) * d);
            else
#endif
                load_queries(s.q, s.row, qs, q_begin + t0, kv_head * group, group, rows, d, scale * LOG2E);
            reset_rows(&s, rows, d);
            const int32_t key_end = context + t1; /* the item's last query sees keys < key_end */
            for (int32_t k0 = 0; k0 < key_end; k0 += KEY_TILE) {
                const int n = key_end - k0 < KEY_TILE ? key_end - k0 : KEY_TILE;
                if (!blocks_valid(table, k0, n, kv)) {
#pragma omp atomic write
                    status = ERR_BAD_BLOCK_ID;
                    break;
                }
#if HAVE_BF16_DOT
                const int64_t tile = use_bf16 ? first_tile[seq] + (first_tile[seq + 1] - first_tile[seq])
                                                / kv->num_kv_heads * kv_head + k0 / KEY_TILE : 0;
                if (use_bf16)
                    tile_scores_bf16(s.scores, b.q, kt_all + tile * kt_elems, rows, d, scale * LOG2E);
                else
#endif
                {
                    tile_rows(s.k_rows, s.k_buf, kv, 0, table, k0, n, kv_head, 0);
                    for (int j = 0; j < n; j++)
                        for (int i = 0; i < d; i++) s.kt[i * KEY_TILE + j] = s.k_rows[j][i];
                    tile_rows(s.v_rows, s.v_buf, kv, 1, table, k0, n, kv_head, 0);
                    tile_scores_transposed(s.scores, s.q, s.kt, rows, d);
                }
                for (int token = 0, r = 0; r < rows; token++) {
                    /* rows of query token t0 + token sit at context + t0 + token and see keys up to there */
                    const int32_t last_key = context + t0 + token;
                    const int visible = last_key - k0 + 1 < n ? last_key - k0 + 1 : n;
                    for (int h = 0; h < group; h++, r++)
                        s.alpha[r] = softmax_tile(s.scores + r * KEY_TILE, visible, n,
                                                  &s.running_max[r], &s.running_sum[r]);
                }
#if HAVE_BF16_DOT
                if (use_bf16)
                    tile_values_bf16(s.acc, s.alpha, s.scores, b.p, vp_all + tile * vp_elems, rows, n, d);
                else
#endif
                    tile_values(s.acc, s.alpha, s.scores, s.v_rows, rows, n, d);
            }
            store_outputs(qs, s.acc, s.running_sum, q_begin + t0, kv_head * group, group, rows, d);
        }
        scratch_free(&s);
#if HAVE_BF16_DOT
        if (use_bf16) bf16_scratch_free(&b);
#endif
    }
#if HAVE_BF16_DOT
    free(first_tile); free(kt_all); free(vp_all);
#endif
    free(first_item);
    return status;
}

/* ------------------------------------------------------------------ prefill on AMX tiles */

/* tandem_paged_prefill_amx: tandem_paged_prefill's contract for bfloat16 queries and caches with
 * head_dim a multiple of 32 (at most AMX_MAX_HEAD_DIM) and block_size a multiple of 16, on the
 * AMX unit; ERR_UNSUPPORTED elsewhere (the caller keeps the other kernel).
 *
 * Scores are computed transposed, S^T = K Q^T: 16 keys of one cache block are the A tile as they
 * lie (rows a slot apart), and a work item's 16 queries of one head the B tile (head_dim pairs
 * interleaved, the VNNI layout). One column is one query, so the online softmax runs lane-wise
 * over the item's 16 queries, with no horizontal reductions. Values: O^T = V^T P^T. V^T is packed
 * once per call and (sequence, kv head), head_dim rows of keys, and P^T's rows are paired as the
 * B tile, gathered 16 keys at a time. The softmax rescales lazily (a lane's reference max moves
 * only when a step's max passes it by AMX_RESCALE_LOG2), the causal mask is applied only on the
 * diagonal steps, and O^T accumulates in the tiles where acc lies. As in the AVX512-BF16 kernel,
 * products are bfloat16 pairs summed in float32 and the softmax weights are rounded to bfloat16
 * for the values (their sum is not), so they come from a degree-3 exp2 (exp2_weights_512) and a
 * step's max is taken over unscaled scores in four chains (the scale must be positive). Work items are
 * (sequence, run of 16 query tokens, head), each sequence's last (costliest) runs first; each
 * output row is one thread's, in a fixed order, so results do not depend on the thread count. */
#define AMX_QUERIES 16
#define AMX_KEY_STEP 64   /* keys per softmax step: 4 score tiles, 2 value steps */
#define AMX_MAX_HEAD_DIM 256
#define AMX_RESCALE_LOG2 8.0f   /* lazy rescaling's slack (log2 domain): weights up to 2^8 */

#if HAVE_AMX
/* [a0..a15] and [b0..b15] as bfloat16 pairs [a0 b0 a1 b1 ...]: one VNNI row of P^T. */
static inline __m512i pair_rows_bf16(__m512 a, __m512 b) {
    const __m512i index = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(index, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

typedef struct {
    const queries_t *qs;
    const kv_cache_t *kv;
    const seqs_t *seqs;
    const uint16_t *vt;      /* V^T of every (sequence, kv head): head_dim rows of padded_len keys */
    const int64_t *vt_offset; /* [num_seqs]: where sequence s's kv heads start in vt */
    float scale_log2;
} amx_prefill_t;

static inline int32_t padded_len(int32_t seq_len) {
    return (seq_len + AMX_KEY_STEP - 1) / AMX_KEY_STEP * AMX_KEY_STEP;
}

/* V^T[kv_head][i][k] = V[k, kv_head, i] for keys k < seq_len, 0 up to padded_len. */
static void pack_values_transposed(const kv_cache_t *kv, const int32_t *table, int32_t seq_len, int kv_head,
                                   uint16_t *restrict vt) {
    const int d = kv->head_dim;
    const int64_t width = padded_len(seq_len);
    const uint16_t *cache = kv->v;
    int32_t k = 0;
    /* 16 keys at a time (a run of 16 slots never crosses a block: block_size % 16 == 0): one
     * gather takes dims (i, i + 1) of the 16 keys as 32-bit pairs, which split into two V^T rows */
    const __m512i slots = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32((int)kv->v_slot_stride));
    for (; k + 16 <= seq_len; k += 16) {
        const uint16_t *first = cache + table[k / kv->block_size] * kv->v_block_stride
                                + (k % kv->block_size) * kv->v_slot_stride + kv_head * kv->v_head_stride;
        for (int i = 0; i < d; i += 2) {
            const __m512i pairs = _mm512_i32gather_epi32(slots, (const void *)(first + i), 2);
            _mm256_storeu_si256((__m256i *)(vt + i * width + k), _mm512_cvtepi32_epi16(pairs));
            _mm256_storeu_si256((__m256i *)(vt + (i + 1) * width + k), _mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
        }
    }
    for (; k < seq_len; k++) {
        const uint16_t *row = cache + table[k / kv->block_size] * kv->v_block_stride
                              + (k % kv->block_size) * kv->v_slot_stride + kv_head * kv->v_head_stride;
        for (int i = 0; i < d; i++) vt[i * width + k] = row[i];
    }
    for (int i = 0; i < d; i++) memset(vt + i * width + seq_len, 0, sizeof(uint16_t) * (width - seq_len));
}

/* Scores of up to 16 keys from `rows` (a cache block's slots, one kv head) against the B tile
 * in tile 4, into tile T; tile ids are immediates, hence the macros. */
#define AMX_SCORES(T)                                                                          \
    if (nk > 16 * (T)) {                                                                      \
        _tile_loadd(5, key_rows[T] + c * 32, kv->k_slot_stride * 2);                          \
        _tile_dpbf16ps(T, 5, 4);                                                              \
    }
#define AMX_STORE_SCORES(T)                                                                    \
    if (nk > 16 * (T)) _tile_stored(T, scores + (T) * 256, 64);

static void amx_prefill_item(const amx_prefill_t *job, int seq, int32_t t0, int head) {
    const queries_t *qs = job->qs;
    const kv_cache_t *kv = job->kv;
    const int d = kv->head_dim, group = qs->num_heads / kv->num_kv_heads, kv_head = head / group;
    const int32_t q_begin = job->seqs->query_start_loc[seq];
    const int32_t q_len = job->seqs->query_start_loc[seq + 1] - q_begin;
    const int32_t seq_len = job->seqs->seq_lens[seq], context = seq_len - q_len;
    const int nq = q_len - t0 < AMX_QUERIES ? q_len - t0 : AMX_QUERIES;
    const int32_t *table = job->seqs->block_tables + seq * job->seqs->block_table_stride;
    const int64_t width = padded_len(seq_len);
    const uint16_t *vt = job->vt + job->vt_offset[seq] + (int64_t)kv_head * d * width;

    /* Q^T as B tiles: qt[c][r][2n + e] = q[t0 + n, head, 32c + 2r + e]; queries past nq are 0 */
    uint32_t qt[AMX_MAX_HEAD_DIM / 32 * 256] __attribute__((aligned(64)));
    for (int n = 0; n < AMX_QUERIES; n++) {
        const uint32_t *row = n < nq ? (const uint32_t *)((const uint16_t *)qs->q + (q_begin + t0 + n) * qs->q_token_stride
                                                           + head * qs->q_head_stride) : NULL;
        for (int c = 0; c < d / 32; c++)
            for (int r = 0; r < 16; r++) qt[c * 256 + r * 16 + n] = row ? row[c * 16 + r] : 0;
    }
    float acc[AMX_MAX_HEAD_DIM * AMX_QUERIES] __attribute__((aligned(64)));   /* O^T, d rows of 16 queries */
    float scores[AMX_KEY_STEP * AMX_QUERIES] __attribute__((aligned(64)));    /* S^T, a row per key */
    uint16_t pt[AMX_KEY_STEP * AMX_QUERIES] __attribute__((aligned(64)));     /* P^T: B tiles of 32 keys */
    memset(acc, 0, sizeof(float) * d * AMX_QUERIES);
    __m512 running_max = _mm512_set1_ps(-INFINITY), running_sum = _mm512_setzero_ps();
    /* lane n's query sits at context + t0 + n and sees keys up to there */
    const __m512i last_key = _mm512_add_epi32(_mm512_set1_epi32(context + t0),
                                              _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const int32_t key_end = context + t0 + nq;
    const uint16_t *k_cache = kv->k;
    for (int32_t k0 = 0; k0 < key_end; k0 += AMX_KEY_STEP) {
        const int nk = key_end - k0 < AMX_KEY_STEP ? key_end - k0 : AMX_KEY_STEP;
        const uint16_t *key_rows[AMX_KEY_STEP / 16];
        for (int t = 0; t < AMX_KEY_STEP / 16; t++) {
            const int32_t k = k0 + 16 * t;
            key_rows[t] = nk > 16 * t ? k_cache + table[k / kv->block_size] * kv->k_block_stride
                                        + (k % kv->block_size) * kv->k_slot_stride + kv_head * kv->k_head_stride : NULL;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < d / 32; c++) {
            _tile_loadd(4, qt + c * 256, 64);
            AMX_SCORES(0) AMX_SCORES(1) AMX_SCORES(2) AMX_SCORES(3)
        }
        AMX_STORE_SCORES(0) AMX_STORE_SCORES(1) AMX_STORE_SCORES(2) AMX_STORE_SCORES(3)

        /* Keys this step may hide from some lane: only the steps that reach past the first
         * lane's own position (the diagonal) need the causal mask. */
        const int diagonal = k0 + nk - 1 > context + t0;
        const __m512 scale = _mm512_set1_ps(job->scale_log2);
        /* The step's max over raw scores, then scaled (scale > 0, checked by the caller): four
         * chains, so the maxes do not wait on each other's latency. Only diagonal steps take the
         * masked loop (one masked loop for every step measured ~7% slower on the kernel). */
        __m512 lane_max[4];
        for (int c = 0; c < 4; c++) lane_max[c] = _mm512_set1_ps(-INFINITY);
        if (diagonal) {
            for (int j = 0; j < nk; j++)
                lane_max[j & 3] = _mm512_mask_max_ps(lane_max[j & 3],
                                                     _mm512_cmple_epi32_mask(_mm512_set1_epi32(k0 + j), last_key),
                                                     lane_max[j & 3], _mm512_load_ps(scores + j * 16));
        } else {
            int j = 0;
            for (; j + 4 <= nk; j += 4)
                for (int c = 0; c < 4; c++)
                    lane_max[c] = _mm512_max_ps(lane_max[c], _mm512_load_ps(scores + (j + c) * 16));
            for (; j < nk; j++) lane_max[0] = _mm512_max_ps(lane_max[0], _mm512_load_ps(scores + j * 16));
        }
        const __m512 step_max = _mm512_mul_ps(_mm512_max_ps(_mm512_max_ps(lane_max[0], lane_max[1]),
                                                            _mm512_max_ps(lane_max[2], lane_max[3])), scale);
        /* Lazy rescaling: a lane's reference max moves only when this step's max passes it by
         * more than AMX_RESCALE_LOG2 (weights then stay below 2^AMX_RESCALE_LOG2, far inside
         * float32 and bfloat16 range), so most steps skip rescaling the accumulator. Every lane
         * sees key 0, so the first step moves every lane to a finite max. */
        const __mmask16 moved = _mm512_cmp_ps_mask(step_max, _mm512_add_ps(running_max, _mm512_set1_ps(AMX_RESCALE_LOG2)),
                                                   _CMP_GT_OQ);
        if (moved) {
            const __m512 new_max = _mm512_mask_blend_ps(moved, running_max, step_max);
            const __m512 alpha = exp2_softmax_512(_mm512_sub_ps(running_max, new_max));
            running_sum = _mm512_mul_ps(running_sum, alpha);
            for (int i = 0; i < d; i++) _mm512_store_ps(acc + i * 16, _mm512_mul_ps(_mm512_load_ps(acc + i * 16), alpha));
            running_max = new_max;
        }
        const int paired = (nk + 31) / 32 * 32;   /* keys in whole B tiles */
        for (int j = 0; j < paired; j += 2) {
            __m512 p[2];
            for (int e = 0; e < 2; e++) {
                if (j + e < nk) {
                    /* 2^(s - max): s * scale - max in one fused step */
                    p[e] = exp2_weights_512(_mm512_fmsub_ps(_mm512_load_ps(scores + (j + e) * 16), scale, running_max));
                    if (diagonal)
                        p[e] = _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(_mm512_set1_epi32(k0 + j + e), last_key), p[e]);
                    running_sum = _mm512_add_ps(running_sum, p[e]);
                } else {
                    p[e] = _mm512_setzero_ps();
                }
            }
            _mm512_store_si512((void *)(pt + j * 16), pair_rows_bf16(p[0], p[1]));
        }
        /* acc's rows i0..i0+15 are one 16 x 16 float32 tile as they lie: accumulate in place */
        for (int i0 = 0; i0 < d; i0 += 16) {
            _tile_loadd(0, acc + i0 * 16, 64);
            for (int j = 0; j < paired; j += 32) {
                _tile_loadd(1, vt + i0 * width + k0 + j, width * 2);
                _tile_loadd(2, pt + j * 16, 64);
                _tile_dpbf16ps(0, 1, 2);
            }
            _tile_stored(0, acc + i0 * 16, 64);
        }
    }
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), running_sum);
    for (int i = 0; i < d; i++) _mm512_store_ps(acc + i * 16, _mm512_mul_ps(_mm512_load_ps(acc + i * 16), inv));
    for (int n = 0; n < nq; n++) {
        uint16_t *out = (uint16_t *)qs->out + (q_begin + t0 + n) * qs->out_token_stride + head * qs->out_head_stride;
        for (int i = 0; i < d; i++) out[i] = f32_to_bf16(acc[i * 16 + n]);
    }
}
#endif /* HAVE_AMX */

/* Whether tandem_paged_prefill_amx can run here: built for AMX, and the kernel granted the tile state. */
int tandem_prefill_amx_ready(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

int tandem_paged_prefill_amx(const queries_t *qs, const kv_cache_t *kv, const seqs_t *seqs,
                             float scale, int32_t num_threads) {
#if !HAVE_AMX
    (void)qs, (void)kv, (void)seqs, (void)scale, (void)num_threads;
    return ERR_UNSUPPORTED;
#else
    const int d = kv->head_dim, num_seqs = seqs->num_seqs;
    if (!amx_permitted() || qs->dtype != DTYPE_BFLOAT16 || kv->dtype != DTYPE_BFLOAT16 || d % 32
        || d > AMX_MAX_HEAD_DIM || kv->block_size % 16 || !(scale > 0.0f))
        return ERR_UNSUPPORTED;
    const int group = kv->num_kv_heads > 0 ? qs->num_heads / kv->num_kv_heads : 0;
    if (group < 1 || group * kv->num_kv_heads != qs->num_heads) return ERR_BAD_SHAPE;
    int64_t *first_item = malloc(sizeof(int64_t) * (2 * num_seqs + 1));
    if (!first_item) return ERR_NO_MEMORY;
    int64_t *vt_offset = first_item + num_seqs + 1;
    first_item[0] = 0;
    int64_t vt_elems = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int32_t q_len = seqs->query_start_loc[s + 1] - seqs->query_start_loc[s];
        const int32_t seq_len = seqs->seq_lens[s];
        const int32_t *table = seqs->block_tables + s * seqs->block_table_stride;
        if (q_len < 0 || q_len > seq_len || !context_valid(seqs, kv, s)) {
            free(first_item);
            return ERR_BAD_SEQ_LEN;
        }
        if (seq_len > 0 && !blocks_valid(table, 0, seq_len, kv)) {
            free(first_item);
            return ERR_BAD_BLOCK_ID;
        }
        first_item[s + 1] = first_item[s] + (q_len + AMX_QUERIES - 1) / AMX_QUERIES * qs->num_heads;
        vt_offset[s] = vt_elems;
        vt_elems += (int64_t)padded_len(seq_len) * d * kv->num_kv_heads;
    }
    uint16_t *vt = aligned_alloc(64, (size_t)((vt_elems * 2 + 63) / 64 * 64 + 64));
    if (!vt) {
        free(first_item);
        return ERR_NO_MEMORY;
    }
    const amx_prefill_t job = {qs, kv, seqs, vt, vt_offset, scale * LOG2E};
    const int64_t num_items = first_item[num_seqs], num_packs = (int64_t)num_seqs * kv->num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        amx_configure(6);
#pragma omp for schedule(dynamic, 1)
        for (int64_t p = 0; p < num_packs; p++) {
            const int s = (int)(p / kv->num_kv_heads), h = (int)(p % kv->num_kv_heads);
            pack_values_transposed(kv, seqs->block_tables + s * seqs->block_table_stride, seqs->seq_lens[s], h,
                                   vt + vt_offset[s] + (int64_t)h * d * padded_len(seqs->seq_lens[s]));
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            const int seq = seq_of_item(first_item, num_seqs, item);
            const int64_t local = item - first_item[seq];
            const int32_t q_len = seqs->query_start_loc[seq + 1] - seqs->query_start_loc[seq];
            const int64_t num_runs = (q_len + AMX_QUERIES - 1) / AMX_QUERIES;
            const int32_t t0 = (int32_t)(num_runs - 1 - local / qs->num_heads) * AMX_QUERIES;
            amx_prefill_item(&job, seq, t0, (int)(local % qs->num_heads));
        }
    }
    free(vt);
    free(first_item);
    return OK;
#endif
}
