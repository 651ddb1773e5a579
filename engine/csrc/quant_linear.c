/*
 * Linear layers straight from GGUF-quantized weights, for Tandem's CPU decode steps
 * (engine/models/quant_linear.py).
 *
 * out[m, n] = sum_k x[m, k] * W[n, k], with x and out float32 and W stored as GGUF blocks along
 * k: Q4_0, Q4_1, Q8_0 (32 weights a block) and the K-quants Q4_K, Q6_K (256). A decode step is
 * bound by reading the weights: a Q4_1 weight is 5 bits where the dequantized model is 32
 * (float32) or 16 (bfloat16), so reading the blocks and dequantizing in registers moves 3-6x
 * fewer bytes per step. Dequantization
 * repeats gguf's float32 arithmetic operation for operation (d * q + m for Q4_1, d * (q - 8) for
 * Q4_0, d * q for Q8_0, (d * sc) * q - dmin * m for Q4_K, (d * sc) * q for Q6_K, with the float16
 * d/m and the integer scales as the GGML formats define them), so the values are bit for bit
 * those the loader's dequantized weights hold: where an fma replaces a multiply and an add, the
 * product is exact in float32.
 *
 * Work split: each thread takes a contiguous range of tiles of NT weight rows, dequantizes a
 * tile into a small float32 scratch (L1/L2 resident), then multiplies every row of x against
 * it in register tiles of MB x NT dot products over k. Every output element is one thread's
 * fixed-order sum, so results do not depend on the number of threads. AVX-512 only: without it
 * tandem_qlinear_supported() is 0 and callers keep the dense oneDNN weights.
 *
 * tandem_qlinear_bf16 (CPUs with AMX, bfloat16 models): x and out bfloat16. Each thread
 * dequantizes a tile of 16 weight rows with the same float32 arithmetic, rounds it to bfloat16
 * (round to nearest even: the values the dense bfloat16 weights hold) and multiplies it with the
 * AMX unit, the weight tile as the A operand (16 rows x 32 k, row major, so no transpose) and x
 * transposed once per call into the B operand's pair layout (16 k-pairs x 16 x rows), float32
 * accumulation. The dequantization is paid once per weight whatever the number of x rows, and
 * the products are nearly free, so a step of up to 64 tokens reads the 5-bit blocks at close to
 * the cost of one token.
 *
 * Without AMX (or where Linux does not grant it), on CPUs with AVX512-BF16, tandem_qlinear_bf16
 * takes the float32 kernel's tiles of NT rows, rounds them to bfloat16 the same way and multiplies
 * with vdpbf16ps (tiled_linear): products and sums as on AMX, the dequantization again paid once
 * per weight for all x rows.
 *
 * tandem_qlinear_x16 (AVX512-BF16 without AMX, Q4_0 / Q4_1 / Q8_0): the same product from a copy
 * of the blocks interleaved at load (tandem_qlinear_x16_pack; layout at x16_group), 16 weight rows
 * per vdpbf16ps against a broadcast pair of x, the quants turned into bfloat16 integers (an OR for
 * a 4-bit one) and the block scales applied in float32: no dequantized tile is stored and read
 * back, and no horizontal sums. SmolLM2's 121 linears on 2 Zen 4 threads: 8 rows 17.2 -> 10.2 ms,
 * 1 row 7.8 -> 3.9 against tiled_linear. Its products are of the GGUF values, not of their
 * bfloat16 roundings: within one rounding of the result of the float64 product.
 *
 * tandem_linear_bf16 (AMX, any bfloat16 model): the same AMX loop on dense row-major bf16
 * weights, which are already the A operand's layout (16 rows x 32 k, row stride K), so a decode
 * step streams them with no dequantization and no repacking. It beat oneDNN's packed weights at
 * 1-32 rows on SmolLM2's shapes (2 threads: 14.4 vs 19.6 ms for all 121 linears at 1 row, 16.3
 * vs 19.9 at 16) and tied at 64; ModelRunner.tune_kernels times it at load.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "bf16.h"

/* vdpbf16ps (AVX512-BF16): the bfloat16 entry point on CPUs without AMX, or where Linux refuses it. */
#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define ABI_VERSION 5
/* GGML type ids (gguf.GGMLQuantizationType). */
enum { QTYPE_Q4_0 = 2, QTYPE_Q4_1 = 3, QTYPE_Q8_0 = 8, QTYPE_Q4_K = 12, QTYPE_Q6_K = 14, QTYPE_BF16 = 30 };
enum { OK = 0, ERR_NO_MEMORY = 1, ERR_BAD_SHAPE = 2, ERR_BAD_QTYPE = 3, ERR_UNSUPPORTED = 4 };

#define QK 32    /* weights per block of Q4_0, Q4_1, Q8_0 */
#define QK_K 256 /* weights per super-block of Q4_K, Q6_K */
#define NT 4    /* weight rows per register tile (and per dequantized scratch tile) */
#define MB 6    /* rows of x per register tile: MB * NT accumulators + NT + 1 loads fit 32 zmm */

int tandem_qlinear_abi_version(void) { return ABI_VERSION; }
int tandem_qlinear_supported(void) { return HAVE_AVX512; }

