/*
 * Random sampling of one token per row of float32 logits for Tandem's CPU path (engine/sampler.py).
 *
 * The same rule as the sampler's torch path, in a few passes over each row instead of a dozen
 * full-vocabulary tensors and a full sort: scale by 1 / temperature; top-k keeps the logits >= the
 * k-th largest (ties kept); top-p keeps, of what top-k kept, the shortest prefix of the descending
 * distribution (ties by lower token id) whose mass reaches top_p, the top token always; min-p drops
 * the probabilities below min_p x the largest; then the token is drawn by inverse CDF in token-id
 * order from the row's uniform u: the first token whose cumulative probability exceeds u x total.
 * A token of probability 0 (a -inf logit, or dropped by a filter) is never drawn. Results match
 * the torch path's except where rounding puts u or a top-p cut exactly on a boundary.
 *
 * top-k and top-p look only at the candidates: the tokens within a logit gap of the top one that
 * already number k or more, or whose mass already reaches top_p (gaps 4, 8, 16, 32, then every
 * token), usually a few hundred of the vocabulary.
 * Rows run in parallel over an OpenMP team of num_threads (1: on the caller's thread).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "avx512.h"

#define ABI_VERSION 1
#define CDF_BLOCK 256   /* tokens per partial sum of the inverse-CDF walk */

int tandem_sampling_abi_version(void) { return ABI_VERSION; }

/* e[i] = exp(z[i] - zmax), exactly 0 where z[i] is -inf; z[i] - zmax is clamped at -100 first
 * (e^-100 is ~4e-44: a probability that never wins a draw, as in float32 softmax). */
static void exp_shifted(const float *restrict z, float *restrict e, int64_t n, float zmax) {
    int64_t i = 0;
#if HAVE_AVX512
    const __m512 vmax = _mm512_set1_ps(zmax), floor = _mm512_set1_ps(-100.0f), ninf = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(z + i);
        const __mmask16 finite = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
        const __m512 d = _mm512_max_ps(_mm512_sub_ps(v, vmax), floor);
        _mm512_storeu_ps(e + i, _mm512_maskz_mov_ps(finite, exp_512(d)));
    }
#endif
    for (; i < n; i++) e[i] = z[i] == -INFINITY ? 0.0f : expf(fmaxf(z[i] - zmax, -100.0f));
}

