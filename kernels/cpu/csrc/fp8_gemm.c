/* Weight-only fp8 (W8A16) on CPUs without fp8 arithmetic: y = x @ (q * scale).T (+ bias) (+ residual), the
 * weight q kept as float8_e4m3fn bytes (one a weight, half of bf16's) and widened to fp32 inside the product,
 * x in fp32 or bf16 (widened once to an fp32 copy). The weight is read as skinny_gemm.c reads its own: each
 * thread one contiguous run of w's rows, front to back, up to 8 rows of x against each decoded piece of w
 * (reread from L1 for more rows).
 *
 * The decode, 16 codes at once (AVX-512 with BW and VL): sign-extend each byte to 16 bits, shift it up by 7 and
 * clear bit 14: the bits are then the fp16 with e4m3's sign, exponent (4 of fp16's 5 bits) and mantissa, whose
 * value is the e4m3 value times 2^-8 (the exponent biases differ by 8), subnormals included; vcvtph2ps widens
 * that exactly (it ignores MXCSR.DAZ). fp8_dequantize turns 0x7f / 0xff (e4m3fn's NaN) into the NaN torch gives
 * them; the GEMM does not look for them (decode16_finite). The GEMM sums q * 2^-8 and multiplies by 256 * scale
 * in its epilogue (exact: a power of two).
 * Elsewhere the same bits are built one value at a time (the portable path).
 *
 * Arithmetic: every decoded weight is exact in fp32; products x * q are rounded in fp32 FMAs, summed in fp32
 * (the only roundings, K u of sum |x q| at most), then (acc * 256 * scale + bias) in fp32, rounded once to bf16
 * for bf16 output, the residual added as skinny_gemm.c does (bf16: rounded, added, rounded again). */
#include <stdint.h>
#include <stdlib.h>

#include "kernels_cpu.h"
#include "vec8.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FP8_AVX512 1
#endif

enum { GROUP = 8 }; /* rows of x against one decoded piece of w */

#define INLINE static inline __attribute__((always_inline))

/* One code's value times 2^-8, as its fp16 bits would give (see above); 0x7f / 0xff: torch's NaN. */
INLINE float decode_scaled(uint8_t c) {
    const uint32_t e = (c >> 3) & 15, m = c & 7, sign = (uint32_t)(c >> 7) << 31;
    union {
        uint32_t u;
        float f;
    } v;
    if ((c & 0x7f) == 0x7f) {
        v.u = sign | 0x7ff00000u;
    } else if (e == 0) { /* subnormal: m * 2^-9, times 2^-8 */
        v.f = (float)m * (1.0f / 131072.0f);
        v.u |= sign;
    } else { /* (1 + m / 8) 2^(e - 7) 2^-8: fp32 exponent e - 15 + 127 */
        v.u = sign | ((e + 112) << 23) | (m << 20);
    }
    return v.f;
}

#ifdef FP8_AVX512
/* 16 codes (the first `mask` of them; the rest 0) -> their values times 2^-8 in fp32 (the fp16 bits, widened).
 * The GEMM's loop: NaN codes are not special-cased (they read as +-480; the layers' weights come from
 * saturating quantization and hold none). */
INLINE __m256i fp16_bits16(const uint8_t *p, __mmask16 mask) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_maskz_loadu_epi8(mask, p));
    return _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16((short)0xBF80));
}

INLINE __m512 decode16_finite(const uint8_t *p, __mmask16 mask) { return _mm512_cvtph_ps(fp16_bits16(p, mask)); }

/* The same, NaN codes as torch's NaN: fp16's exponent all ones over the mantissa 0x380 widens to sign | 0x7ff00000. */
INLINE __m512 decode16(const uint8_t *p, __mmask16 mask) {
    const __m256i h = fp16_bits16(p, mask);
    const __m256i low = _mm256_and_si256(h, _mm256_set1_epi16(0x3F80));
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(low, _mm256_set1_epi16(0x3F80));
    return _mm512_cvtph_ps(_mm256_or_si256(h, _mm256_maskz_mov_epi16(nan, _mm256_set1_epi16(0x7C00))));
}
#endif

/* out [n, k] (fp32, or bf16 when bf16 != 0) = q * scale[row], each product rounded once to out's dtype; with
 * scale 1 the exact values (e4m3 fits bf16 and fp32). OpenMP over rows. */
void fp8_dequantize(void *out, const uint8_t *q, const float *scale, int64_t n, int64_t k, int64_t bf16) {
#pragma omp parallel for schedule(static) if (n * k >= SKINNY_PARALLEL_MIN)
    for (int64_t j = 0; j < n; j++) {
        const float s = scale[j] * 256.0f;
        const uint8_t *in = q + j * k;
        float *o32 = (float *)out + j * k;
        bf16_t *o16 = (bf16_t *)out + j * k;
        int64_t i = 0;
#ifdef FP8_AVX512
        for (; i < k; i += 16) {
            const __mmask16 mask = k - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - i)) - 1);
            const __m512 v = _mm512_mul_ps(decode16(in + i, mask), _mm512_set1_ps(s));
            if (bf16) {
#ifdef __AVX512BF16__ /* round to nearest even, as f32_to_bf16 (no NaN reaches it with a finite scale but NaN codes) */
                _mm256_mask_storeu_epi16(o16 + i, mask, (__m256i)_mm512_cvtneps_pbh(v));
#else
                for (int t = 0; t < 16 && i + t < k; t++) o16[i + t] = f32_to_bf16(v[t]);
#endif
            } else
                _mm512_mask_storeu_ps(o32 + i, mask, v);
        }
