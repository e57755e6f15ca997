/* The plain loops of decode_attention.c (scores, softmax numerators, values), included there twice: as the
 * portable build (PLAIN(name) = name##_plain) and, on x86, compiled for AVX2 (name##_avx2), where the compiler
 * vectorises their explicit lanes. The source asks for no fused multiply-add (C99: no contraction), so both builds
 * give the same bits, row by row, whatever the other rows of the batch: the path of CPUs without AVX-512. */
/* s[h * len + p] = (q_h . k_p[g(h)]) * scale for every head h (qf: float32 [heads][d]), positions [0, len). */
PLAIN_ATTR static void PLAIN(scores)(const float *qf, int64_t heads, int64_t group, int64_t d, const uint16_t *k,
                         const int32_t *table, int64_t len, int64_t block_size, int64_t kv, float scale, float *s) {
    const int64_t nblocks = (len + block_size - 1) / block_size;
    for (int64_t p = 0; p < len; p++) {
        if (p % block_size == 0)
            prefetch_block(k, table, p / block_size + 1, nblocks, block_size, kv * d);
        const uint16_t *kp = row_at(k, table, p, block_size, kv * d);
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *kh = kp + (h / group) * d;
            float part[LANES] = {0};
            for (int64_t j = 0; j < d; j += LANES)
                for (int l = 0; l < LANES; l++)
                    part[l] += qf[h * d + j + l] * bf16_to_f32(kh[j + l]);
            float dot = 0.0f;
            for (int l = 0; l < LANES; l++)
                dot += part[l];
            s[h * len + p] = dot * scale;
        }
    }
}

/* acc[h][:] = sum_p w[h * len + p] v_p[g(h)] (acc: float32 [heads][d], zeroed first). */
PLAIN_ATTR static void PLAIN(values)(const float *w, int64_t heads, int64_t group, int64_t d, const uint16_t *v,
                         const int32_t *table, int64_t len, int64_t block_size, int64_t kv, float *acc) {
    const int64_t nblocks = (len + block_size - 1) / block_size;
    for (int64_t i = 0; i < heads * d; i++)
        acc[i] = 0.0f;
    for (int64_t p = 0; p < len; p++) {
        if (p % block_size == 0)
            prefetch_block(v, table, p / block_size + 1, nblocks, block_size, kv * d);
        const uint16_t *vp = row_at(v, table, p, block_size, kv * d);
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *vh = vp + (h / group) * d;
            const float wh = w[h * len + p];
            for (int64_t j = 0; j < d; j++)
                acc[h * d + j] += wh * bf16_to_f32(vh[j]);
        }
    }
}

/* e^(sh[p] - m) in place for p < len (exp_f32); returns their sum. */
PLAIN_ATTR static float PLAIN(softmax_exp)(float *sh, int64_t len, float m) {
    float part[LANES] = {0}, sum = 0.0f;
    const int64_t whole = len - len % LANES;
    for (int64_t p = 0; p < len; p++)
        sh[p] = exp_f32(sh[p] - m);  /* a NaN score stays NaN */
    for (int64_t p = 0; p < whole; p += LANES)
        for (int l = 0; l < LANES; l++)
            part[l] += sh[p + l];
    for (int l = 0; l < LANES; l++)
        sum += part[l];
    for (int64_t p = whole; p < len; p++)
        sum += sh[p];
    return sum;
}
