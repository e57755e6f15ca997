/* Element-wise steps of a bf16 Llama layer on a CPU, each in one pass (fast/engine/fused_c.py says why).
 *
 *   unf_rope_write_bf16    q, k of a fused qkv row rotated by RoPE (x cos + roll(x, d/2) signed_sin, float32,
 *                          the same three roundings as torch), q into out, k and v into their cache slots
 *   unf_add_mean_squares   the residual add x + float(delta) (delta: a product's bf16 output), then the first half
 *                          of RMSNorm: mean(x^2) + eps per row, with the sum of squares added in the very order
 *                          ATen adds a float32 row (its cascade sum, below)
 *   unf_scale_rows_bf16    the second half, bf16(x / r * w) per row, r = sqrt(mean(x^2) + eps) taken by torch in
 *                          between (torch's float32 sqrt is not the correctly rounded one of C: MKL's, about one ulp)
 *   unf_add_rms_norm_bf16  both halves in one call, the sqrt by the very function torch calls for it (MKL's vector
 *                          sqrt, whose address the caller passes)
 *   unf_silu_mul_bf16      bf16(bf16(silu(gate)) * up) from a fused gate/up row, silu as torch computes it for bf16:
 *                          in 64-value steps torch's vectorised silu, looked up in a table of all 65536 bf16 gates
 *                          that torch itself computed (the caller passes it), the rest of a row g / (1 + expf(-g))
 *                          in float32 (torch's scalar loop); AVX-512 only
 * Rounding to bf16 is to nearest even (NaN stays a quiet NaN): bit for bit torch's.
 *
 * Built by fast/build_c.py (-O3 -std=c99: no contraction into FMAs, so each product and sum is
 * rounded as torch rounds it). On x86-64 with GCC or Clang the loops also exist in AVX-512 (target attributes),
 * taken when the CPU has it (simd != 0); they perform the very same float32 operations in the same order as the
 * plain loops, so both give the same bits (the tests check).
 */
#pragma STDC FP_CONTRACT OFF
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
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


/* ---- RMSNorm in torch's summation order ----
 * fast/engine/model.py computes rms_norm as x / sqrt((x * x).mean(-1) + eps) * w; ATen's mean of a float32 CPU
 * tensor is its sum divided by the row length, and its sum of a contiguous row (aten/src/ATen/native/cpu/
 * SumKernel.cpp, cascade_sum) adds in this order, where a "group" is one vector of `lanes` floats (the width of
 * the sum kernel torch runs: 8 for its AVX2 kernel, which torch 2.13 runs even on an AVX-512 CPU since the sum has
 * no AVX512 registration; fast/engine/fused_c.py finds the width on a probe), or one float for a row shorter than
 * a vector:
 *   - the groups are read four at a time (a "row" of four independent accumulators, for instruction parallelism);
 *   - rows are added into level 0; every `step` rows (step = 2^max(4, ceil(log2(rows)) / 4)) level 0 is added
 *     into level 1 and cleared, and so on up to level 3 while the row count is a multiple of the level's step
 *     (a cascade: only sums of similar size meet);
 *   - the rows left over go into level 0; then levels 1, 2, 3 are added into level 0;
 *   - groups left over (fewer than four) go into accumulator 0, then accumulators 1, 2, 3 are added into it;
 *   - for vectors: the floats left over (fewer than a vector) are summed from 0, then the vector's lanes in order.
 * Each addition is one float32 rounding; no reassociation (-std=c99, no fast-math, FP_CONTRACT OFF), so the
 * plain loops below give ATen's bits, and so do the AVX-512 ones (the same additions, lane by lane). */
#define MAX_LANES 16

static int64_t ceil_log2(int64_t x) {  /* as ATen's utils::CeilLog2: 1 for x <= 2 */
    if (x <= 2)
        return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1)
        bits++;
    return bits;
}

static void add_squares(float acc[4][MAX_LANES], const float *x, int64_t g) {  /* one row: four groups */
    for (int k = 0; k < 4; k++)
        for (int64_t l = 0; l < g; l++)
            acc[k][l] += x[k * g + l] * x[k * g + l];
}