#endif
        for (; i < k; i++) {
            const float v = decode_scaled(in[i]) * s;
            if (bf16)
                o16[i] = f32_to_bf16(v);
            else
                o32[i] = v;
        }
    }
}

/* acc[r] = x[r] . (w * 2^-8) over k for one row of w, r < rows (a constant after inlining into the switch). */
INLINE void row_fp8(const float *x, const uint8_t *w, int rows, int64_t k, float acc[GROUP]) {
#ifdef FP8_AVX512
    __m512 a[GROUP][2];
    for (int r = 0; r < rows; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    const int64_t body = k / 32 * 32;
    for (int64_t kk = 0; kk < body; kk += 32) {
        const __m512 w0 = decode16_finite(w + kk, 0xFFFF), w1 = decode16_finite(w + kk + 16, 0xFFFF);
        for (int r = 0; r < rows; r++) {
            a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + kk), w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + kk + 16), w1, a[r][1]);
        }
    }
    for (int64_t kk = body; kk < k; kk += 16) {
        const __mmask16 mask = k - kk >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - kk)) - 1);
        const __m512 wv = decode16_finite(w + kk, mask);
        for (int r = 0; r < rows; r++)
            a[r][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + r * k + kk), wv, a[r][0]);
    }
    for (int r = 0; r < rows; r++) acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
#else
    const int64_t body = k / 8 * 8;
    v8 a[GROUP] = {{0}};
    for (int64_t kk = 0; kk < body; kk += 8) {
        v8 wv;
        for (int i = 0; i < 8; i++) wv[i] = decode_scaled(w[kk + i]);
        for (int r = 0; r < rows; r++) a[r] += *(const v8u *)(x + r * k + kk) * wv;
    }
    for (int r = 0; r < rows; r++) {
        float s = hsum(a[r]);
        for (int64_t kk = body; kk < k; kk++) s += x[r * k + kk] * decode_scaled(w[kk]);
        acc[r] = s;
    }
#endif
}

#define ROW_CASE(R) \
    case R: row_fp8(xr, w + j * k, R, k, acc); break

int fp8_gemm_w8a16(const fp8_gemm_args *a) {
    const int64_t m = a->m, n = a->n, k = a->k, x_stride = a->x_stride, residual_stride = a->residual_stride;
    const int bf16 = a->bf16 != 0;
    const uint8_t *w = a->w;
    const float *scale = a->scale;
    /* x widened (bf16) or packed (fp32 with strided rows) once into [m, k] fp32: every row of w reads it */
    float *x = malloc((size_t)(m * k) * sizeof(float) + 1);
    if (!x) return KERNELS_CPU_NO_MEMORY;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i++)
            x[r * k + i] = bf16 ? bf16_to_f32(((const bf16_t *)a->x)[r * x_stride + i])
                                : ((const float *)a->x)[r * x_stride + i];
#pragma omp parallel for schedule(static) if (n * k >= SKINNY_PARALLEL_MIN)
    for (int64_t j = 0; j < n; j++) {
        const float s = scale[j] * 256.0f;
        for (int64_t r0 = 0; r0 < m; r0 += GROUP) {
            float acc[GROUP];
            const float *xr = x + r0 * k;
            const int rows = m - r0 < GROUP ? (int)(m - r0) : GROUP;
            switch (rows) {
                ROW_CASE(1); ROW_CASE(2); ROW_CASE(3); ROW_CASE(4); ROW_CASE(5); ROW_CASE(6); ROW_CASE(7);
            default: row_fp8(xr, w + j * k, GROUP, k, acc); break;
            }
            for (int r = 0; r < rows; r++) {
                const int64_t row = r0 + r;
                if (bf16) {
                    const bf16_t *bias = a->bias, *residual = a->residual;
                    const float out = acc[r] * s + (bias ? bf16_to_f32(bias[j]) : 0.0f);
                    ((bf16_t *)a->y)[row * n + j] =
                        residual ? f32_to_bf16(bf16_round(out) + bf16_to_f32(residual[row * residual_stride + j]))
                                 : f32_to_bf16(out);
                } else {
                    const float *bias = a->bias, *residual = a->residual;
                    const float out = acc[r] * s + (bias ? bias[j] : 0.0f);
                    ((float *)a->y)[row * n + j] = residual ? out + residual[row * residual_stride + j] : out;
                }
            }
        }
    }
    free(x);
    return KERNELS_CPU_OK;
}