/* Bytes of one block of `qtype`, 0 for a type this file does not read. */
static int64_t block_bytes(int32_t qtype) {
    switch (qtype) {
        case QTYPE_Q4_0: return 18;
        case QTYPE_Q4_1: return 20;
        case QTYPE_Q8_0: return 34;
        case QTYPE_Q4_K: return 144;
        case QTYPE_Q6_K: return 210;
        default: return 0;
    }
}

static int64_t block_weights(int32_t qtype) {
    return qtype == QTYPE_Q4_K || qtype == QTYPE_Q6_K ? QK_K : QK;
}

/* The interleaved layout's rows per group, and each record's header bytes (see x16_group). */
#define X16_ROWS 16
#define X16_HEADER 64

static int64_t x16_record_bytes(int32_t qtype) {
    switch (qtype) {
        case QTYPE_Q4_0: case QTYPE_Q4_1: return X16_HEADER + 256;
        case QTYPE_Q8_0: return X16_HEADER + 512;
        default: return 0;
    }
}

/* OK, or why these sizes cannot be a product of x and `qtype` rows: what the C side trusts. */
static int check_shape(int64_t x_stride, int64_t M, int64_t K, int64_t w_row_bytes, int64_t N, int32_t qtype,
                       int64_t out_stride) {
    const int64_t bb = block_bytes(qtype);
    if (bb == 0) return ERR_BAD_QTYPE;
    const int64_t bw = block_weights(qtype);
    if (M < 0 || N < 0 || K <= 0 || K % bw != 0 || w_row_bytes != K / bw * bb || x_stride < K || out_stride < N)
        return ERR_BAD_SHAPE;
    return OK;
}

#if HAVE_AVX512

static inline float half_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}

static inline __m512i bytes16(const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* Q4_K: d, dmin (float16), 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, then 128
 * bytes of nibbles: bytes 32g..32g+31 hold sub-block 2g in their low nibbles, 2g+1 in their high. */
static void dequant_q4_k(const uint8_t *restrict blk, float *restrict dst) {
    const float d = half_to_f32(blk), dmin = half_to_f32(blk + 2);
    const uint8_t *sc = blk + 4, *qs = blk + 16;
    const __m512i low4 = _mm512_set1_epi32(0x0F);
    for (int j = 0; j < 8; j++) {
        int scale, min;
        if (j < 4) {
            scale = sc[j] & 63;
            min = sc[j + 4] & 63;
        } else {
            scale = (sc[j + 4] & 0x0F) | ((sc[j - 4] >> 6) << 4);
            min = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
        }
        const __m512 dsc = _mm512_set1_ps(d * (float)scale), dm = _mm512_set1_ps(dmin * (float)min);
        const uint8_t *q = qs + (j / 2) * 32;
        for (int c = 0; c < 2; c++) {
            __m512i packed = bytes16(q + c * 16);
            __m512i nib = (j & 1) ? _mm512_srli_epi32(packed, 4) : _mm512_and_si512(packed, low4);
            _mm512_storeu_ps(dst + j * 32 + c * 16, _mm512_fmsub_ps(dsc, _mm512_cvtepi32_ps(nib), dm));
        }
    }
}

/* Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit pairs, 16 int8 scales (one per 16
 * weights), d (float16). Weight 128h + r takes nibble r / 64 of ql[64h + r % 64] and bits
 * 2 * (r / 32) of qh[32h + r % 32]; its value is (d * scale) * (q - 32). */
static void dequant_q6_k(const uint8_t *restrict blk, float *restrict dst) {
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *scales = (const int8_t *)(blk + 192);
    const float d = half_to_f32(blk + 208);
    const __m512i low4 = _mm512_set1_epi32(0x0F), low2 = _mm512_set1_epi32(0x03), bias = _mm512_set1_epi32(32);
    for (int h = 0; h < 2; h++) {
        for (int r = 0; r < 128; r += 16) {
            __m512i lo = _mm512_and_si512(_mm512_srli_epi32(bytes16(ql + 64 * h + r % 64), 4 * (r / 64)), low4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi32(bytes16(qh + 32 * h + r % 32), 2 * (r / 32)), low2);
            __m512i q = _mm512_sub_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 4)), bias);
            const __m512 dsc = _mm512_set1_ps(d * (float)scales[(128 * h + r) / 16]);
            _mm512_storeu_ps(dst + 128 * h + r, _mm512_mul_ps(dsc, _mm512_cvtepi32_ps(q)));
        }
    }
}

/* One row of K weights into float32. */
/* Block b of a Q4_0 / Q4_1 / Q8_0 row: its 32 weights in two float32 vectors. */
static inline __attribute__((always_inline)) void dequant_block32(const uint8_t *restrict row, int64_t b,
                                                                  int32_t qtype, __m512 *lo, __m512 *hi) {
    if (qtype == QTYPE_Q8_0) {
        const uint8_t *blk = row + b * 34;
        __m512 d = _mm512_set1_ps(half_to_f32(blk));
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2)))));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18)))));
        return;
    }
    /* Q4: byte j holds weight j in its low nibble and weight j + 16 in its high one. */
    const int64_t bytes = qtype == QTYPE_Q4_1 ? 20 : 18;
    const uint8_t *blk = row + b * bytes;
    __m512i packed = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + (qtype == QTYPE_Q4_1 ? 4 : 2))));
    __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(packed, _mm512_set1_epi32(0x0F)));
    __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(packed, 4));
    __m512 d = _mm512_set1_ps(half_to_f32(blk));
    if (qtype == QTYPE_Q4_1) {
        __m512 m = _mm512_set1_ps(half_to_f32(blk + 2));
        *lo = _mm512_fmadd_ps(d, q0, m);   /* d * q exact: fma == mul + add */
        *hi = _mm512_fmadd_ps(d, q1, m);
    } else {
        __m512 eight = _mm512_set1_ps(8.0f);
        *lo = _mm512_mul_ps(d, _mm512_sub_ps(q0, eight));
        *hi = _mm512_mul_ps(d, _mm512_sub_ps(q1, eight));
    }
}

