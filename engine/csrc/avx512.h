/* AVX-512 where the compiler targets it (-march=native on such a CPU), for Tandem's CPU kernels
 * (engine/csrc/*.c): HAVE_AVX512 picks each kernel's vector loops or its portable ones. */
#ifndef TANDEM_AVX512_H
#define TANDEM_AVX512_H
#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#endif
