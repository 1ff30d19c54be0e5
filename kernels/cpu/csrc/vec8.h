/* 8-float vectors as GCC vector extensions (AVX, or two SSE/NEON registers; no intrinsics) and
 * the few vector helpers the kernels share. */
#ifndef KERNELS_CPU_VEC8_H
#define KERNELS_CPU_VEC8_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias)); /* unaligned loads/stores */

static inline float hsum(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

static inline v8 vselect(v8i mask, v8 a, v8 b) { return (v8)((mask & (v8i)a) | (~mask & (v8i)b)); }

static inline v8 vmax(v8 a, v8 b) { return vselect(a > b, a, b); }

static inline v8 vmin(v8 a, v8 b) { return vselect(a < b, a, b); }

/* exp(x), 8 at a time, ~1 ulp: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the Cephes expf
 * polynomial, 2^n through the exponent bits. Inputs below -87.3 (-inf included) give 0; inputs
 * are capped at 88 (exp 1.65e38), so nothing overflows to inf. */
static inline v8 exp8(v8 x) {
    const v8 lo = (v8){0} - 87.3365447f;
    const v8i under = x < lo;
    x = vmin(vmax(x, lo), (v8){0} + 88.0f);
    const v8 t = x * 1.44269504088896341f + 0.5f;
    v8i n = __builtin_convertvector(t, v8i);           /* truncates toward zero ... */
    n -= (v8i)(__builtin_convertvector(n, v8) > t) & 1; /* ... so step down to floor(t) */
    const v8 fn = __builtin_convertvector(n, v8);
    const v8 r = x - fn * 0.693359375f + fn * 2.12194440e-4f;
    v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return (v8)(~under & (v8i)(p * (v8)((n + 127) << 23)));
}

#endif