static void dequant_row(const uint8_t *restrict row, int64_t K, int32_t qtype, float *restrict dst) {
    if (qtype == QTYPE_Q4_K || qtype == QTYPE_Q6_K) {
        const int64_t bytes = block_bytes(qtype);
        for (int64_t b = 0; b < K / QK_K; b++, dst += QK_K)
            (qtype == QTYPE_Q4_K ? dequant_q4_k : dequant_q6_k)(row + b * bytes, dst);
        return;
    }
    for (int64_t b = 0; b < K / QK; b++, dst += QK) {
        __m512 lo, hi;
        dequant_block32(row, b, qtype, &lo, &hi);
        _mm512_storeu_ps(dst, lo);
        _mm512_storeu_ps(dst + 16, hi);
    }
}

/* out[m, n0 + j] for m < mb (<= MB), j < nt (<= NT): x rows against the dequantized tile `w`
 * (nt rows of K floats). Constant mb/nt at each call site let gcc unroll into registers. */
static inline __attribute__((always_inline)) void tile_dot(
        const float *restrict x, int64_t x_stride, int mb, const float *restrict w, int nt, int64_t K,
        float *restrict out, int64_t out_stride) {
    __m512 acc[MB][NT];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 wv[NT];
        for (int j = 0; j < nt; j++) wv[j] = _mm512_loadu_ps(w + j * K + k);
        for (int i = 0; i < mb; i++) {
            __m512 xv = _mm512_loadu_ps(x + i * x_stride + k);
            for (int j = 0; j < nt; j++) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nt; j++) out[i * out_stride + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#if HAVE_DPBF16
static inline void store_bf16(uint16_t *dst, __m512 lo, __m512 hi) {
    _mm512_storeu_si512((void *)dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* One weight row as bfloat16: dequant_row's float32 values, rounded to nearest even. The 32-weight
 * types go straight from registers; the K-quants through the float32 row `tmp`. */
static void dequant_row_bf16(const uint8_t *restrict row, int64_t K, int32_t qtype, float *restrict tmp,
                             uint16_t *restrict dst) {
    if (qtype == QTYPE_Q4_K || qtype == QTYPE_Q6_K) {
        dequant_row(row, K, qtype, tmp);
        for (int64_t k = 0; k < K; k += 32) store_bf16(dst + k, _mm512_loadu_ps(tmp + k), _mm512_loadu_ps(tmp + k + 16));
        return;
    }
    for (int64_t b = 0; b < K / QK; b++, dst += QK) {
        __m512 lo, hi;
        dequant_block32(row, b, qtype, &lo, &hi);
        store_bf16(dst, lo, hi);
    }
}

/* The lane sums of a, b, c, d in lanes 0, 4, 8 and 12 (a shuffle tree: 10 operations for four
 * sums, where four reduce_add take ~32). */
static inline __m512 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* halves of 256 summed: [a | b] and [c | d], 8 lanes each */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* 128-bit quarters: a, b, c, d in quarters 0..3, 4 lanes each */
    const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    const __m512 h = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));   /* lanes (0+2, 1+3) */
    return _mm512_add_ps(h, _mm512_permute_ps(h, 0xB1));           /* lane 0 of each quarter: all four */
}

/* out[m, n0 + j] = bf16(sum_k x[m, k] w[j, k]) for m < mb (<= MB), j < nt (<= NT): bfloat16 x rows
 * against the tile's bfloat16 weight rows, vdpbf16ps (pairs of bfloat16 products summed in
 * float32), 32 k at a time. Constant mb/nt at each call site let gcc unroll into registers. */
static inline __attribute__((always_inline)) void tile_dot_bf16(
        const uint16_t *restrict x, int64_t x_stride, int mb, const uint16_t *restrict w, int nt, int64_t K,
        uint16_t *restrict out, int64_t out_stride) {
    __m512 acc[MB][NT];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[NT];
        for (int j = 0; j < nt; j++) wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + j * K + k));
        for (int i = 0; i < mb; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * x_stride + k));
            for (int j = 0; j < nt; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < mb; i++) {
        if (nt == NT) {   /* the four sums at once: lanes 0, 4, 8, 12 of sum4 */
            float sums[16];
            _mm512_storeu_ps(sums, sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
            for (int j = 0; j < NT; j++) out[i * out_stride + j] = f32_to_bf16(sums[4 * j]);
        } else {
            for (int j = 0; j < nt; j++) out[i * out_stride + j] = f32_to_bf16(_mm512_reduce_add_ps(acc[i][j]));
        }
    }
}

#endif /* HAVE_DPBF16 */