/* The k-th largest of x[0..n) (k in 1..n); x is reordered. Quickselect, middle pivot. */
static float kth_largest(float *x, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const float pivot = x[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (x[i] > pivot) i++;
            while (x[j] < pivot) j--;
            if (i <= j) {
                const float t = x[i];
                x[i] = x[j];
                x[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return x[want];
    }
    return x[want];
}

/* The k-th largest of z[0..n) (k < n): a quickselect over only the values within a gap of zmax
 * that are already k or more (gaps 4, 8, 16, 32, then all), copied into buf. */
static float top_k_value(const float *z, float *buf, int64_t n, int64_t k, float zmax) {
    static const float gaps[] = {4.0f, 8.0f, 16.0f, 32.0f};
    float low = -INFINITY;
    for (size_t g = 0; g < sizeof(gaps) / sizeof(gaps[0]); g++) {
        const float t = zmax - gaps[g];
        int64_t count = 0;
        for (int64_t i = 0; i < n; i++) count += z[i] >= t;
        if (count >= k) {
            low = t;
            break;
        }
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (z[i] >= low) buf[m++] = z[i];
    return kth_largest(buf, m, k);
}

struct candidate {
    float e;
    int32_t id;
};

static int by_mass_then_id(const void *a, const void *b) {
    const struct candidate *x = a, *y = b;
    if (x->e != y->e) return x->e > y->e ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* Zero every e[i] outside the top-p prefix (module comment); total is the sum of e. */
static void top_p_cut(float *e, int64_t n, double total, float top_p, struct candidate *cand) {
    static const float gaps[] = {4.0f, 8.0f, 16.0f, 32.0f};
    const double want = (double)top_p * total;
    float threshold = 0.0f;   /* 0: every token with e > 0 */
    for (size_t g = 0; g < sizeof(gaps) / sizeof(gaps[0]); g++) {
        const float t = expf(-gaps[g]);
        double mass = 0.0;
        for (int64_t i = 0; i < n; i++) mass += e[i] >= t ? e[i] : 0.0f;
        if (mass >= want) {
            threshold = t;
            break;
        }
    }
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (e[i] > 0.0f && e[i] >= threshold) cand[m++] = (struct candidate){e[i], (int32_t)i};
    qsort(cand, (size_t)m, sizeof(cand[0]), by_mass_then_id);
    double before = 0.0;   /* mass strictly before the candidate, normalized */
    int64_t keep = 0;
    while (keep < m && (keep == 0 || before < top_p)) before += cand[keep++].e / total;
    for (int64_t i = 0; i < n; i++)
        if (e[i] < threshold) e[i] = 0.0f;
    for (int64_t j = keep; j < m; j++) e[cand[j].id] = 0.0f;
}

/* One row: the token id, or -1 when no token has a probability above 0. */
static int64_t sample_row(const float *x, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                          float u, float *z, float *e, struct candidate *cand) {
    float zmax = -INFINITY;
    for (int64_t i = 0; i < vocab; i++) {
        z[i] = x[i] / temperature;
        zmax = z[i] > zmax ? z[i] : zmax;
    }
    if (zmax == -INFINITY || isnan(zmax)) return -1;
    float kth = -INFINITY;
    if (top_k > 0 && top_k < vocab) kth = top_k_value(z, e, vocab, top_k, zmax);   /* e: scratch until exp */
    exp_shifted(z, e, vocab, zmax);
    if (kth > -INFINITY)
        for (int64_t i = 0; i < vocab; i++)
            if (z[i] < kth) e[i] = 0.0f;
    /* Both top-p and min-p are measured on the top-k distribution: top-p first (it reads the
     * masses), then min-p (the top token's e is exactly 1, so p < min_p * p_max is e < min_p). */
    if (top_p < 1.0f) {
        double total = 0.0;
        for (int64_t i = 0; i < vocab; i++) total += e[i];
        top_p_cut(e, vocab, total, top_p, cand);
    }
    if (min_p > 0.0f)
        for (int64_t i = 0; i < vocab; i++)
            if (e[i] < min_p) e[i] = 0.0f;
    /* Inverse CDF over partial sums of CDF_BLOCK tokens. */
    const int64_t num_blocks = (vocab + CDF_BLOCK - 1) / CDF_BLOCK;
    float *sums = z;   /* z is no longer needed */
    double total = 0.0;
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t end = (b + 1) * CDF_BLOCK < vocab ? (b + 1) * CDF_BLOCK : vocab;
        float s = 0.0f;
        for (int64_t i = b * CDF_BLOCK; i < end; i++) s += e[i];
        sums[b] = s;
        total += s;
    }
    if (!(total > 0.0)) return -1;
    double target = (double)u * total;
    if (target >= total) target = nextafter(total, 0.0);
    double acc = 0.0;
    for (int64_t b = 0; b < num_blocks; b++) {
        if (sums[b] > 0.0f && acc + sums[b] > target) {
            const int64_t end = (b + 1) * CDF_BLOCK < vocab ? (b + 1) * CDF_BLOCK : vocab;
            int64_t last = -1;
            double inner = acc;
            for (int64_t i = b * CDF_BLOCK; i < end; i++) {
                if (e[i] <= 0.0f) continue;
                inner += e[i];
                last = i;
                if (inner > target) return i;
            }
            return last;   /* rounding left the target just past this block's own sum */
        }
        acc += sums[b];
    }
    for (int64_t i = vocab - 1; i >= 0; i--)   /* rounding: the target at the very end */
        if (e[i] > 0.0f) return i;
    return -1;
}

struct rows_args {
    const float *logits;
    int64_t row_stride, vocab;
    const float *temperature;
    const int64_t *top_k;
    const float *top_p, *min_p, *uniform;
    int64_t *out;
    char *scratch;   /* per thread: z and e (vocab floats each), then vocab candidates */
};

static size_t scratch_bytes(int64_t vocab) { return (size_t)vocab * (2 * sizeof(float) + sizeof(struct candidate)); }

static int sample_range(const struct rows_args *a, int64_t begin, int64_t end, int thread) {
    char *mine = a->scratch + (size_t)thread * scratch_bytes(a->vocab);
    float *z = (float *)mine, *e = z + a->vocab;
    struct candidate *cand = (struct candidate *)(e + a->vocab);
    int bad = 0;
    for (int64_t r = begin; r < end; r++) {
        a->out[r] = sample_row(a->logits + r * a->row_stride, a->vocab, a->temperature[r], a->top_k[r], a->top_p[r],
                               a->min_p[r], a->uniform[r], z, e, cand);
        bad += a->out[r] < 0;
    }
    return bad;
}

/* out[r] = the token drawn for row r of logits [num_rows, vocab] (rows row_stride floats apart).
 * Returns the number of rows without any token of probability above 0 (their out is -1), or -2
 * when scratch memory could not be allocated. num_threads <= 1 or one row: no OpenMP region. */
int tandem_sample_rows(const float *logits, int64_t row_stride, int64_t num_rows, int64_t vocab,
                       const float *temperature, const int64_t *top_k, const float *top_p, const float *min_p,
                       const float *uniform, int64_t *out, int num_threads) {
    const int threads = num_threads > 1 && num_rows > 1 ? (num_rows < num_threads ? (int)num_rows : num_threads) : 1;
    char *scratch = malloc((size_t)threads * scratch_bytes(vocab));
    if (!scratch) return -2;
    const struct rows_args args = {logits, row_stride, vocab, temperature, top_k, top_p, min_p, uniform, out, scratch};
    int bad = 0;
    if (threads == 1) {
        bad = sample_range(&args, 0, num_rows, 0);
    } else {
#pragma omp parallel num_threads(threads) reduction(+ : bad)
        {
            const int64_t n = omp_get_num_threads(), i = omp_get_thread_num();
            bad += sample_range(&args, num_rows * i / n, num_rows * (i + 1) / n, (int)i);
        }
    }
    free(scratch);
    return bad;
}
