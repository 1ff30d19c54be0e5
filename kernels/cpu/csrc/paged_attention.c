/* Varlen causal attention over paged KV on CPU, fp32 and bf16: prefill chunks (over a cached prefix or
 * not) and any other rows with several query positions per sequence; `kernels.reference.paged_attention`'s
 * contract. It reads the blocks in place (no gather copy, no fp32 copy of a bf16 cache).
 *
 * A work item is a tile: 8 consecutive query rows of one sequence and one query head. The 8 rows sit in
 * the 8 lanes of every vector, so a key row is one broadcast per head_dim element against the tile's
 * transposed queries: scores for 8 tokens x 8 rows come out as 8 vectors with no horizontal sum, the
 * online softmax (running max m, sum l, rescaled accumulator, all fp32) is lane-wise, and each V row is
 * loaded once for the 8 rows (acc_r += p[t][r] V[t], head_dim / 8 chunks at a time). The causal mask
 * costs nothing below the diagonal: a tile reads tokens 0 .. its last position only, and masks in the
 * chunks that cross its first row's position. Tiles go to the OpenMP threads dynamically (lengths differ).
 *
 * bf16: every K/V row is widened to fp32 as it is loaded and the output rounded once to bf16, as the
 * reference (which gathers, attends in fp32 and casts) does; on AVX512-BF16 the tile multiplies bf16 pairs
 * instead, P rounded to bf16 for P V as on a GPU (paged_attention_avx512bf16.h: 1.55x at make
 * bench-cpu-attention's prefill shapes on an AMD EPYC Zen 4, 2 threads). Returns 0, KERNELS_CPU_BAD_BLOCK,
 * KERNELS_CPU_SHORT_TABLE, KERNELS_CPU_BAD_QUERY_LEN (a sequence with fewer than 0 or more query rows than
 * tokens, found before anything is read) or KERNELS_CPU_NO_MEMORY.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels_cpu.h"
#include "vec8.h"

#define T float
#define FN(name) name##_f32
#define LOAD8(ptr) (*(const v8u *)(ptr))
#define STORE8(ptr, v) (*(v8u *)(ptr) = (v))
#define KV_BF16 0
#include "paged_attention.h"
#undef T
#undef FN
#undef LOAD8
#undef STORE8
#undef KV_BF16

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include "paged_attention_avx512bf16.h" /* the bf16 tile on AVX512-BF16 */
#endif

#define T bf16_t
#define FN(name) name##_bf16
#define LOAD8(ptr) bf16_load8(ptr)
#define STORE8(ptr, v) bf16_store8((ptr), (v))
#define KV_BF16 1
#include "paged_attention.h"