/* Both tile products with constant mb and nt at each call site, so gcc unrolls into registers. */
#define TILE_CASE(FN, MBC)                                                                 \
    case MBC:                                                                              \
        if (nt == NT) FN(x, x_stride, MBC, w, NT, K, out, out_stride);                     \
        else FN(x, x_stride, MBC, w, nt, K, out, out_stride);                              \
        break;
#define TILE_SWITCH(FN)                                                                    \
    switch (mb) {                                                                          \
        TILE_CASE(FN, 1) TILE_CASE(FN, 2) TILE_CASE(FN, 3)                                 \
        TILE_CASE(FN, 4) TILE_CASE(FN, 5) TILE_CASE(FN, 6)                                 \
        default: break;                                                                    \
    }

static void tile_rows(const float *x, int64_t x_stride, int mb, const float *w, int nt, int64_t K,
                      float *out, int64_t out_stride) {
    TILE_SWITCH(tile_dot)
}

#if HAVE_DPBF16
static void tile_rows_bf16(const uint16_t *x, int64_t x_stride, int mb, const uint16_t *w, int nt, int64_t K,
                           uint16_t *out, int64_t out_stride) {
    TILE_SWITCH(tile_dot_bf16)
}
#endif

/* out = x @ W^T for tandem_qlinear (float32 x and out) and, with bf16 set, tandem_qlinear_bf16 on
 * CPUs without AMX (bfloat16 x and out; HAVE_DPBF16 only). Contiguous ranges of NT-row tiles per
 * thread, so each thread streams its own stretch of the weights; each tile dequantized once into a
 * small scratch (float32, or rounded to bfloat16 as dequant_row_bf16 does), then every x row
 * multiplied against it. Shapes already checked. */
static int tiled_linear(const void *x, int64_t x_stride, int64_t M, int64_t K, const uint8_t *w,
                        int64_t w_row_bytes, int64_t N, int32_t qtype, void *out, int64_t out_stride,
                        int32_t nthreads, int bf16) {
    if (M == 0 || N == 0) return OK;
    const int64_t ntiles = (N + NT - 1) / NT;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > ntiles) nthreads = (int32_t)ntiles;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t first = ntiles * tid / nth, last = ntiles * (tid + 1) / nth;
        void *scratch = aligned_alloc(64, (size_t)(NT * K * (bf16 ? 2 : 4) + 63) / 64 * 64);
        float *row = bf16 ? aligned_alloc(64, (size_t)(K * sizeof(float) + 63) / 64 * 64) : NULL;  /* K-quants */
        if (scratch == NULL || (bf16 && row == NULL)) {
#pragma omp atomic write
            failed = 1;
        } else {
            for (int64_t t = first; t < last; t++) {
                const int64_t n0 = t * NT;
                const int nt = (int)(N - n0 < NT ? N - n0 : NT);
                for (int j = 0; j < nt; j++) {
                    const uint8_t *wrow = w + (n0 + j) * w_row_bytes;
#if HAVE_DPBF16
                    if (bf16) dequant_row_bf16(wrow, K, qtype, row, (uint16_t *)scratch + j * K);
                    else
#endif
                        dequant_row(wrow, K, qtype, (float *)scratch + j * K);
                }
                for (int64_t m0 = 0; m0 < M; m0 += MB) {
                    const int mb = (int)(M - m0 < MB ? M - m0 : MB);
#if HAVE_DPBF16
                    if (bf16)
                        tile_rows_bf16((const uint16_t *)x + m0 * x_stride, x_stride, mb, scratch, nt, K,
                                       (uint16_t *)out + m0 * out_stride + n0, out_stride);
                    else
#endif
                        tile_rows((const float *)x + m0 * x_stride, x_stride, mb, scratch, nt, K,
                                  (float *)out + m0 * out_stride + n0, out_stride);
                }
            }
        }
        free(row);
        free(scratch);
    }
    return failed ? ERR_NO_MEMORY : OK;
}


#if HAVE_DPBF16
/* The interleaved layout for vdpbf16ps (tandem_qlinear_x16_pack, tandem_qlinear_x16): weight rows
 * in groups of 16, each group's K as records of 32 k (one GGUF block per row):
 *   bytes 0-31   d of the 16 rows' blocks (float16), 32-63 their m (float16; Q4_1 only, else 0);
 *   then the payload, words of 32 quants: word element 2r + e is row r's weight at k = 2p + e of
 *   the record's k-pair p, so one vdpbf16ps against a broadcast x pair gives 16 rows' sums.
 *   Q4_0 / Q4_1: 8 chunks of 32 bytes; byte j of chunk t holds element j of k-pair 2t in its low
 *   nibble and of k-pair 2t + 1 in its high one. Q8_0: 16 chunks of 32 int8, one per k-pair.
 * The quants enter the products as bfloat16 integers and the scales are applied per block in
 * float32: a 4-bit q becomes bfloat16 128 + q by OR-ing its bits into 0x4300 (exact: 128..143
 * need 8 significant bits), so sum_k x (d q + m) = d sum_k x (128 + q) + (m - 128 d) sum_k x; an
 * int8 q converts exactly. The products are those of the GGUF values themselves (not of their
 * bfloat16 roundings, as the dense weights and tiled_linear hold), summed in float32. */
#define X16_MB 8   /* x rows per pass: 8 running sums + up to 8 block sums in registers */

