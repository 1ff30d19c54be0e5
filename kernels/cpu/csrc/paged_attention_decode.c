/* Paged decode attention on CPU, fp32 and bf16: one query row per sequence over its cached context.
 *
 * Reads the KV blocks in place through the block table (no gather copy). A work item is one
 * sequence and a run of its KV heads (all of them when there are enough sequences to keep every
 * thread busy): a block's rows for those heads are contiguous, so the item streams through memory.
 * Each K and V row is read from memory once for all query heads of its GQA group. Softmax is
 * online, one block at a time (running max m, sum l, rescaled accumulator), in fp32. Items go to
 * the OpenMP threads dynamically, since context lengths differ.
 *
 * Per block: scores S[i][t] = q_i . k_t * scale (one 8-wide FMA chain per (token, query head));
 * P = exp(S - m_new), 8 at a time (exp8 in vec8.h); then acc_i += P[i] V a V row at a time, acc_i's
 * head_dim / 8 chunks in registers (independent FMA chains; one chain per chunk down the block's rows
 * was bound by FMA latency: 12-28% slower at the workload's decode shapes, docs/benchmarks.md). head_dim is
 * a multiple of 8 (the caller checks), specialised at compile time for 16, 32, 64 and 128 so the
 * loops over it unroll. The next block's rows are prefetched while a block computes.
 *
 * bf16 (query, caches and output all bf16): each K/V row is widened to fp32 as it is loaded (K once
 * per row for its whole GQA group, V once per two of its query heads; on AVX512-BF16, K stays bf16 in
 * `vdpbf16ps` and V is widened 16 at a time: paged_attention_decode_zmm.h), and every score, probability,
 * sum and accumulator is fp32 as in the fp32 kernel; only the output is rounded to bf16, as the reference does (it gathers the blocks, attends
 * in fp32 and casts the result). A bf16 cache halves the bytes a step streams. The body is a textual
 * template (paged_attention_decode.h) instantiated once per type.
 *
 * Cache layout [num_blocks, block_size, num_kv_heads, head_dim], contiguous. Returns 0,
 * KERNELS_CPU_BAD_BLOCK when a block id a sequence needs lies outside [0, num_blocks), or
 * KERNELS_CPU_SHORT_TABLE when a sequence needs more blocks than its table row has (nothing is read
 * there in either case; the caller raises).
 */
#include <math.h>
#include <stdint.h>

#include "kernels_cpu.h"
#include "vec8.h"

/* Ask for one token's rows of the next block (heads [h0, h1): `bytes` from k and from v), a 64-byte line at a
 * time: blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the next one. */
static inline __attribute__((always_inline)) void prefetch_rows(const char *k, const char *v, int64_t bytes) {
    for (int64_t x = 0; x < bytes; x += 64) {
        __builtin_prefetch(k + x);
        __builtin_prefetch(v + x);
    }
}

/* One block of the online softmax for one query head: its scores pi (padded rows past the block's n set to
 * -inf here) become exp(score - m_new) in place, m and l move on, and the return value alpha = exp(m_old -
 * m_new) is what the caller rescales its accumulator by (0 on the first block, where m = -inf). */
static inline __attribute__((always_inline)) float online_softmax_block(v8 *pi, int64_t n, int64_t padded, float *m,
                                                                       float *l) {
    float *p = (float *)pi;
    for (int64_t t = n; t < padded; t++) p[t] = -INFINITY; /* a short last block */
    v8 mx = pi[0];
    for (int64_t c = 1; c < padded / 8; c++) mx = vmax(mx, pi[c]);
    float m_new = *m;
    for (int k = 0; k < 8; k++) m_new = mx[k] > m_new ? mx[k] : m_new;
    const float alpha = expf(*m - m_new);
    v8 sum = (v8){0};
    for (int64_t c = 0; c < padded / 8; c++) {
        pi[c] = exp8(pi[c] - m_new);
        sum += pi[c];
    }
    *l = *l * alpha + hsum(sum);
    *m = m_new;
    return alpha;
}

#define T float
#define FN(name) name##_f32
#define LOAD8(ptr) (*(const v8u *)(ptr))
#define STORE8(ptr, v) (*(v8u *)(ptr) = (v))
#define KV_BF16 0
#include "paged_attention_decode.h"
#undef T
#undef FN
#undef LOAD8
#undef STORE8
#undef KV_BF16

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#include "paged_attention_decode_zmm.h" /* the bf16 work item on AVX512-BF16 */
#endif

#define T bf16_t
#define FN(name) name##_bf16
#define LOAD8(ptr) bf16_load8(ptr)
#define STORE8(ptr, v) bf16_store8((ptr), (v))
#define KV_BF16 1
#include "paged_attention_decode.h"
