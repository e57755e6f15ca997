/* RoPE and the KV cache write of a bf16 Llama layer on a CPU, in one pass (fast/engine/fused.py says why).
 *
 *   unf_rope_write_bf16    q, k of a fused qkv row rotated by RoPE (x cos + roll(x, d/2) signed_sin, float32,
 *                          the same three roundings as torch), q into out, k and v into their cache slots
 * Rounding to bf16 is to nearest even (NaN stays a quiet NaN): bit for bit torch's.
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

static void rope_write_plain(const uint16_t *qkv, int64_t n, int64_t heads, int64_t kv, int64_t d,
                             const float *cos, const float *ssin, const int64_t *positions, const int64_t *slots,
                             uint16_t *k, uint16_t *v, uint16_t *q_out) {
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
    rope_write_plain(qkv, n, heads, kv, d, cos, ssin, positions, slots, k, v, q_out);
    return 0;
}