static inline __m512i bcast_pair(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_set1_epi32(v);
}

/* out[m, n0 .. n0 + 15] (the lanes in `keep`) for the mb (<= X16_MB) x rows at x, from one group's
 * records. sums[i * nblocks + b] = sum of x row i over block b (4-bit types). Constant mb at each
 * call site lets gcc keep the sums in registers; short batches split the block's k-pairs over
 * more chains, so the dependent vdpbf16ps of one row do not wait on each other. */
static inline __attribute__((always_inline)) void x16_group(
        const uint8_t *restrict group, int64_t nblocks, int32_t qtype, const uint16_t *restrict x, int64_t x_stride,
        int mb, const float *restrict sums, uint16_t *restrict out, int64_t out_stride, __mmask16 keep) {
    enum { CHAINS = 4 };
    const int nchain = mb <= 2 ? 4 : mb <= 4 ? 2 : 1;
    const int64_t rec = x16_record_bytes(qtype);
    const __m512i low4 = _mm512_set1_epi16(0x000F), bias_bits = _mm512_set1_epi16(0x4300);
    const __m512 bias = _mm512_set1_ps(qtype == QTYPE_Q4_0 ? -136.0f : -128.0f);
    __m512 acc[X16_MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblocks; b++) {
        const uint8_t *r = group + b * rec;
        const uint16_t *xb = x + b * 32;
        __m512 part[CHAINS][X16_MB];
        for (int c = 0; c < nchain; c++)
            for (int i = 0; i < mb; i++) part[c][i] = _mm512_setzero_ps();
        if (qtype == QTYPE_Q8_0) {
            for (int t = 0; t < 16; t++) {
                const uint8_t *p = r + X16_HEADER + 32 * t;
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
                const __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
                const int c = t % nchain;
                for (int i = 0; i < mb; i++)
                    part[c][i] = _mm512_dpbf16_ps(part[c][i], (__m512bh)bcast_pair(xb + i * x_stride + 2 * t), w);
            }
        } else {
            for (int t = 0; t < 8; t++) {
                const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(r + X16_HEADER + 32 * t)));
                /* (q & 0x0F) | 0x4300, and (q >> 4) | 0x4300: bfloat16 128 + nibble */
                const __m512bh wa = (__m512bh)_mm512_ternarylogic_epi32(q, low4, bias_bits, 0xEA);
                const __m512bh wb = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(q, 4), bias_bits);
                const int ca = (2 * t) % nchain, cb = (2 * t + 1) % nchain;
                for (int i = 0; i < mb; i++)
                    part[ca][i] = _mm512_dpbf16_ps(part[ca][i], (__m512bh)bcast_pair(xb + i * x_stride + 4 * t), wa);
                for (int i = 0; i < mb; i++)
                    part[cb][i] = _mm512_dpbf16_ps(part[cb][i], (__m512bh)bcast_pair(xb + i * x_stride + 4 * t + 2), wb);
            }
        }
        for (int c = 1; c < nchain; c++)
            for (int i = 0; i < mb; i++) part[0][i] = _mm512_add_ps(part[0][i], part[c][i]);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
        if (qtype == QTYPE_Q8_0) {
            for (int i = 0; i < mb; i++) acc[i] = _mm512_fmadd_ps(d, part[0][i], acc[i]);
        } else {
            /* Q4_1: m - 128 d; Q4_0 (m stored as 0): -136 d, its d (q - 8) as d (128 + q) - 136 d */
            const __m512 shift = _mm512_fmadd_ps(bias, d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(r + 32))));
            for (int i = 0; i < mb; i++) {
                acc[i] = _mm512_fmadd_ps(d, part[0][i], acc[i]);
                acc[i] = _mm512_fmadd_ps(shift, _mm512_set1_ps(sums[i * nblocks + b]), acc[i]);
            }
        }
    }
    for (int i = 0; i < mb; i++)
        _mm256_mask_storeu_epi16((void *)(out + i * out_stride), keep, (__m256i)_mm512_cvtneps_pbh(acc[i]));
}

#define X16_CASE(MBC)                                                                                  \
    case MBC:                                                                                          \
        x16_group(group, nblocks, qtype, x, x_stride, MBC, sums, out, out_stride, keep);               \
        break;

static void x16_rows(const uint8_t *group, int64_t nblocks, int32_t qtype, const uint16_t *x, int64_t x_stride,
                     int mb, const float *sums, uint16_t *out, int64_t out_stride, __mmask16 keep) {
    switch (mb) {
        X16_CASE(1) X16_CASE(2) X16_CASE(3) X16_CASE(4) X16_CASE(5) X16_CASE(6) X16_CASE(7) X16_CASE(8)
        default: break;
    }
}

/* sums[m * nblocks + b] = the float32 sum of x row m over k in block b, left to right. */
static const float *block_sums(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K) {
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    const int64_t nblocks = K / 32, need = M * nblocks;
    if (need > capacity) {
        free(buffer);
        buffer = malloc((size_t)need * sizeof(float) + 64);
        capacity = buffer == NULL ? 0 : need;
        if (buffer == NULL) return NULL;
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nblocks; b++) {
            float s = 0.0f;
            for (int k = 0; k < 32; k++) s += bf16_to_f32(x[m * x_stride + b * 32 + k]);
            buffer[m * nblocks + b] = s;
        }
    return buffer;
}

