/* 8-float vectors as GCC vector extensions (AVX, or two SSE/NEON registers; no intrinsics) and
 * the few vector helpers the kernels share, bf16 loads and stores among them (bf16 is the top half
 * of an fp32: a load shifts it up, a store rounds to nearest even, NaN to the quiet 0x7fc0, as
 * c10::BFloat16 does, so a C kernel rounds bit for bit as a PyTorch bf16 op). */
#ifndef KERNELS_CPU_VEC8_H
#define KERNELS_CPU_VEC8_H

#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

typedef uint32_t v8ui __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef uint16_t v8hu __attribute__((vector_size(16), aligned(2), may_alias)); /* unaligned bf16 x 8 */
typedef uint16_t bf16_t;

static inline v8ui vselect_u(v8i mask, v8ui a, v8ui b) { return ((v8ui)mask & a) | (~(v8ui)mask & b); }

#ifdef __AVX2__
/* one vpmovzxwd from memory and a shift: GCC splits the generic form below into four instructions */
static inline v8 bf16_load8(const bf16_t *p) {
    return (v8)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
#else
static inline v8 bf16_load8(const bf16_t *p) { return (v8)(__builtin_convertvector(*(const v8hu *)p, v8ui) << 16); }
#endif

/* v's bits rounded to bf16's (round to nearest even; NaN -> 0x7fc0), still 32 bits wide. */
static inline v8ui bf16_bits8(v8 v) {
    const v8ui u = (v8ui)v;
    const v8ui r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (v8ui)vselect_u((v8i)(v != v), (v8ui){0} + 0x7fc0u, r);
}

static inline void bf16_store8(bf16_t *p, v8 v) { *(v8hu *)p = __builtin_convertvector(bf16_bits8(v), v8h); }

/* v rounded to bf16 and widened back: what a PyTorch bf16 op's result holds. */
static inline v8 bf16_round8(v8 v) { return (v8)(bf16_bits8(v) << 16); }

static inline float bf16_to_f32(bf16_t h) {
    union { uint32_t u; float f; } c = {.u = (uint32_t)h << 16};
    return c.f;
}

static inline bf16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {.f = f};
    if (f != f) return 0x7fc0;
    return (bf16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

static inline float bf16_round(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#endif
