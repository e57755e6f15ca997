/* Fused element-wise steps of a bf16 Llama layer on a CPU: what several torch calls do, in one pass each.
 *
 * The fast model keeps its residual stream in float32 and feeds the matrix products bf16 (fast/engine/model.py).
 * Between two products torch runs 4-8 small element-wise calls, each reading and writing the whole activation
 * and each paying its dispatch cost; here each group is one loop:
 *   unf_rms_norm_bf16      out = bf16(x / sqrt(mean(x^2) + eps) * w)                 (x float32 [n, h])
 *   unf_add_rms_norm_bf16  x += float(delta) (delta bf16, a product's output), then the norm above into out
 *                          (out NULL: the add alone)
 *   unf_rope_write_bf16    q, k of a fused qkv row rotated by RoPE (x cos + roll(x, d/2) signed_sin, float32,
 *                          the same three roundings as torch), q into out, k and v into their cache slots
 * Rounding to bf16 is to nearest even (NaN stays a quiet NaN). RoPE is bit-for-bit torch's; the norm differs
 * from torch's only in the order its sum of squares is added (16 partial sums). (silu times up is left to torch:
 * its vectorised exp is faster than a polynomial written here, measured.)
 *
 * Built by fast/codec/native_build.py (-O3 -std=c99: no contraction into FMAs, so each product and sum is
 * rounded as torch rounds it). On x86-64 with GCC or Clang the loops also exist in AVX-512 (target attributes),
 * taken when the CPU has it (simd != 0); they perform the very same float32 operations in the same order as the
 * plain loops, so both give the same bits (the tests check).
 */
#pragma STDC FP_CONTRACT OFF
#include <math.h>
#include <stdint.h>
#include <string.h>


#define LANES 16

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)((u >> 16) | 0x40) : r;
}

/* 1 / sqrt(mean(x^2) + eps) is not what torch computes: it divides by sqrt(mean + eps). So do we. */
static inline float rms_of(const float *x, int64_t h, float eps) {
    float part[LANES] = {0}, ss = 0.0f;
    const int64_t whole = h - h % LANES;
    for (int64_t j = 0; j < whole; j += LANES)
        for (int l = 0; l < LANES; l++)
            part[l] += x[j + l] * x[j + l];
    for (int l = 0; l < LANES; l++)
        ss += part[l];
    for (int64_t j = whole; j < h; j++)
        ss += x[j] * x[j];
    return sqrtf(ss / (float)h + eps);
}

static void rms_norm_bf16_plain(const float *x, const float *w, int64_t n, int64_t h, float eps, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * h;
        const float r = rms_of(xi, h, eps);
        uint16_t *oi = out + i * h;
        for (int64_t j = 0; j < h; j++)
            oi[j] = f32_to_bf16(xi[j] / r * w[j]);
    }
}

static void add_rms_norm_bf16_plain(float *x, const uint16_t *delta, const float *w, int64_t n, int64_t h, float eps,
                           uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        float *xi = x + i * h;
        const uint16_t *di = delta + i * h;
        for (int64_t j = 0; j < h; j++)
            xi[j] = xi[j] + bf16_to_f32(di[j]);
        if (out == NULL)
            continue;
        const float r = rms_of(xi, h, eps);
        uint16_t *oi = out + i * h;
        for (int64_t j = 0; j < h; j++)
            oi[j] = f32_to_bf16(xi[j] / r * w[j]);
    }
}

static void rope_write_plain(const uint16_t *qkv, int64_t n, int64_t heads, int64_t kv, int64_t d,
                        const float *cos, const float *ssin, int64_t num_positions, const int64_t *positions,
                        const int64_t *slots, int64_t num_slots, uint16_t *k, uint16_t *v, uint16_t *q_out) {
    (void)num_positions, (void)num_slots;
    const int64_t half = d / 2, width = (heads + 2 * kv) * d;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *row = qkv + i * width;
        const float *c = cos + positions[i] * d, *s = ssin + positions[i] * d;
        for (int64_t h = 0; h < heads + kv; h++) {
            const uint16_t *x = row + h * d;
            uint16_t *o = h < heads ? q_out + (i * heads + h) * d : k + (slots[i] * kv + (h - heads)) * d;
            for (int64_t j = 0; j < d; j++) {
                const float a = bf16_to_f32(x[j]) * c[j];
                const float b = bf16_to_f32(x[j < half ? j + half : j - half]) * s[j];
                o[j] = f32_to_bf16(a + b);
            }
        }
        memcpy(v + slots[i] * kv * d, row + (heads + kv) * d, (size_t)(kv * d) * 2);
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512_PATH 1
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

AVX512 static inline __m512 load_bf16x16(const uint16_t *x, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, x)), 16));
}

AVX512 static inline __m512i bf16_bits(__m512 x) {  /* f32_to_bf16 on 16 lanes, in the low half of each */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000), _MM_CMPINT_NLE);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

AVX512 static inline void store_bf16x16(uint16_t *out, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(out, m, _mm512_cvtepi32_epi16(bf16_bits(x)));
}

AVX512 static inline __mmask16 live(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

AVX512 static inline float rms_of_avx512(const float *x, int64_t h, float eps) {  /* rms_of, same order */
    const int64_t whole = h - h % LANES;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < whole; j += LANES) {
        const __m512 xj = _mm512_loadu_ps(x + j);
        acc = _mm512_add_ps(acc, _mm512_mul_ps(xj, xj));
    }
    float part[LANES], ss = 0.0f;
    _mm512_storeu_ps(part, acc);
    for (int l = 0; l < LANES; l++)
        ss += part[l];
    for (int64_t j = whole; j < h; j++)
        ss += x[j] * x[j];
    return sqrtf(ss / (float)h + eps);
}