static int x16_linear(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                      int32_t qtype, uint16_t *out, int64_t out_stride, int32_t nthreads) {
    if (M == 0 || N == 0) return OK;
    const int64_t nblocks = K / 32, ngroups = (N + X16_ROWS - 1) / X16_ROWS;
    const int64_t group_bytes = nblocks * x16_record_bytes(qtype);
    const float *sums = NULL;
    if (qtype != QTYPE_Q8_0 && (sums = block_sums(x, x_stride, M, K)) == NULL) return ERR_NO_MEMORY;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > ngroups) nthreads = (int32_t)ngroups;
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t first = ngroups * tid / nth, last = ngroups * (tid + 1) / nth;
        for (int64_t g = first; g < last; g++) {
            const int64_t n0 = g * X16_ROWS, nt = N - n0 < X16_ROWS ? N - n0 : X16_ROWS;
            const __mmask16 keep = (__mmask16)((1u << nt) - 1u);
            for (int64_t m0 = 0; m0 < M; m0 += X16_MB) {
                const int mb = (int)(M - m0 < X16_MB ? M - m0 : X16_MB);
                x16_rows(w + g * group_bytes, nblocks, qtype, x + m0 * x_stride, x_stride, mb,
                         sums == NULL ? NULL : sums + m0 * nblocks, out + m0 * out_stride + n0, out_stride, keep);
            }
        }
    }
    return OK;
}
#endif /* HAVE_DPBF16 */

#endif /* HAVE_AVX512 */

int tandem_qlinear(const float *x, int64_t x_stride, int64_t M, int64_t K,
                   const uint8_t *w, int64_t w_row_bytes, int64_t N, int32_t qtype,
                   float *out, int64_t out_stride, int32_t nthreads) {
    const int status = check_shape(x_stride, M, K, w_row_bytes, N, qtype, out_stride);
    if (status != OK) return status;
#if !HAVE_AVX512
    (void)x; (void)w; (void)out; (void)nthreads;
    return ERR_UNSUPPORTED;
#else
    return tiled_linear(x, x_stride, M, K, w, w_row_bytes, N, qtype, out, out_stride, nthreads, 0);
#endif
}


#if HAVE_AMX
/* AMX tile registers: 0-3 accumulate out^T for up to 4 blocks of 16 x rows, 4 holds the weight
 * tile, 5 a block of transposed x. Tile ids are immediates, hence the unrolled macros. */
#define AMX_XBLOCKS 4

/* xt[(b * nkc + c) * 512 + r * 32 + m * 2 + e] = x[16 b + m, 32 c + 2 r + e], zero past M. */
static void transpose_x(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, uint16_t *xt) {
    const int64_t nkc = K / 32, nblocks = (M + 15) / 16;
    if (M % 16)   /* the last block's columns past M multiply as zeros */
        memset(xt + (nblocks - 1) * nkc * 512, 0, (size_t)(nkc * 1024));
    const __m512i index = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(16));
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = 0; c < nkc; c++) {
            __m512i pairs = _mm512_loadu_si512((const void *)(x + m * x_stride + c * 32));
            uint16_t *tile = xt + ((m / 16) * nkc + c) * 512 + (m % 16) * 2;
            _mm512_i32scatter_epi32((void *)tile, index, pairs, 4);
        }
    }
}


/* out[m, n0 + n] = bf16(acc[n][m]) for m < mb rows of this x block, n < nt. */
static void store_block(const float *acc, int64_t m0, int64_t mb, int nt, uint16_t *out, int64_t out_stride,
                        int64_t n0) {
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    const __mmask16 keep = (__mmask16)((1u << nt) - 1u);
    for (int64_t m = 0; m < mb; m++) {
        __m512 values = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32((int)m)), acc, 4);
        __m256bh rounded = _mm512_cvtneps_pbh(values);
        _mm256_mask_storeu_epi16((void *)(out + (m0 + m) * out_stride + n0), keep, (__m256i)rounded);
    }
}

#define AMX_STEP(T)                                                                           \
    if (nb > T) {                                                                             \
        _tile_loadd(5, xt + ((b0 + T) * nkc + c) * 512, 64);                                  \
        _tile_dpbf16ps(T, 4, 5);                                                              \
    }
#define AMX_STORE(T)                                                                          \
    if (nb > T) {                                                                             \
        _tile_stored(T, acc, 64);                                                             \
        store_block(acc, (b0 + T) * 16, M - (b0 + T) * 16 < 16 ? M - (b0 + T) * 16 : 16, nt, out, out_stride, n0); \
    }
/* x (M rows of K bf16) transposed into this thread's xt buffer, which lives as long as the
 * calling (engine) thread: no allocation per call. NULL when it cannot be allocated. */
static const uint16_t *transposed_x(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K) {
    static __thread uint16_t *xt_buffer = NULL;
    static __thread int64_t xt_capacity = 0;
    const int64_t xt_elems = (M + 15) / 16 * (K / 32) * 512;
    if (xt_elems > xt_capacity) {
        free(xt_buffer);
        xt_buffer = aligned_alloc(64, (size_t)xt_elems * 2);
        xt_capacity = xt_buffer == NULL ? 0 : xt_elems;
        if (xt_buffer == NULL) return NULL;
    }
    transpose_x(x, x_stride, M, K, xt_buffer);
    return xt_buffer;   /* the team's threads see the caller's buffer, not their own */
}

