/* Rotate-half (GPT-NeoX style) RoPE in place, fp32, on x [tokens, heads, head_dim] (token stride
 * free, heads head_dim apart, head_dim contiguous): with c, s = cos, sin[positions[t]] (tables of
 * [max_positions, head_dim / 2]), x1, x2 = the two halves of a head,
 *     x1 <- x1 c - x2 s,    x2 <- x2 c + x1 s.
 * The table rows are read by position here: no per-step gather of cos/sin. Returns 0, or
 * KERNELS_CPU_BAD_POSITION when a position lies outside the tables (that token is left as is). */
#include <stdint.h>

#include "kernels_cpu.h"
#include "vec8.h"

int rotary_embedding_f32(const rotary_embedding_args *a) {
    float *x = a->x;
    const float *cos = a->cos, *sin = a->sin;
    const int64_t *positions = a->positions, tokens = a->tokens, heads = a->heads, head_dim = a->head_dim;
    const int64_t token_stride = a->token_stride, max_positions = a->max_positions;
    const int64_t half = head_dim / 2, body = half / 8 * 8;
    int status = 0;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= ROPE_PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t pos = positions[t];
        if (pos < 0 || pos >= max_positions) {
#pragma omp atomic write
            status = KERNELS_CPU_BAD_POSITION;
            continue;
        }
        const float *c = cos + pos * half, *s = sin + pos * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * token_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t j = 0; j < body; j += 8) {
                const v8 a = *(v8u *)(x1 + j), b = *(v8u *)(x2 + j);
                const v8 cj = *(const v8u *)(c + j), sj = *(const v8u *)(s + j);
                *(v8u *)(x1 + j) = a * cj - b * sj;
                *(v8u *)(x2 + j) = b * cj + a * sj;
            }
            for (int64_t j = body; j < half; j++) {
                const float a = x1[j], b = x2[j];
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j] + a * s[j];
            }
        }
    }
    return status;
}

/* bf16 x and tables, in the PyTorch formula's bf16 order: every product rounded to bf16, then the
 * sum or difference rounded: x1 <- bf16(bf16(x1 c) - bf16(x2 s)), x2 <- bf16(bf16(x2 c) + bf16(x1 s)). */
int rotary_embedding_bf16(const rotary_embedding_args *a) {
    bf16_t *x = a->x;
    const bf16_t *cos = a->cos, *sin = a->sin;
    const int64_t *positions = a->positions, tokens = a->tokens, heads = a->heads, head_dim = a->head_dim;
    const int64_t token_stride = a->token_stride, max_positions = a->max_positions;
    const int64_t half = head_dim / 2, body = half / 8 * 8;
    int status = 0;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= ROPE_PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t pos = positions[t];
        if (pos < 0 || pos >= max_positions) {
#pragma omp atomic write
            status = KERNELS_CPU_BAD_POSITION;
            continue;
        }
        const bf16_t *c = cos + pos * half, *s = sin + pos * half;
        for (int64_t h = 0; h < heads; h++) {
            bf16_t *x1 = x + t * token_stride + h * head_dim, *x2 = x1 + half;
            for (int64_t j = 0; j < body; j += 8) {
                const v8 a = bf16_load8(x1 + j), b = bf16_load8(x2 + j);
                const v8 cj = bf16_load8(c + j), sj = bf16_load8(s + j);
                bf16_store8(x1 + j, bf16_round8(a * cj) - bf16_round8(b * sj));
                bf16_store8(x2 + j, bf16_round8(b * cj) + bf16_round8(a * sj));
            }
            for (int64_t j = body; j < half; j++) {
                const float a = bf16_to_f32(x1[j]), b = bf16_to_f32(x2[j]);
                const float cj = bf16_to_f32(c[j]), sj = bf16_to_f32(s[j]);
                x1[j] = f32_to_bf16(bf16_round(a * cj) - bf16_round(b * sj));
                x2[j] = f32_to_bf16(bf16_round(b * cj) + bf16_round(a * sj));
            }
        }
    }
    return status;
}