AVX512 static void norm_row_avx512(const float *x, const float *w, int64_t h, float eps, uint16_t *out) {
    const __m512 r = _mm512_set1_ps(rms_of_avx512(x, h, eps));
    for (int64_t j = 0; j < h; j += 16) {
        const __mmask16 m = live(h - j);
        store_bf16x16(out + j, _mm512_mul_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + j), r),
                                             _mm512_maskz_loadu_ps(m, w + j)), m);
    }
}

AVX512 static void rms_norm_avx512(const float *x, const float *w, int64_t n, int64_t h, float eps, uint16_t *out) {
    for (int64_t i = 0; i < n; i++)
        norm_row_avx512(x + i * h, w, h, eps, out + i * h);
}

AVX512 static void add_rms_norm_avx512(float *x, const uint16_t *delta, const float *w, int64_t n, int64_t h,
                                       float eps, uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        float *xi = x + i * h;
        for (int64_t j = 0; j < h; j += 16) {
            const __mmask16 m = live(h - j);
            _mm512_mask_storeu_ps(xi + j, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, xi + j),
                                                           load_bf16x16(delta + i * h + j, m)));
        }
        if (out != NULL)
            norm_row_avx512(xi, w, h, eps, out + i * h);
    }
}

AVX512 static void rope_write_avx512(const uint16_t *qkv, int64_t n, int64_t heads, int64_t kv, int64_t d,
                                     const float *cos, const float *ssin, const int64_t *positions,
                                     const int64_t *slots, uint16_t *k, uint16_t *v, uint16_t *q_out) {
    const int64_t half = d / 2, width = (heads + 2 * kv) * d;  /* d % 32 == 0: halves of whole vectors */
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *row = qkv + i * width;
        const float *c = cos + positions[i] * d, *s = ssin + positions[i] * d;
        for (int64_t h = 0; h < heads + kv; h++) {
            const uint16_t *x = row + h * d;
            uint16_t *o = h < heads ? q_out + (i * heads + h) * d : k + (slots[i] * kv + (h - heads)) * d;
            for (int64_t j = 0; j < d; j += 16) {
                const int64_t jr = j < half ? j + half : j - half;
                const __m512 a = _mm512_mul_ps(load_bf16x16(x + j, 0xFFFF), _mm512_loadu_ps(c + j));
                const __m512 b = _mm512_mul_ps(load_bf16x16(x + jr, 0xFFFF), _mm512_loadu_ps(s + j));
                store_bf16x16(o + j, _mm512_add_ps(a, b), 0xFFFF);
            }
        }
        memcpy(v + slots[i] * kv * d, row + (heads + kv) * d, (size_t)(kv * d) * 2);
    }
}
#endif

static int avx512(int simd) {
#ifdef HAVE_AVX512_PATH
    return simd && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
#else
    (void)simd;
    return 0;
#endif
}

/* 1 where the AVX-512 loops run. */
int unf_fused_simd(void) { return avx512(1); }

void unf_rms_norm_bf16(const float *x, const float *w, int64_t n, int64_t h, float eps, uint16_t *out, int simd) {
#ifdef HAVE_AVX512_PATH
    if (avx512(simd)) {
        rms_norm_avx512(x, w, n, h, eps, out);
        return;
    }
#endif
    rms_norm_bf16_plain(x, w, n, h, eps, out);
}

void unf_add_rms_norm_bf16(float *x, const uint16_t *delta, const float *w, int64_t n, int64_t h, float eps,
                           uint16_t *out, int simd) {
#ifdef HAVE_AVX512_PATH
    if (avx512(simd)) {
        add_rms_norm_avx512(x, delta, w, n, h, eps, out);
        return;
    }
#endif
    add_rms_norm_bf16_plain(x, delta, w, n, h, eps, out);
}

/* qkv: bf16 [n, (heads + 2 kv) d]; positions int64 [n] into the tables cos, ssin: float32 [num_positions, d];
 * slots int64 [n] into the caches k, v: bf16 [num_slots, kv, d]; q_out: bf16 [n, heads, d].
 * Returns 0; 1: a position outside [0, num_positions); 2: a slot outside [0, num_slots); 3: d odd. */
int unf_rope_write_bf16(const uint16_t *qkv, int64_t n, int64_t heads, int64_t kv, int64_t d, const float *cos,
                        const float *ssin, int64_t num_positions, const int64_t *positions, const int64_t *slots,
                        int64_t num_slots, uint16_t *k, uint16_t *v, uint16_t *q_out, int simd) {
    if (d % 2)
        return 3;
    for (int64_t i = 0; i < n; i++) {
        if (positions[i] < 0 || positions[i] >= num_positions)
            return 1;
        if (slots[i] < 0 || slots[i] >= num_slots)
            return 2;
    }
#ifdef HAVE_AVX512_PATH
    if (avx512(simd) && d % 32 == 0) {
        rope_write_avx512(qkv, n, heads, kv, d, cos, ssin, positions, slots, k, v, q_out);
        return 0;
    }
#endif
    rope_write_plain(qkv, n, heads, kv, d, cos, ssin, num_positions, positions, slots, num_slots, k, v, q_out);
    return 0;
}