/* out[m, n0 + j] = bf16(sum_k x[m, k] * wt[j, k]) for every m < M and j < nt: the 16 bf16 weight
 * rows at wt (row stride w_stride elements, rows past nt zero or any readable values: their
 * results are not stored) against every block of x^T in xt. `acc` holds 16 x 16 floats. */
static void amx_tile(const uint16_t *wt, int64_t w_stride, const uint16_t *xt, int64_t M, int64_t K, int nt,
                     uint16_t *out, int64_t out_stride, int64_t n0, float *acc) {
    const int64_t nkc = K / 32, nblocks = (M + 15) / 16;
    for (int64_t b0 = 0; b0 < nblocks; b0 += AMX_XBLOCKS) {
        const int64_t nb = nblocks - b0 < AMX_XBLOCKS ? nblocks - b0 : AMX_XBLOCKS;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < nkc; c++) {
            _tile_loadd(4, wt + c * 32, w_stride * 2);
            AMX_STEP(0) AMX_STEP(1) AMX_STEP(2) AMX_STEP(3)
        }
        AMX_STORE(0) AMX_STORE(1) AMX_STORE(2) AMX_STORE(3)
    }
}
#endif /* HAVE_AMX */

/* 1 where tandem_qlinear_bf16 runs (AMX, else AVX512-BF16); tandem_linear_bf16 needs AMX. */
int tandem_qlinear_bf16_supported(void) {
#if HAVE_AMX
    if (amx_permitted()) return 1;
#endif
    return HAVE_DPBF16;
}

int tandem_linear_bf16_supported(void) {
#if HAVE_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

#if HAVE_AMX
/* The 16 bf16 weight rows of the tile at row n0 (nt of them real) as the AMX loop loads them: a
 * whole tile of plain bf16 rows (QTYPE_BF16) in place, with its row stride in *stride; anything
 * else dequantized or copied into `wt` (16 rows of K, zero past nt), stride K. */
static const uint16_t *weight_tile(const uint8_t *w, int64_t w_row_bytes, int32_t qtype, int64_t n0, int nt,
                                   int64_t K, float *row, uint16_t *wt, int64_t *stride) {
    if (qtype == QTYPE_BF16 && nt == 16) {
        *stride = w_row_bytes / 2;
        return (const uint16_t *)(w + n0 * w_row_bytes);
    }
    for (int j = 0; j < nt; j++) {
        if (qtype == QTYPE_BF16) memcpy(wt + j * K, w + (n0 + j) * w_row_bytes, (size_t)(K * 2));
        else dequant_row_bf16(w + (n0 + j) * w_row_bytes, K, qtype, row, wt + j * K);
    }
    if (nt < 16) memset(wt + nt * K, 0, (size_t)((16 - nt) * K * 2));
    *stride = K;
    return wt;
}

/* out = bf16(x @ W^T) on AMX for both entry points below, shapes already checked. */
static int amx_linear(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, const uint8_t *w,
                      int64_t w_row_bytes, int64_t N, int32_t qtype, uint16_t *out, int64_t out_stride,
                      int32_t nthreads) {
    if (!amx_permitted()) return ERR_UNSUPPORTED;
    if (M == 0 || N == 0) return OK;
    const int64_t ntiles = (N + 15) / 16;
    const uint16_t *xt = transposed_x(x, x_stride, M, K);
    if (xt == NULL) return ERR_NO_MEMORY;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > ntiles) nthreads = (int32_t)ntiles;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* Contiguous tile ranges: each thread streams its own stretch of the weights. */
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t first = ntiles * tid / nth, last = ntiles * (tid + 1) / nth;
        float *row = aligned_alloc(64, (size_t)(K * sizeof(float) + 63) / 64 * 64);
        uint16_t *wt = aligned_alloc(64, (size_t)(16 * K * 2 + 63) / 64 * 64);
        float *acc = aligned_alloc(64, 16 * 16 * sizeof(float));
        if (row == NULL || wt == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        } else if (first < last) {
            amx_configure(6);
            for (int64_t t = first; t < last; t++) {
                const int64_t n0 = t * 16;
                const int nt = (int)(N - n0 < 16 ? N - n0 : 16);
                int64_t stride;
                const uint16_t *tile = weight_tile(w, w_row_bytes, qtype, n0, nt, K, row, wt, &stride);
                amx_tile(tile, stride, xt, M, K, nt, out, out_stride, n0, acc);
            }
            _tile_release();
        }
        free(row);
        free(wt);
        free(acc);
    }
    return failed ? ERR_NO_MEMORY : OK;
}
#endif

int tandem_qlinear_bf16(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K,
                        const uint8_t *w, int64_t w_row_bytes, int64_t N, int32_t qtype,
                        uint16_t *out, int64_t out_stride, int32_t nthreads) {
    const int status = check_shape(x_stride, M, K, w_row_bytes, N, qtype, out_stride);
    if (status != OK) return status;
#if HAVE_AMX
    if (amx_permitted()) return amx_linear(x, x_stride, M, K, w, w_row_bytes, N, qtype, out, out_stride, nthreads);
#endif
#if HAVE_DPBF16
    return tiled_linear(x, x_stride, M, K, w, w_row_bytes, N, qtype, out, out_stride, nthreads, 1);
#else
    (void)x; (void)w; (void)out; (void)nthreads;
    return ERR_UNSUPPORTED;
#endif
}

