/* The body of paged_attention.c, once per element type: included with T (float or bf16_t), FN(name) (the
 * name with the type's suffix), LOAD8 / STORE8 (8 values of T as fp32) and KV_BF16 set. */

/* One tile: query rows r0 .. r0 + rows - 1 (rows <= 8) of one sequence and one query head, at positions
 * pos0 .. pos0 + rows - 1, over tokens 0 .. pos0 + rows - 1 of its paged K/V (KV head kv_head). Lane r of
 * every vector is query row r0 + r; nv = head_dim / 8. */
static inline __attribute__((always_inline)) int FN(attend_tile)(
    T *out, int64_t out_stride, const T *q, int64_t q_stride, int64_t rows, int64_t pos0, const T *key_cache,
    const T *value_cache, const int32_t *table, int64_t table_width, int64_t kv_head, int64_t num_kv_heads,
    const int64_t nv, int64_t block_size, int64_t num_blocks, float scale) {
    const int64_t head_dim = 8 * nv, token_stride = num_kv_heads * head_dim, last = pos0 + rows - 1;
    float qt[head_dim][8], o[8][head_dim], kf[8][head_dim], p[8][8];
    for (int64_t d = 0; d < head_dim; d++)
        for (int64_t r = 0; r < 8; r++) qt[d][r] = 0.0f;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < nv; j++) {
            const v8 x = LOAD8(q + r * q_stride + 8 * j) * scale;
            for (int64_t k = 0; k < 8; k++) qt[8 * j + k][r] = x[k];
        }
    for (int64_t r = 0; r < 8; r++)
        for (int64_t d = 0; d < head_dim; d++) o[r][d] = 0.0f;
    v8i pos;
    for (int64_t r = 0; r < 8; r++) pos[r] = (int32_t)(pos0 + r); /* rows past `rows`: attend, never stored */
    v8 m = (v8){0} - INFINITY, l = (v8){0};
    if (last / block_size >= table_width) return KERNELS_CPU_SHORT_TABLE;
    for (int64_t start = 0; start <= last; start += block_size) {
        const int64_t block = table[start / block_size];
        if (block < 0 || block >= num_blocks) return KERNELS_CPU_BAD_BLOCK;
        const int64_t n = last + 1 - start < block_size ? last + 1 - start : block_size;
        const T *kb = key_cache + block * block_size * token_stride + kv_head * head_dim;
        const T *vb = value_cache + block * block_size * token_stride + kv_head * head_dim;
        for (int64_t c0 = 0; c0 < n; c0 += 8) {
            const int64_t cn = n - c0 < 8 ? n - c0 : 8;
            for (int64_t t = 0; t < 8; t++) { /* a short chunk repeats its last row, masked below */
                const T *k = kb + (c0 + (t < cn ? t : cn - 1)) * token_stride;
                for (int64_t j = 0; j < nv; j++) *(v8u *)&kf[t][8 * j] = LOAD8(k + 8 * j);
            }
            /* S^T: 8 tokens x 8 query rows, query rows in the lanes: no horizontal sums */
            v8 s[8] = {0};
            for (int64_t d = 0; d < head_dim; d++) {
                const v8 qd = *(const v8u *)qt[d];
                for (int64_t t = 0; t < 8; t++) s[t] += qd * kf[t][d];
            }
            const int64_t first = start + c0;
            v8 mx = (v8){0} - INFINITY;
            for (int64_t t = 0; t < 8; t++) {
                if (t >= cn) s[t] = (v8){0} - INFINITY; /* past the chunk */
                else if (first + t > pos0) /* after some row's position */
                    s[t] = vselect(((v8i){0} + (int32_t)(first + t)) > pos, (v8){0} - INFINITY, s[t]);
                mx = vmax(mx, s[t]);
            }
            const v8 m_new = vmax(m, mx); /* finite: token 0 is in every row's first chunk */
            const v8 alpha = exp8(m - m_new);
            v8 sum = (v8){0};
            for (int64_t t = 0; t < 8; t++) {
                const v8 e = exp8(s[t] - m_new);
                sum += e;
                *(v8u *)p[t] = e;
            }
            l = l * alpha + sum;
            m = m_new;
            float a[8];
            *(v8u *)a = alpha;
            for (int64_t j = 0; j < nv; j++) {
                v8 acc[8];
                for (int64_t r = 0; r < 8; r++) acc[r] = *(const v8u *)&o[r][8 * j] * a[r];
                for (int64_t t = 0; t < cn; t++) {
                    const v8 v = LOAD8(vb + (c0 + t) * token_stride + 8 * j);
                    for (int64_t r = 0; r < 8; r++) acc[r] += p[t][r] * v;
                }
                for (int64_t r = 0; r < 8; r++) *(v8u *)&o[r][8 * j] = acc[r];
            }
        }
    }
    float inv[8];
    *(v8u *)inv = 1.0f / l;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < nv; j++) STORE8(out + r * out_stride + 8 * j, *(const v8u *)&o[r][8 * j] * inv[r]);
    return 0;
}

