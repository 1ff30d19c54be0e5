/* The body of paged_attention_decode.c, once per element type: included with T (float or bf16_t),
 * FN(name) (the name with the type's suffix), LOAD8 / STORE8 (8 values of T as fp32) and KV_BF16 set. A
 * textual template, so the fp32 kernel compiles exactly as it did before bf16 existed. */
/* Query heads h0 * group .. h1 * group of one sequence (out and q point at head h0 * group); nv =
 * head_dim / 8. */
static inline __attribute__((always_inline)) int FN(attend_heads)(
    T *out, const T *q, int64_t q_head_stride, const T *key_cache, const T *value_cache,
    const int32_t *table, int64_t table_width, int64_t seq_len, int64_t h0, int64_t h1, int64_t group,
    int64_t num_kv_heads, const int64_t nv, int64_t block_size, int64_t num_blocks, float scale) {
    const int64_t head_dim = 8 * nv, nh = h1 - h0, nq = nh * group, token_stride = num_kv_heads * head_dim;
    const int64_t padded = (block_size + 7) / 8 * 8;
    v8 qv[nq][nv], acc[nq][nv], pv[nq][padded / 8]; /* pv: a block's scores, then its probabilities */
    float(*p)[padded] = (float(*)[padded])pv, m[nq], l[nq];
    for (int64_t i = 0; i < nq; i++) {
        for (int64_t j = 0; j < nv; j++) {
            qv[i][j] = LOAD8(q + i * q_head_stride + 8 * j) * scale;
            acc[i][j] = (v8){0};
        }
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    if (seq_len > table_width * block_size) return KERNELS_CPU_SHORT_TABLE;
    for (int64_t start = 0; start < seq_len; start += block_size) {
        const int64_t block = table[start / block_size];
        if (block < 0 || block >= num_blocks) return KERNELS_CPU_BAD_BLOCK;
        const int64_t n = seq_len - start < block_size ? seq_len - start : block_size;
        const int64_t base = block * block_size * token_stride + h0 * head_dim;
        /* Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the next one: ask
         * for its rows of heads [h0, h1) a token at a time while this block's scores compute. */
        const int64_t next = start + block_size < seq_len ? table[start / block_size + 1] : -1;
        const int64_t next_base = next >= 0 && next < num_blocks ? next * block_size * token_stride + h0 * head_dim : -1;
        for (int64_t t = 0; t < n; t++) {
            if (next_base >= 0)
                prefetch_rows((const char *)(key_cache + next_base + t * token_stride),
                              (const char *)(value_cache + next_base + t * token_stride), nh * head_dim * sizeof(T));
            for (int64_t h = 0; h < nh; h++) {
#if KV_BF16 /* widen the row once for the whole GQA group */
                v8 k[nv];
                for (int64_t j = 0; j < nv; j++) k[j] = LOAD8(key_cache + base + t * token_stride + h * head_dim + 8 * j);
#else
                const v8u *k = (const v8u *)(key_cache + base + t * token_stride + h * head_dim);
#endif
                for (int64_t g = 0; g < group; g++) {
                    const v8 *qi = qv[h * group + g];
                    v8 s = qi[0] * k[0];
                    for (int64_t j = 1; j < nv; j++) s += qi[j] * k[j];
                    p[h * group + g][t] = hsum(s);
                }
            }
        }
        for (int64_t i = 0; i < nq; i++) {
            const float alpha = online_softmax_block(pv[i], n, padded, &m[i], &l[i]);
            for (int64_t j = 0; j < nv; j++) acc[i][j] *= alpha;
        }
        /* acc_i += P[i] V, tokens in the outer loop: head_dim / 8 independent FMA chains per query head
         * (a chain per chunk down the tokens waits on each FMA's latency), each V row loaded (widened) once
         * for two query heads of its group. Accumulators: 2 * nv vectors, in registers up to head_dim 64. */
        for (int64_t h = 0; h < nh; h++) {
            const T *v = value_cache + base + h * head_dim;
            int64_t g = 0;
            for (; g + 1 < group && nv <= 8; g += 2) {
                const int64_t i = h * group + g;
                v8 a0[nv], a1[nv];
                for (int64_t j = 0; j < nv; j++) a0[j] = acc[i][j], a1[j] = acc[i + 1][j];
                for (int64_t t = 0; t < n; t++) {
                    const float p0 = p[i][t], p1 = p[i + 1][t];
                    for (int64_t j = 0; j < nv; j++) {
                        const v8 x = LOAD8(v + t * token_stride + 8 * j);
                        a0[j] += p0 * x;
                        a1[j] += p1 * x;
                    }
                }
                for (int64_t j = 0; j < nv; j++) acc[i][j] = a0[j], acc[i + 1][j] = a1[j];
            }
            for (; g < group; g++) {
                const int64_t i = h * group + g;
                v8 a[nv];
                for (int64_t j = 0; j < nv; j++) a[j] = acc[i][j];
                for (int64_t t = 0; t < n; t++) {
                    const float pt = p[i][t];
                    for (int64_t j = 0; j < nv; j++) a[j] += pt * LOAD8(v + t * token_stride + 8 * j);
                }
                for (int64_t j = 0; j < nv; j++) acc[i][j] = a[j];
            }
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
        for (int64_t j = 0; j < nv; j++) STORE8(out + i * head_dim + 8 * j, acc[i][j] * inv);
    }
    return 0;
}

#define ATTEND(NV)                                                                                            \
    FN(attend_heads)(out, q, q_head_stride, key_cache, value_cache, table, table_width, seq_len, h0, h1, group,   \
                 num_kv_heads, NV, block_size, num_blocks, scale)

static int FN(attend)(T *out, const T *q, int64_t q_head_stride, const T *key_cache,
                  const T *value_cache, const int32_t *table, int64_t table_width, int64_t seq_len, int64_t h0,
                  int64_t h1, int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                  int64_t num_blocks, float scale) {
#if KV_BF16 && defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define ATTEND_ZMM(NZ)                                                                                        \
    attend_heads_bf16_zmm(out, q, q_head_stride, key_cache, value_cache, table, table_width, seq_len, h0, h1,   \
                          group, num_kv_heads, NZ, block_size, num_blocks, scale)
    switch (head_dim) { /* paged_attention_decode_zmm.h */
        case 64: return ATTEND_ZMM(2);
        case 128: return ATTEND_ZMM(4);
    }
#undef ATTEND_ZMM
#endif
    switch (head_dim) {
        case 16: return ATTEND(2);
        case 32: return ATTEND(4);
        case 64: return ATTEND(8);
        case 128: return ATTEND(16);
        default: return ATTEND(head_dim / 8);
    }
}

/* The arguments: paged_attention_args (kernels_cpu.h), one query row per sequence (q_token_stride apart),
 * head_splits read, query_start_loc not. */
int FN(paged_attention_decode)(const paged_attention_args *a) {
    T *out = a->out;
    const T *query = a->query, *key_cache = a->key_cache, *value_cache = a->value_cache;
    const int32_t *block_tables = a->block_tables, *seq_lens = a->seq_lens;
    const int64_t num_seqs = a->num_seqs, num_heads = a->num_heads, num_kv_heads = a->num_kv_heads;
    const int64_t head_dim = a->head_dim, block_size = a->block_size, num_blocks = a->num_blocks;
    const int64_t q_seq_stride = a->q_token_stride, q_head_stride = a->q_head_stride;
    const int64_t table_stride = a->table_stride, table_width = a->table_width, head_splits = a->head_splits;
    const float scale = a->scale;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t items = num_seqs * head_splits;
    int status = 0;
    /* Threads only where the work outweighs waking them (tens of microseconds, more when another process
     * holds the other core): a batch-1 step over a short context is a few microseconds of arithmetic. */
    int64_t context __attribute__((unused)) = 0; /* read only by OpenMP's `if` clause */
    for (int64_t s = 0; s < num_seqs; s++) context += seq_lens[s];
#pragma omp parallel for schedule(dynamic, 1) if (items > 1 && context * num_heads >= DECODE_PARALLEL_MIN)
    for (int64_t i = 0; i < items; i++) {
        const int64_t s = i / head_splits, part = i % head_splits;
        const int64_t h0 = num_kv_heads * part / head_splits, h1 = num_kv_heads * (part + 1) / head_splits;
        const int rc = FN(attend)(out + (s * num_heads + h0 * group) * head_dim,
                              query + s * q_seq_stride + h0 * group * q_head_stride, q_head_stride, key_cache,
                              value_cache, block_tables + s * table_stride, table_width, seq_lens[s], h0, h1, group,
                              num_kv_heads, head_dim, block_size, num_blocks, scale);
        if (rc) {
#pragma omp atomic write
            status = rc;
        }
    }
    return status;
}

#undef ATTEND
