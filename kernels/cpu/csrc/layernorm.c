/* RMSNorm over rows, fp32: out = weight * (x * rsqrt(mean(x^2) + eps)), in Hugging Face's order of
 * operations (the normalised row is rounded to fp32 before the weight multiplies it). One pass
 * over x for the sum of squares, one to write; rows go to OpenMP threads when there are many. */
#include <math.h>
#include <stdint.h>

#include "kernels_cpu.h"
#include "vec8.h"

/* RMS_NORM_PARALLEL_MIN (kernels_cpu.h): rows x width from which the rows go to the OpenMP threads (SiLU's threshold too): a decode step's 32-100 rows
 * of 512-576 are 16-58k elements, and threading them took 1.3-1.6x off the call (bf16 11.4 -> 8.9 us at 32 x
 * 512, 34.5 -> 25.8 at 100 x 576; fp32 15.2 -> 9.8 at 100 x 576; 2 threads, an Intel Xeon); at 64k they ran
 * on one core (docs/benchmarks.md). */

void rms_norm_f32(float *out, const float *x, const float *weight, int64_t rows, int64_t width, int64_t x_stride,
                  float eps) {
    const int64_t body = width / 8 * 8;
#pragma omp parallel for schedule(static) if (rows * width >= RMS_NORM_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * width;
        v8 acc = (v8){0};
        for (int64_t j = 0; j < body; j += 8) {
            const v8 v = *(const v8u *)(xr + j);
            acc += v * v;
        }
        float sum = hsum(acc);
        for (int64_t j = body; j < width; j++) sum += xr[j] * xr[j];
        const float inv = 1.0f / sqrtf(sum / (float)width + eps);
        for (int64_t j = 0; j < body; j += 8)
            *(v8u *)(o + j) = *(const v8u *)(weight + j) * (*(const v8u *)(xr + j) * inv);
        for (int64_t j = body; j < width; j++) o[j] = weight[j] * (xr[j] * inv);
    }
}

/* bf16 rows, the same formula in the model's bf16 order: the sum of squares and x * inv in fp32, that
 * rounded to bf16, then times the bf16 weight, rounded again (Hugging Face's `weight * h.to(bf16)`). */
void rms_norm_bf16(bf16_t *out, const bf16_t *x, const bf16_t *weight, int64_t rows, int64_t width, int64_t x_stride,
                   float eps) {
    const int64_t body = width / 8 * 8;
#pragma omp parallel for schedule(static) if (rows * width >= RMS_NORM_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *xr = x + r * x_stride;
        bf16_t *o = out + r * width;
        v8 acc = (v8){0};
        for (int64_t j = 0; j < body; j += 8) {
            const v8 v = bf16_load8(xr + j);
            acc += v * v;
        }
        float sum = hsum(acc);
        for (int64_t j = body; j < width; j++) sum += bf16_to_f32(xr[j]) * bf16_to_f32(xr[j]);
        const float inv = 1.0f / sqrtf(sum / (float)width + eps);
        for (int64_t j = 0; j < body; j += 8)
            bf16_store8(o + j, bf16_load8(weight + j) * bf16_round8(bf16_load8(xr + j) * inv));
        for (int64_t j = body; j < width; j++)
            o[j] = f32_to_bf16(bf16_to_f32(weight[j]) * bf16_round(bf16_to_f32(xr[j]) * inv));
    }
}
