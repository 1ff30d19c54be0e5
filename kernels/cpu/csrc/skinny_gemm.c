/* y = x @ w.T (+ bias) (+ residual) for the few rows of a small-batch decode step, w as the model stores
 * it ([n, k] rows, no packing): vLLM's "skinny GEMM". At 1-4 rows the product is a read of the weight (x and
 * y stay in L1), so the kernel's whole job is to stream w at the memory's rate: each thread takes one
 * contiguous run of w's rows and reads them front to back, one sequential stream (reading 4 rows side by
 * side streamed at half the rate), keeps up to 4 rows of x times 4 partial sums in registers across all of
 * k, and sums each accumulator's lanes once at the end. oneDNN's
 * inner product on a packed weight read it at half that rate at these sizes, and costs 16-21 us a call
 * (docs/benchmarks.md).
 *
 * fp32 accumulation at both dtypes. bf16 products on AVX512-BF16's vdpbf16ps (a bf16 x bf16 product is exact
 * in fp32); the output rounded to bf16 once after the bias, as F.linear does, then the residual added and
 * rounded again (PyTorch's `residual + y` in bf16: two roundings, Hugging Face's order). fp32:
 * (acc + bias) + residual, oneDNN's order. Without AVX-512 (or AVX512-BF16 for bf16 weights) the same tiles
 * run on 8-float vectors. Any row count works: rows go in groups of 4, a tile of w reread from L1. */
#include <stdint.h>

#include "kernels_cpu.h"
#include "vec8.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SKINNY_AVX512 1
#endif

enum { GROUP = 4, CH = 4 }; /* rows of x at once; partial sums per dot product */

#define INLINE static inline __attribute__((always_inline))

/* acc[r] = x[r] . w over k for one row of w, r < rows. Inlined into a switch on `rows`, so `rows` is a
 * constant and the accumulators stay in registers: CH partial sums a dot product so that the FMAs do not
 * wait on each other, the row read front to back (with the rows of a thread's run in order, one sequential
 * stream per thread: reading 4 rows side by side instead streamed at half the rate). */
INLINE void row_f32(const float *x, const float *w, int rows, int64_t k, int64_t x_stride, float acc[GROUP]) {
#ifdef SKINNY_AVX512
    __m512 a[GROUP][CH];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CH; c++) a[r][c] = _mm512_setzero_ps();
    const int64_t body = k / (16 * CH) * (16 * CH);
    for (int64_t kk = 0; kk < body; kk += 16 * CH)
        for (int c = 0; c < CH; c++) {
            const __m512 wv = _mm512_loadu_ps(w + kk + 16 * c);
            for (int r = 0; r < rows; r++) a[r][c] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * x_stride + kk + 16 * c), wv, a[r][c]);
        }
    for (int64_t kk = body; kk < k; kk += 16) {
        const __mmask16 mask = k - kk >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (k - kk)) - 1);
        const __m512 wv = _mm512_maskz_loadu_ps(mask, w + kk);
        for (int r = 0; r < rows; r++) a[r][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + r * x_stride + kk), wv, a[r][0]);
    }
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3])));
#else
    const int64_t body = k / 8 * 8;
    v8 a[GROUP][CH] = {{{0}}};
    for (int64_t kk = 0; kk < body; kk += 8) {
        const v8 wv = *(const v8u *)(w + kk);
        for (int r = 0; r < rows; r++) a[r][kk / 8 % CH] += *(const v8u *)(x + r * x_stride + kk) * wv;
    }
    for (int r = 0; r < rows; r++) {
        float s = hsum((a[r][0] + a[r][1]) + (a[r][2] + a[r][3]));
        for (int64_t kk = body; kk < k; kk++) s += x[r * x_stride + kk] * w[kk];
        acc[r] = s;
    }
#endif
}