static float sum_squares_plain(const float *x, int64_t n, int64_t lanes) {
    const int64_t g = n < lanes ? 1 : lanes, groups = n / g, rows = groups / 4;
    const int64_t lc = ceil_log2(rows) / 4, power = lc > 4 ? lc : 4, step = (int64_t)1 << power, mask = step - 1;
    float acc[4][4][MAX_LANES];
    memset(acc, 0, sizeof(acc));
    int64_t i = 0;
    while (i + step <= rows) {
        for (int64_t j = 0; j < step; j++, i++)
            add_squares(acc[0], x + i * 4 * g, g);
        for (int lev = 1; lev < 4; lev++) {
            for (int k = 0; k < 4; k++)
                for (int64_t l = 0; l < g; l++) {
                    acc[lev][k][l] += acc[lev - 1][k][l];
                    acc[lev - 1][k][l] = 0.0f;
                }
            if (i & (mask << (lev * power)))
                break;
        }
    }
    for (; i < rows; i++)
        add_squares(acc[0], x + i * 4 * g, g);
    for (int lev = 1; lev < 4; lev++)
        for (int k = 0; k < 4; k++)
            for (int64_t l = 0; l < g; l++)
                acc[0][k][l] += acc[lev][k][l];
    for (int64_t r = rows * 4; r < groups; r++)
        for (int64_t l = 0; l < g; l++)
            acc[0][0][l] += x[r * g + l] * x[r * g + l];
    for (int k = 1; k < 4; k++)
        for (int64_t l = 0; l < g; l++)
            acc[0][0][l] += acc[0][k][l];
    if (g == 1)
        return acc[0][0][0];
    float total = 0.0f;
    for (int64_t j = groups * g; j < n; j++)
        total += x[j] * x[j];
    for (int64_t l = 0; l < g; l++)
        total += acc[0][0][l];
    return total;
}

static void add_mean_squares_plain(const float *x, const uint16_t *delta, float *x_out, int64_t n, int64_t h,
                                   float eps, int64_t lanes, float *ms) {
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * h;
        if (delta != NULL) {
            float *yi = x_out + i * h;
            for (int64_t j = 0; j < h; j++)
                yi[j] = xi[j] + bf16_to_f32(delta[i * h + j]);
            xi = yi;
        }
        if (ms != NULL)
            ms[i] = sum_squares_plain(xi, h, lanes) / (float)h + eps;
    }
}

static void scale_rows_plain(const float *x, const float *r, const float *w, int64_t n, int64_t h, uint16_t *out) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < h; j++)
            out[i * h + j] = f32_to_bf16(x[i * h + j] / r[i] * w[j]);
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


/* sum_squares_plain for n >= W lanes, a W-wide vector per group: the same additions, lane by lane. */
#define SUM_SQUARES(NAME, VEC, W, LOAD, ADD, MUL, ZERO, STORE)                                                    \
AVX512 static float NAME(const float *x, int64_t n) {                                                            \
    const int64_t groups = n / W, rows = groups / 4;                                                              \
    const int64_t lc = ceil_log2(rows) / 4, power = lc > 4 ? lc : 4, step = (int64_t)1 << power, mask = step - 1; \
    VEC acc[4][4];                                                                                                \
    for (int lev = 0; lev < 4; lev++)                                                                             \
        for (int k = 0; k < 4; k++)                                                                               \
            acc[lev][k] = ZERO();                                                                                 \
    int64_t i = 0;                                                                                                \
    while (i + step <= rows) {                                                                                    \
        for (int64_t j = 0; j < step; j++, i++)                                                                   \
            for (int k = 0; k < 4; k++) {                                                                         \
                const VEC v = LOAD(x + (i * 4 + k) * W);                                                          \
                acc[0][k] = ADD(acc[0][k], MUL(v, v));                                                            \
            }                                                                                                     \
        for (int lev = 1; lev < 4; lev++) {                                                                       \
            for (int k = 0; k < 4; k++) {                                                                         \
                acc[lev][k] = ADD(acc[lev][k], acc[lev - 1][k]);                                                  \
                acc[lev - 1][k] = ZERO();                                                                         \
            }                                                                                                     \
            if (i & (mask << (lev * power)))                                                                      \
                break;                                                                                            \
        }                                                                                                         \
    }                                                                                                             \
    for (; i < rows; i++)                                                                                         \
        for (int k = 0; k < 4; k++) {                                                                             \
            const VEC v = LOAD(x + (i * 4 + k) * W);                                                              \
            acc[0][k] = ADD(acc[0][k], MUL(v, v));                                                                \
        }                                                                                                         \
    for (int lev = 1; lev < 4; lev++)                                                                             \
        for (int k = 0; k < 4; k++)                                                                               \
            acc[0][k] = ADD(acc[0][k], acc[lev][k]);                                                              \
    VEC p = acc[0][0];                                                                                            \
    for (int64_t r = rows * 4; r < groups; r++) {                                                                 \
        const VEC v = LOAD(x + r * W);                                                                            \
        p = ADD(p, MUL(v, v));                                                                                    \
    }                                                                                                             \
    for (int k = 1; k < 4; k++)                                                                                   \
        p = ADD(p, acc[0][k]);                                                                                    \
    float lanes[W], total = 0.0f;                                                                                 \
    STORE(lanes, p);                                                                                              \
    for (int64_t j = groups * W; j < n; j++)                                                                      \
        total += x[j] * x[j];                                                                                     \
    for (int l = 0; l < W; l++)                                                                                   \
        total += lanes[l];                                                                                        \
    return total;                                                                                                 \
}
SUM_SQUARES(sum_squares_x16, __m512, 16, _mm512_loadu_ps, _mm512_add_ps, _mm512_mul_ps, _mm512_setzero_ps,
            _mm512_storeu_ps)