#define TILE(NV)                                                                                               \
    FN(attend_tile)(out, out_stride, q, q_stride, rows, pos0, key_cache, value_cache, table, table_width, kv_head, \
                    num_kv_heads, NV, block_size, num_blocks, scale)

static int FN(tile)(T *out, int64_t out_stride, const T *q, int64_t q_stride, int64_t rows, int64_t pos0,
                    const T *key_cache, const T *value_cache, const int32_t *table, int64_t table_width,
                    int64_t kv_head, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                    float scale) {
#if KV_BF16 && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define TILE_DP(NV)                                                                                            \
    attend_tile_bf16_dp(out, out_stride, q, q_stride, rows, pos0, key_cache, value_cache, table, table_width,    \
                        kv_head, num_kv_heads, NV, block_size, num_blocks, scale)
    switch (head_dim) { /* paged_attention_avx512bf16.h */
        case 32: return TILE_DP(4);
        case 64: return TILE_DP(8);
        case 128: return TILE_DP(16);
        default:
            if (head_dim % 16 == 0) return TILE_DP(head_dim / 8);
    }
#undef TILE_DP
#endif
    switch (head_dim) {
        case 32: return TILE(4);
        case 64: return TILE(8);
        case 128: return TILE(16);
        default: return TILE(head_dim / 8);
    }
}

/* The arguments: paged_attention_args (kernels_cpu.h), query_start_loc read, head_splits not. */
int FN(paged_attention)(const paged_attention_args *a) {
    T *out = a->out;
    const T *query = a->query, *key_cache = a->key_cache, *value_cache = a->value_cache;
    const int32_t *block_tables = a->block_tables, *seq_lens = a->seq_lens, *query_start_loc = a->query_start_loc;
    const int64_t num_seqs = a->num_seqs, num_heads = a->num_heads, num_kv_heads = a->num_kv_heads;
    const int64_t head_dim = a->head_dim, block_size = a->block_size, num_blocks = a->num_blocks;
    const int64_t q_token_stride = a->q_token_stride, q_head_stride = a->q_head_stride;
    const int64_t table_stride = a->table_stride, table_width = a->table_width;
    const float scale = a->scale;
    const int64_t group = num_heads / num_kv_heads;
    int64_t *first_tile = malloc((num_seqs + 1) * sizeof(int64_t)); /* the sequences' tile counts, summed */
    if (!first_tile) return KERNELS_CPU_NO_MEMORY;
    first_tile[0] = 0;
    int64_t work __attribute__((unused)) = 0; /* read only by OpenMP's `if` clause */
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t q_len = query_start_loc[s + 1] - query_start_loc[s];
        if (q_len < 0 || q_len > seq_lens[s]) {
            free(first_tile);
            return KERNELS_CPU_BAD_QUERY_LEN;
        }
        first_tile[s + 1] = first_tile[s] + (q_len + 7) / 8;
        work += q_len * seq_lens[s];
    }
    const int64_t items = first_tile[num_seqs] * num_heads; /* (tile, query head), heads of a tile adjacent */
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1 && work * num_heads >= PREFILL_PARALLEL_MIN)
    for (int64_t i = 0; i < items; i++) {
        const int64_t tile = i / num_heads, head = i % num_heads;
        int64_t lo = 0, hi = num_seqs; /* the sequence s with first_tile[s] <= tile < first_tile[s + 1] */
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (first_tile[mid] <= tile) lo = mid;
            else hi = mid;
        }
        const int64_t s = lo, q_len = query_start_loc[s + 1] - query_start_loc[s];
        const int64_t r0 = (tile - first_tile[s]) * 8, rows = q_len - r0 < 8 ? q_len - r0 : 8;
        const int64_t row = query_start_loc[s] + r0;
        const int rc = FN(tile)(out + (row * num_heads + head) * head_dim, num_heads * head_dim,
                                query + row * q_token_stride + head * q_head_stride, q_token_stride, rows,
                                seq_lens[s] - q_len + r0, key_cache, value_cache, block_tables + s * table_stride,
                                table_width, head / group, num_kv_heads, head_dim, block_size, num_blocks, scale);
        if (rc) {
#pragma omp atomic write
            status = rc;
        }
    }
    free(first_tile);
    return status;
}

#undef TILE