INLINE void row_bf16(const bf16_t *x, const bf16_t *w, int rows, int64_t k, int64_t x_stride, float acc[GROUP]) {
#if defined(SKINNY_AVX512) && defined(__AVX512BF16__)
    __m512 a[GROUP][CH];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CH; c++) a[r][c] = _mm512_setzero_ps();
    const int64_t body = k / (32 * CH) * (32 * CH);
    for (int64_t kk = 0; kk < body; kk += 32 * CH)
        for (int c = 0; c < CH; c++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + kk + 32 * c);
            for (int r = 0; r < rows; r++)
                a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)_mm512_loadu_si512(x + r * x_stride + kk + 32 * c), wv);
        }
    for (int64_t kk = body; kk < k; kk += 32) {
        const __mmask32 mask = k - kk >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (k - kk)) - 1);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + kk);
        for (int r = 0; r < rows; r++)
            a[r][0] = _mm512_dpbf16_ps(a[r][0], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * x_stride + kk), wv);
    }
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3])));
#else
    const int64_t body = k / 8 * 8;
    v8 a[GROUP][CH] = {{{0}}};
    for (int64_t kk = 0; kk < body; kk += 8) {
        const v8 wv = bf16_load8(w + kk);
        for (int r = 0; r < rows; r++) a[r][kk / 8 % CH] += bf16_load8(x + r * x_stride + kk) * wv;
    }
    for (int r = 0; r < rows; r++) {
        float s = hsum((a[r][0] + a[r][1]) + (a[r][2] + a[r][3]));
        for (int64_t kk = body; kk < k; kk++) s += bf16_to_f32(x[r * x_stride + kk]) * bf16_to_f32(w[kk]);
        acc[r] = s;
    }
#endif
}

/* One row j of w against every row of x, GROUP rows of x at a time; then bias, rounding, residual, store. */
#define SKINNY_ROW(T, ROW_FN, STORE)                                                                          \
    for (int64_t r0 = 0; r0 < m; r0 += GROUP) {                                                            \
        float acc[GROUP];                                                                                  \
        const T *xr = x + r0 * x_stride;                                                                   \
        const int rows = m - r0 < GROUP ? (int)(m - r0) : GROUP;                                          \
        switch (rows) {                                                                                    \
        case 1: ROW_FN(xr, w + j * k, 1, k, x_stride, acc); break;                                         \
        case 2: ROW_FN(xr, w + j * k, 2, k, x_stride, acc); break;                                         \
        case 3: ROW_FN(xr, w + j * k, 3, k, x_stride, acc); break;                                         \
        default: ROW_FN(xr, w + j * k, 4, k, x_stride, acc); break;                                        \
        }                                                                                                  \
        for (int r = 0; r < rows; r++) STORE(r0 + r, j, acc[r]);                                           \
    }

/* Each thread one contiguous run of w's rows (static schedule), read in order. */
void skinny_gemm_f32(const skinny_gemm_args *a) {
    float *y = a->y;
    const float *x = a->x, *w = a->w, *bias = a->bias, *residual = a->residual;
    const int64_t m = a->m, n = a->n, k = a->k, x_stride = a->x_stride, residual_stride = a->residual_stride;
#define STORE_F32(row, col, v)                                                                                \
    do {                                                                                                   \
        const float out = (v) + (bias ? bias[col] : 0.0f);                                                 \
        y[(row) * n + (col)] = residual ? out + residual[(row) * residual_stride + (col)] : out;           \
    } while (0)
#pragma omp parallel for schedule(static) if (n * k >= SKINNY_PARALLEL_MIN)
    for (int64_t j = 0; j < n; j++) {
        SKINNY_ROW(float, row_f32, STORE_F32)
    }
#undef STORE_F32
}

void skinny_gemm_bf16(const skinny_gemm_args *a) {
    bf16_t *y = a->y;
    const bf16_t *x = a->x, *w = a->w, *bias = a->bias, *residual = a->residual;
    const int64_t m = a->m, n = a->n, k = a->k, x_stride = a->x_stride, residual_stride = a->residual_stride;
#define STORE_BF16(row, col, v)                                                                               \
    do {                                                                                                   \
        const float out = (v) + (bias ? bf16_to_f32(bias[col]) : 0.0f);                                    \
        const float res = residual ? bf16_to_f32(residual[(row) * residual_stride + (col)]) : 0.0f;        \
        y[(row) * n + (col)] = residual ? f32_to_bf16(bf16_round(out) + res) : f32_to_bf16(out);           \
    } while (0)
#pragma omp parallel for schedule(static) if (n * k >= SKINNY_PARALLEL_MIN)
    for (int64_t j = 0; j < n; j++) {
        SKINNY_ROW(bf16_t, row_bf16, STORE_BF16)
    }
#undef STORE_BF16
}