SUM_SQUARES(sum_squares_x8, __m256, 8, _mm256_loadu_ps, _mm256_add_ps, _mm256_mul_ps, _mm256_setzero_ps,
            _mm256_storeu_ps)

AVX512 static inline __mmask16 live(int64_t left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

AVX512 static void add_mean_squares_avx512(const float *x, const uint16_t *delta, float *x_out, int64_t n,
                                           int64_t h, float eps, int64_t lanes, float *ms) {
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * h;
        if (delta != NULL) {
            float *yi = x_out + i * h;
            for (int64_t j = 0; j < h; j += 16) {
                const __mmask16 m = live(h - j);
                _mm512_mask_storeu_ps(yi + j, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, xi + j),
                                                               load_bf16x16(delta + i * h + j, m)));
            }
            xi = yi;
        }
        if (ms != NULL)
            ms[i] = (lanes == 16 ? sum_squares_x16(xi, h) : sum_squares_x8(xi, h)) / (float)h + eps;
    }
}

AVX512 static void scale_rows_avx512(const float *x, const float *r, const float *w, int64_t n, int64_t h,
                                     uint16_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const __m512 ri = _mm512_set1_ps(r[i]);
        for (int64_t j = 0; j < h; j += 16) {
            const __mmask16 m = live(h - j);
            store_bf16x16(out + i * h + j, _mm512_mul_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(m, x + i * h + j), ri),
                                                         _mm512_maskz_loadu_ps(m, w + j)), m);
        }
    }
}

/* silu(gate) * up over rows of a fused projection gu: bf16 [n, stride], gate = columns [0, inter), up = [inter,
 * 2 inter). torch's silu on bf16 (ATen's silu_kernel) widens 32 values at a time, two vectors per step (64 values),
 * computes g / (1 + exp(-g)) with its vectorised exp, and rounds to bf16; the values past the last whole step of
 * a row go through its scalar loop (std::exp, i.e. expf). A bf16 gate has only 65536 values, so the vectorised
 * result is a table: ``table[b]`` = the bits of torch's silu of the bf16 with bits b (made by torch itself, the
 * caller's ``F.silu`` over all 65536 values, 65538 entries: the gather reads 32 bits), looked up 16 at a time.
 * torch's mul then widens both bf16 factors, multiplies in float32 and rounds. */
AVX512 static void silu_mul_avx512(const uint16_t *gu, int64_t n, int64_t inter, int64_t stride, uint16_t *out,
                                   const uint16_t *table) {
    const int64_t whole = inter - inter % 64;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *g = gu + i * stride, *u = g + inter;
        uint16_t *o = out + i * inter;
        for (int64_t j = 0; j < whole; j += 16) {
            const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + j)));
            const __m512i t = _mm512_i32gather_epi32(idx, (const void *)table, 2);  /* table[idx] in the low half */
            const __m512 sb = _mm512_castsi512_ps(_mm512_slli_epi32(t, 16));
            store_bf16x16(o + j, _mm512_mul_ps(sb, load_bf16x16(u + j, 0xFFFF)), 0xFFFF);
        }
        for (int64_t j = whole; j < inter; j++) {
            const float x = bf16_to_f32(g[j]);
            const float sv = bf16_to_f32(f32_to_bf16(x / (1.0f + expf(-x))));
            o[j] = f32_to_bf16(sv * bf16_to_f32(u[j]));
        }
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

