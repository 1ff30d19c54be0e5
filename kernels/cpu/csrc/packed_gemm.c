/* GEMMs for bf16 activations on AVX512-BF16 against a weight repacked once in blocks of 32 output rows, the
 * products on vdpbf16ps (two bf16 products a lane, summed in fp32), one microkernel for two weight formats:
 * weight-only fp8 (W8A16), y = x @ (q * scale).T (+ bias) (+ residual) with the weight kept in e4m3 bytes, and
 * bf16, y = x @ w.T (+ bias) (+ residual) (`bf16_gemm_packed`, below the fp8 description).
 *
 * fp8: the weight is repacked once at load (kernels/cpu/fp8_gemm.py `fp8_pack`, the same bytes permuted) into blocks
 * of 32 output rows: packed [ceil(n / 32)][ceil(k / 2)][64], zero codes in the n and k padding. The 64 bytes of
 * one k pair of a block hold its 32 rows' two codes each (logical byte L = 2 row + k's parity), in the order
 * that decodes into two zmm of bf16 pairs, rows 0-15 and 16-31 (`slot`): vdpbf16ps multiplies each with a
 * broadcast pair of x (x[2p], x[2p + 1]) into 16 fp32 sums.
 *
 * The decode, exact for all 256 codes, 64 at a time: the high and the low byte of each code's bf16 bits looked up
 * by its magnitude b & 0x7f in two 128-byte tables (vpermi2b; built from the values at load), the sign bit b & 0x80
 * or-ed into the high byte, the two bytes interleaved into 16-bit lanes (vpunpck{l,h}bw: within 128-bit lanes,
 * which is why the bytes are stored in `slot`'s order). NaN codes (0x7f, 0xff) decode to NaN (the layers'
 * weights come from saturating quantization and hold none). Every e4m3 value is a bf16 value, so the products
 * are exact in fp32 (8 x 8 significant bits) and the only roundings are the fp32 sums (vdpbf16ps adds each
 * lane's two products to its sum; its bf16 inputs are never subnormal here: weights are >= 2^-9, x is the
 * caller's), then acc * scale + bias in fp32 (one fused multiply-add), rounded once to bf16, the residual added
 * as skinny_gemm.c does.
 *
 * The microkernel: ROWS rows of x x one block's 32 outputs in 16 zmm of fp32 sums, each k pair's 64 codes decoded
 * in registers (6 instructions) beside its 16 dot products, so the decode runs in the shadow of the vdpbf16ps
 * chain (issue 46 measured the other way, a block's k decoded once into an L2 buffer that every row group
 * rereads: 10-20% slower at 16-64 rows once the decode was table lookups; wider row groups, 10-14, no faster).
 * More than ROWS rows rerun the block (its codes then come from L1/L2). OpenMP over blocks.
 *
 * bf16 (kernels/cpu/packed_gemm.py `bf16_pack`): packed [ceil(n / 32)][ceil(k / 2)][32][2] bf16, zeros in the
 * padding: a k pair's 128 bytes are its 32 rows' two weights each in row order, two zmm loaded as they are,
 * the same tile with no decode and no scale. The products of two bf16 values are exact in fp32, so its bound is
 * the fp8 one, save that a subnormal bf16 input (below 2^-126) counts as zero, as in every vdpbf16ps kernel
 * (skinny_gemm.c's, oneDNN's); the output rounds as the bf16 linear's (bias added in fp32, one rounding, then the
 * residual as skinny_gemm.c adds it). Against oneDNN's packed bf16 inner product on a Zen 4 core it is 1.0-1.9x
 * faster at 8-64 rows, level at 256 and 3-5% behind at 2048 (docs/benchmarks.md), so on CPUs without AMX the bf16
 * linears run here.
 * Builds without AVX512-BF16 and VBMI compute the same sums in fp32 one value at a time (correct, slow: the engine
 * packs weights only where `packed_gemm_native` says this build has the fast path). */
#include <stdint.h>
#include <string.h>

#include "kernels_cpu.h"
#include "vec8.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define PACKED_NATIVE 1
#endif

enum { BLOCK = 32, ROWS = 8 }; /* output rows of a block; rows of x per microkernel call */

#define INLINE static inline __attribute__((always_inline))

int packed_gemm_native(int64_t bf16) {
#ifdef PACKED_NATIVE
    return bf16 != 0;
#else
    (void)bf16;
    return 0;
#endif
}