/* Dense bfloat16 rows on AMX, for decode steps: out[m, n] = bf16(sum_k x[m, k] * w[n, k]) with
 * w row-major (N rows of K, row stride w_stride elements). The weight rows are the A operand as
 * they lie in memory, 16 at a time, so nothing is repacked; only a last partial tile of rows is
 * copied, zero-padded. K a multiple of 32. */
int tandem_linear_bf16(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K,
                       const uint16_t *w, int64_t w_stride, int64_t N,
                       uint16_t *out, int64_t out_stride, int32_t nthreads) {
    if (M < 0 || N < 0 || K <= 0 || K % 32 || x_stride < K || w_stride < K || out_stride < N) return ERR_BAD_SHAPE;
#if !HAVE_AMX
    (void)x; (void)w; (void)out; (void)nthreads;
    return ERR_UNSUPPORTED;
#else
    return amx_linear(x, x_stride, M, K, (const uint8_t *)w, w_stride * 2, N, QTYPE_BF16, out, out_stride, nthreads);
#endif
}

/* Bytes of the interleaved copy of N rows of K `qtype` weights (tandem_qlinear_x16_pack), or -1
 * for a type or width it does not hold. */
int64_t tandem_qlinear_x16_bytes(int64_t N, int64_t K, int32_t qtype) {
    const int64_t rec = x16_record_bytes(qtype);
    if (rec == 0 || N < 0 || K <= 0 || K % QK) return -1;
    return (N + X16_ROWS - 1) / X16_ROWS * (K / QK) * rec;
}

/* 1 where tandem_qlinear_x16 runs: AVX512-BF16. */
int tandem_qlinear_x16_supported(void) { return HAVE_DPBF16; }

/* The GGUF rows at w (N rows of w_row_bytes, Q4_0 / Q4_1 / Q8_0) rewritten into dst
 * (tandem_qlinear_x16_bytes of them) in the interleaved layout x16_group reads; rows past N, in
 * the last group, are zero (d = 0). Plain C: run once, at load. */
int tandem_qlinear_x16_pack(const uint8_t *w, int64_t w_row_bytes, int64_t N, int64_t K, int32_t qtype,
                            uint8_t *dst) {
    const int64_t rec_bytes = x16_record_bytes(qtype);
    if (rec_bytes == 0) return ERR_BAD_QTYPE;
    const int status = check_shape(K, 0, K, w_row_bytes, N, qtype, N);
    if (status != OK) return status;
    const int64_t nblocks = K / QK, ngroups = (N + X16_ROWS - 1) / X16_ROWS, bb = block_bytes(qtype);
    memset(dst, 0, (size_t)(ngroups * nblocks * rec_bytes));
    for (int64_t g = 0; g < ngroups; g++) {
        for (int64_t b = 0; b < nblocks; b++) {
            uint8_t *rec = dst + (g * nblocks + b) * rec_bytes;
            for (int r = 0; r < X16_ROWS && g * X16_ROWS + r < N; r++) {
                const uint8_t *blk = w + (g * X16_ROWS + r) * w_row_bytes + b * bb;
                memcpy(rec + 2 * r, blk, 2);                                  /* d */
                if (qtype == QTYPE_Q4_1) memcpy(rec + 32 + 2 * r, blk + 2, 2);  /* m */
                for (int k = 0; k < QK; k++) {
                    const int p = k / 2, j = 2 * r + k % 2;   /* k-pair, element of its word */
                    if (qtype == QTYPE_Q8_0) {
                        rec[X16_HEADER + 32 * p + j] = blk[2 + k];
                    } else {
                        const uint8_t *qs = blk + (qtype == QTYPE_Q4_1 ? 4 : 2);
                        const int q = k < 16 ? qs[k] & 0x0F : qs[k - 16] >> 4;
                        rec[X16_HEADER + 32 * (p / 2) + j] |= (uint8_t)(q << (4 * (p % 2)));
                    }
                }
            }
        }
    }
    return OK;
}

/* out = bf16(x @ W^T) from the interleaved copy at w (tandem_qlinear_x16_pack; w_bytes long, which
 * must be what N rows of K take), x bfloat16 (M rows of K, row stride x_stride), on CPUs with
 * AVX512-BF16. */
int tandem_qlinear_x16(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, const uint8_t *w,
                       int64_t w_bytes, int64_t N, int32_t qtype, uint16_t *out, int64_t out_stride,
                       int32_t nthreads) {
    if (x16_record_bytes(qtype) == 0) return ERR_BAD_QTYPE;
    if (M < 0 || N < 0 || K <= 0 || K % QK || x_stride < K || out_stride < N
        || w_bytes != tandem_qlinear_x16_bytes(N, K, qtype))
        return ERR_BAD_SHAPE;
#if HAVE_DPBF16
    return x16_linear(x, x_stride, M, K, w, N, qtype, out, out_stride, nthreads);
#else
    (void)x; (void)w; (void)out; (void)nthreads;
    return ERR_UNSUPPORTED;
#endif
}
