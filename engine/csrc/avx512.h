/* AVX-512 where the compiler targets it (-march=native on such a CPU), for Tandem's CPU kernels
 * (engine/csrc/*.c): HAVE_AVX512 picks each kernel's vector loops or its portable ones. */
#ifndef TANDEM_AVX512_H
#define TANDEM_AVX512_H
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1

/* e^f * 2^n for a reduced argument |f| <= ln2 / 2: a degree-6 Taylor polynomial (relative error
 * ~2e-7), scaled with scalef (which saturates to 0 and inf). The exp kernels reduce their
 * argument to (f, n) and end here. */
static inline __m512 exp_reduced_512(__m512 f, __m512 n) {
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* e^x for x in float32 range: x = n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts), then
 * exp_reduced_512. */
static inline __m512 exp_512(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);   /* ln2 in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    return exp_reduced_512(r, n);
}
#else
#define HAVE_AVX512 0
#endif
#endif