/* e4m3 code -> its value (NaN codes: NaN) */
static float decode_value(uint8_t c) {
    const uint32_t e = (c >> 3) & 15, mant = c & 7;
    if ((c & 0x7f) == 0x7f) return __builtin_nanf("");
    const float v = e ? (float)(8 + mant) / 8.0f * (float)(1 << e) / 128.0f : (float)mant / 512.0f;
    return c & 0x80 ? -v : v;
}

/* where logical byte L (0..63: row L / 2 of the block, k parity L % 2) of a k pair is stored: unpacklo of 128-bit
 * lane l takes its bytes 0-7 as words 8l .. 8l + 7 of the first zmm (rows 0-15), unpackhi bytes 8-15 as those of
 * the second (rows 16-31) */
#ifndef PACKED_NATIVE /* the vector path reads the layouts through its loads and unpacks; the scalar path needs these */
static inline int64_t slot(int64_t L) { return L < 32 ? 16 * (L / 8) + L % 8 : 16 * ((L - 32) / 8) + 8 + L % 8; }

/* weight (j, i) of a packed block layout, as fp32 (the scalar path) */
static float packed_value(const void *w, int fp8, int64_t pairs, int64_t j, int64_t i) {
    const int64_t at = (j / BLOCK) * pairs * 64 + (i / 2) * 64;
    if (fp8) return decode_value(((const uint8_t *)w)[at + slot(2 * (j % BLOCK) + i % 2)]);
    return bf16_to_f32(((const bf16_t *)w)[at + 2 * (j % BLOCK) + i % 2]);
}
#endif

#ifdef PACKED_NATIVE
static uint8_t TABLE_HI[128] __attribute__((aligned(64))), TABLE_LO[128] __attribute__((aligned(64)));

/* the bf16 bits of every magnitude code, split in bytes, once at load */
__attribute__((constructor)) static void fill_tables(void) {
    for (int m = 0; m < 128; m++) {
        const float v = decode_value((uint8_t)m);
        uint32_t u;
        memcpy(&u, &v, 4);
        TABLE_HI[m] = (uint8_t)(u >> 24);
        TABLE_LO[m] = (uint8_t)(u >> 16);
    }
}

typedef struct {
    __m512i hi0, hi1, lo0, lo1;
} tables;

INLINE tables load_tables(void) {
    return (tables){_mm512_load_si512(TABLE_HI), _mm512_load_si512(TABLE_HI + 64), _mm512_load_si512(TABLE_LO),
                    _mm512_load_si512(TABLE_LO + 64)};
}

/* one k pair's 64 codes -> the bf16 pairs of rows 0-15 (w0) and 16-31 (w1) */
INLINE void decode64(const uint8_t *p, const tables *t, __m512i *w0, __m512i *w1) {
    const __m512i c = _mm512_loadu_si512(p);
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, c, t->lo1); /* index bits 0-6: the magnitude */
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, c, t->hi1), c,
                                                 _mm512_set1_epi8((char)0x80), 0xF8); /* | the sign */
    *w0 = _mm512_unpacklo_epi8(lo, hi);
    *w1 = _mm512_unpackhi_epi8(lo, hi);
}

/* x's pair p (x[2p], x[2p + 1]) as a 32-bit broadcast; tail: the last pair of an odd k, x[k - 1] and a zero
 * (its weight is zero too, but x past the row must not be read: it may be another tensor's NaN) */
INLINE __m512bh x_pair(const bf16_t *x, int64_t p, int tail) {
    uint32_t v = x[2 * p];
    if (!tail) memcpy(&v, x + 2 * p, 4);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

/* acc[r] += x[r] . the block's weights at k pair p, r < rows; w: fp8 codes (decoded) or bf16 pairs (loaded) */
INLINE void pair_step(const void *w, const tables *table, int fp8, int64_t p, const bf16_t *x, int64_t x_stride,
                      int rows, int tail, __m512 acc[ROWS][2]) {
    __m512i w0, w1;
    if (fp8) {
        decode64((const uint8_t *)w + p * 64, table, &w0, &w1);
    } else {
        w0 = _mm512_loadu_si512((const bf16_t *)w + p * 64);
        w1 = _mm512_loadu_si512((const bf16_t *)w + p * 64 + 32);
    }
    for (int r = 0; r < rows; r++) {
        const __m512bh xb = x_pair(x + r * x_stride, p, tail);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)w0, xb);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)w1, xb);
    }
}

/* acc[r][0..1] = rows of x (x_stride apart) . one block's weights over k; w: the packed block. rows and fp8
 * constants after inlining. */
INLINE void tile(const void *w, int fp8, const bf16_t *x, int64_t x_stride, int rows, int64_t k,
                 __m512 acc[ROWS][2]) {
    const int64_t full = k / 2;
    tables table;
    if (fp8) table = load_tables();
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < full; p++) pair_step(w, &table, fp8, p, x, x_stride, rows, 0, acc);
    if (k & 1) pair_step(w, &table, fp8, full, x, x_stride, rows, 1, acc);
}

