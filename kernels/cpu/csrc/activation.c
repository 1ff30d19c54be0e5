/* SwiGLU's activation, fp32: out[r] = silu(x[r, :d]) * x[r, d:], silu(g) = g / (1 + exp(-g)) as
 * PyTorch computes it. One pass over the fused gate|up output instead of three (silu, the two
 * halves' product, and the copy of a strided half). */
#include <math.h>
#include <stdint.h>

#include "kernels_cpu.h"
#include "vec8.h"

/* SILU_PARALLEL_MIN: elements where both threads pay: ~3 ns each serially (exp and a division), so 16k take
 * ~50 us against a parallel region's few; at 64k, decode steps of up to 42 rows of 1536 ran on one core */

void silu_and_mul_f32(float *out, const float *x, int64_t rows, int64_t d, int64_t x_stride) {
    const int64_t body = d / 8 * 8;
#pragma omp parallel for schedule(static) if (rows * d >= SILU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * x_stride, *up = gate + d;
        float *o = out + r * d;
        for (int64_t j = 0; j < body; j += 8) {
            const v8 g = *(const v8u *)(gate + j);
            *(v8u *)(o + j) = g / (1.0f + exp8(-g)) * *(const v8u *)(up + j);
        }
        for (int64_t j = body; j < d; j++) o[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
    }
}

/* bf16 rows in PyTorch's bf16 order: silu(g) in fp32 rounded to bf16, then its product with up rounded. */
void silu_and_mul_bf16(bf16_t *out, const bf16_t *x, int64_t rows, int64_t d, int64_t x_stride) {
    const int64_t body = d / 8 * 8;
#pragma omp parallel for schedule(static) if (rows * d >= SILU_PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const bf16_t *gate = x + r * x_stride, *up = gate + d;
        bf16_t *o = out + r * d;
        for (int64_t j = 0; j < body; j += 8) {
            const v8 g = bf16_load8(gate + j);
            bf16_store8(o + j, bf16_round8(g / (1.0f + exp8(-g))) * bf16_load8(up + j));
        }
        for (int64_t j = body; j < d; j++) {
            const float g = bf16_to_f32(gate[j]);
            o[j] = f32_to_bf16(bf16_round(g / (1.0f + expf(-g))) * bf16_to_f32(up[j]));
        }
    }
}
