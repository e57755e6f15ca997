/* Paged decode attention on a CPU, bf16 cache and queries, straight over the block tables.
 *
 * One query token per sequence (a decode row). For sequence i and kv head g, the GROUP query heads
 * sharing g read that head's keys and values in place, block by block through the block table, up
 * to the sequence's length: no gather into padded copies, no padding, and no slot past the length is
 * ever read (whatever it holds). Per head: scores s_j = (q . k_j) * scale, summed in float32 (16
 * partial sums over d, then added together); softmax in float32 (the maximum subtracted; exp by
 * ``exp_f32`` below, within 2 ulp of expf); o = sum_j p_j v_j / sum_j p_j in float32, rounded once to
 * bf16 (nearest even). Every bf16 input is widened exactly to float32.
 *
 * Built by fast/codec/native_build.py (-O3 -std=c99); on x86-64 GCC/Clang the kernel is compiled three
 * times (AVX-512, AVX2+FMA, baseline) and the CPU picks one when the library loads.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define LANES 16

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even; NaN stays a (quiet) NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* e^x for x <= 0 (the softmax's shifted scores): 2^n * e^r, |r| <= ln2/2, r by a two-part ln2 (Cody-Waite),
 * e^r by a degree-6 polynomial (Cephes' expf coefficients); below -87.3 the result is 0. Branch-free so that
 * loops over it vectorise. */
static inline float exp_f32(float x) {
    float xc = x < -87.3f ? -87.3f : x;
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return x < -87.3f ? 0.0f : p * scale;
}

/* q: bf16 [*, heads, D] (row rows[i] for sequence i); k, v: bf16 [num_blocks, block_size, kv, D];
 * tables: int32 [B, table_width]; seq_lens: int32 [B]; chunks[i]: sequence i's row in tables/seq_lens;
 * out: bf16 [*, heads, D] (row rows[i]). scratch: float32 of group * max_len entries.
 * Returns 0; 1: a length outside [1, min(max_len, table_width * block_size)]; 2: a block id outside [0, num_blocks);
 * 3: head sizes this kernel does not take (D not a multiple of 16, or above 256). */
CLONES
int unf_decode_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *tables,
                         const int32_t *seq_lens, const int64_t *chunks, const int64_t *rows, int64_t n,
                         int64_t heads, int64_t kv, int64_t d, int64_t block_size, int64_t num_blocks,
                         int64_t table_width, int64_t max_len, float scale, float *scratch, uint16_t *out) {
    if (d % LANES != 0 || d > 256 || kv <= 0 || heads % kv != 0)
        return 3;
    const int64_t group = heads / kv;
    for (int64_t i = 0; i < n; i++) {
        const int64_t c = chunks[i], len = seq_lens[c];
        if (len < 1 || len > max_len || len > table_width * block_size)
            return 1;
        const int32_t *table = tables + c * table_width;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks)
                return 2;
        for (int64_t g = 0; g < kv; g++) {
            float qf[16][256];  /* at most 16 query heads per kv head */
            float acc[16][256];
            int64_t hs = group;
            if (hs > 16)
                return 3;
            const uint16_t *qrow = q + (rows[i] * heads + g * group) * d;
            for (int64_t h = 0; h < hs; h++)
                for (int64_t j = 0; j < d; j++)
                    qf[h][j] = bf16_to_f32(qrow[h * d + j]);
            float *s = scratch;  /* s[h * len + p] */
            for (int64_t p = 0; p < len; p++) {
                const uint16_t *kp = k + (((int64_t)table[p / block_size] * block_size + p % block_size) * kv + g) * d;
                float kf[256];
                for (int64_t j = 0; j < d; j++)
                    kf[j] = bf16_to_f32(kp[j]);
                for (int64_t h = 0; h < hs; h++) {
                    float part[LANES] = {0};
                    for (int64_t j = 0; j < d; j += LANES)
                        for (int l = 0; l < LANES; l++)
                            part[l] += qf[h][j + l] * kf[j + l];
                    float dot = 0.0f;
                    for (int l = 0; l < LANES; l++)
                        dot += part[l];
                    s[h * len + p] = dot * scale;
                }
            }
            float total[16];
            for (int64_t h = 0; h < hs; h++) {
                float *sh = s + h * len, top[LANES], part[LANES] = {0}, m = sh[0];
                for (int l = 0; l < LANES; l++)
                    top[l] = sh[0];
                int64_t whole = len - len % LANES;
                for (int64_t p = 0; p < whole; p += LANES)
                    for (int l = 0; l < LANES; l++)
                        top[l] = sh[p + l] > top[l] ? sh[p + l] : top[l];
                for (int l = 0; l < LANES; l++)
                    m = top[l] > m ? top[l] : m;
                for (int64_t p = whole; p < len; p++)
                    m = sh[p] > m ? sh[p] : m;
                if (!(m > -INFINITY && m < INFINITY))  /* inf among the scores: no shift (the result is NaN) */
                    m = 0.0f;
                for (int64_t p = 0; p < len; p++)
                    sh[p] = exp_f32(sh[p] - m);  /* a NaN score stays NaN */
                for (int64_t p = 0; p < whole; p += LANES)
                    for (int l = 0; l < LANES; l++)
                        part[l] += sh[p + l];
                float sum = 0.0f;
                for (int l = 0; l < LANES; l++)
                    sum += part[l];
                for (int64_t p = whole; p < len; p++)
                    sum += sh[p];
                total[h] = sum;
                for (int64_t j = 0; j < d; j++)
                    acc[h][j] = 0.0f;
            }
            for (int64_t p = 0; p < len; p++) {
                const uint16_t *vp = v + (((int64_t)table[p / block_size] * block_size + p % block_size) * kv + g) * d;
                float vf[256];
                for (int64_t j = 0; j < d; j++)
                    vf[j] = bf16_to_f32(vp[j]);
                for (int64_t h = 0; h < hs; h++) {
                    const float w = s[h * len + p];
                    for (int64_t j = 0; j < d; j++)
                        acc[h][j] += w * vf[j];
                }
            }
            uint16_t *orow = out + (rows[i] * heads + g * group) * d;
            for (int64_t h = 0; h < hs; h++) {
                                for (int64_t j = 0; j < d; j++)
                    orow[h * d + j] = f32_to_bf16(acc[h][j] / total[h]);
            }
        }
    }
    return 0;
}