/* the block's outputs n0 .. n0 + 31 (those < n) of `rows` rows: acc * scale (fp8) + bias, rounded to bf16,
 * + residual */
INLINE void epilogue(const fp8_gemm_args *a, int fp8, int64_t row0, int rows, int64_t n0, __m512 acc[ROWS][2]) {
    const int64_t n = a->n;
    const bf16_t *bias = a->bias, *residual = a->residual;
    bf16_t *y = a->y;
    for (int h = 0; h < 2; h++) {
        const int64_t c = n0 + 16 * h;
        if (c >= n) break;
        const __mmask16 mask = n - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - c)) - 1);
        const __m512 s = fp8 ? _mm512_maskz_loadu_ps(mask, a->scale + c) : _mm512_set1_ps(1.0f);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + c)), 16))
                              : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const int64_t row = row0 + r;
            const __m512 sum = fp8 ? _mm512_fmadd_ps(acc[r][h], s, b) : _mm512_add_ps(acc[r][h], b);
            __m256i out = (__m256i)_mm512_cvtneps_pbh(sum);
            if (residual) { /* bf16(out) + residual, rounded again */
                const __m512 res = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, residual + row * a->residual_stride + c)),
                    16));
                const __m512 o = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(out), 16));
                out = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(o, res));
            }
            _mm256_mask_storeu_epi16(y + row * n + c, mask, out);
        }
    }
}

#define TILE_CASE(R)                                               \
    case R:                                                        \
        tile(w, fp8, x + r0 * xs, xs, R, k, acc);                  \
        break

/* every row of x, ROWS at a time, against one packed block w (outputs n0 .. n0 + 31) */
INLINE void block_rows(const fp8_gemm_args *a, int fp8, const void *w, int64_t n0) {
    const int64_t m = a->m, k = a->k, xs = a->x_stride;
    const bf16_t *x = a->x;
    for (int64_t r0 = 0; r0 < m; r0 += ROWS) {
        __m512 acc[ROWS][2];
        const int rows = m - r0 < ROWS ? (int)(m - r0) : ROWS;
        switch (rows) {
            TILE_CASE(1); TILE_CASE(2); TILE_CASE(3); TILE_CASE(4); TILE_CASE(5); TILE_CASE(6); TILE_CASE(7);
        default: tile(w, fp8, x + r0 * xs, xs, ROWS, k, acc); break;
        }
        epilogue(a, fp8, r0, rows, n0, acc);
    }
}
#endif

/* the two exports' body; fp8 a constant after inlining. bf16 x only. */
INLINE void packed_gemm(const fp8_gemm_args *a, int fp8) {
    const int64_t n = a->n, k = a->k, pairs = (k + 1) / 2;
    const int64_t block_bytes = pairs * 64 * (fp8 ? 1 : 2);
#ifdef PACKED_NATIVE
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (n * k >= SKINNY_PARALLEL_MIN)
    for (int64_t j = 0; j < blocks; j++) block_rows(a, fp8, (const char *)a->w + j * block_bytes, j * BLOCK);
#else
    (void)block_bytes;
    const int64_t m = a->m;
    const bf16_t *x = a->x, *bias = a->bias, *residual = a->residual;
    bf16_t *y = a->y;
#pragma omp parallel for schedule(static) if (n * k >= SKINNY_PARALLEL_MIN)
    for (int64_t j = 0; j < n; j++) {
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++)
                acc += bf16_to_f32(x[r * a->x_stride + i]) * packed_value(a->w, fp8, pairs, j, i);
            const float out = (fp8 ? acc * a->scale[j] : acc) + (bias ? bf16_to_f32(bias[j]) : 0.0f);
            y[r * n + j] = residual ? f32_to_bf16(bf16_round(out) + bf16_to_f32(residual[r * a->residual_stride + j]))
                                    : f32_to_bf16(out);
        }
    }
#endif
}

int fp8_gemm_w8a16_packed(const fp8_gemm_args *a) {
    if (a->bf16) packed_gemm(a, 1); /* bf16 x only (fp8_gemm.py refuses others) */
    return KERNELS_CPU_OK;
}

void bf16_gemm_packed(const skinny_gemm_args *a) {
    const fp8_gemm_args args = {a->y, a->x, a->bias, a->residual, a->w, NULL, a->m, a->n, a->k,
                                a->x_stride, a->residual_stride, 1};
    packed_gemm(&args, 0);
}