/* x: float32 [n, h]; delta: bf16 [n, h] or NULL; x_out: float32 [n, h] (may be x); ms: float32 [n] or NULL.
 * With delta: x_out = x + float(delta), and the means are those of x_out; without: of x (x_out untouched). ms NULL:
 * the add alone. ms[i] = sum(row i squared) / h + eps, the sum in ATen's order for `lanes`-wide vectors (8 or 16,
 * the width of torch's sum kernel). Returns 0; 1: lanes not 8 or 16; 2: h < 1. */
int unf_add_mean_squares(const float *x, const uint16_t *delta, float *x_out, int64_t n, int64_t h, float eps,
                         float *ms, int64_t lanes, int simd) {
    if (lanes != 8 && lanes != 16)
        return 1;
    if (h < 1)
        return 2;
#ifdef HAVE_AVX512_PATH
    if (avx512(simd) && h >= lanes) {
        add_mean_squares_avx512(x, delta, x_out, n, h, eps, lanes, ms);
        return 0;
    }
#endif
    add_mean_squares_plain(x, delta, x_out, n, h, eps, lanes, ms);
    return 0;
}

/* MKL's vector sqrt, Fortran binding (VMSSQRT_): r[i] = sqrt(a[i]) for i < *n, accuracy and error mode in *mode. */
typedef void (*vml_sqrt_fn)(const int32_t *n, const float *a, float *r, const int64_t *mode);
#define VML_MODE_OF_TORCH 0x140102  /* VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE: what ATen's vml::vsqrt passes */

/* x: float32 [n, h]; r: float32 [n]; w: float32 [h]; out: bf16 [n, h] = x / r[row] * w (each step rounded). */
void unf_scale_rows_bf16(const float *x, const float *r, const float *w, int64_t n, int64_t h, uint16_t *out,
                         int simd) {
#ifdef HAVE_AVX512_PATH
    if (avx512(simd)) {
        scale_rows_avx512(x, r, w, n, h, out);
        return;
    }
#endif
    scale_rows_plain(x, r, w, n, h, out);
}

/* gu: bf16 [n, stride] (gate: columns [0, inter), up: [inter, 2 inter)); out: bf16 [n, inter]; table: uint16
 * [65538], torch's bf16 silu of every bf16 (silu_mul_avx512). Returns 0; 1: no AVX-512 here (or simd 0, or no table),
 * nothing written; 2: a stride below 2 inter. */
int unf_silu_mul_bf16(const uint16_t *gu, int64_t n, int64_t inter, int64_t stride, uint16_t *out,
                      const uint16_t *table, int simd) {
    if (stride < 2 * inter)
        return 2;
#ifdef HAVE_AVX512_PATH
    if (avx512(simd) && table != NULL) {
        silu_mul_avx512(gu, n, inter, stride, out, table);
        return 0;
    }
#endif
    (void)gu; (void)n; (void)out; (void)table; (void)simd;
    return 1;
}

/* unf_add_mean_squares, then sqrt of the n means by vml_sqrt (torch's own: MKL's VMSSQRT_ with ATen's mode), then
 * unf_scale_rows_bf16: the whole residual add + RMSNorm in one call. x_out as there (with delta NULL: the norm of x).
 * Returns 0; 1, 2 as unf_add_mean_squares; 4: no memory for the n means; 5: n too large for MKL's 32-bit count. */
int unf_add_rms_norm_bf16(const float *x, const uint16_t *delta, float *x_out, const float *w, int64_t n, int64_t h,
                          float eps, uint16_t *out, int64_t lanes, void *vml_sqrt, int simd) {
    if (n > 0x7FFFFFFF)
        return 5;
    float stack[256];
    float *ms = n <= 256 ? stack : (float *)malloc((size_t)n * sizeof(float));
    if (ms == NULL)
        return 4;
    int bad = unf_add_mean_squares(x, delta, x_out, n, h, eps, ms, lanes, simd);
    if (!bad && n > 0) {
        vml_sqrt_fn f;
        memcpy(&f, &vml_sqrt, sizeof f);
        const int32_t count = (int32_t)n;
        const int64_t mode = VML_MODE_OF_TORCH;
        f(&count, ms, ms, &mode);
        unf_scale_rows_bf16(delta != NULL ? x_out : x, ms, w, n, h, out, simd);
    }
    if (ms != stack)
        free(ms);
    return bad;
}
