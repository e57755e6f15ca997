/* Paged decode attention on a CPU, bf16 cache and queries, straight over the block tables.
 *
 * One query token per row: a decode row, or one row of a prefill chunk (attending to the positions up to its
 * own, given per row). For sequence i and kv head g, the GROUP query heads
 * sharing g read that head's keys and values in place, block by block through the block table, up
 * to the sequence's length: no gather into padded copies, no padding, and no slot past the length is
 * ever read (whatever it holds). Per head: scores s_j = (q . k_j) * scale, summed in float32 (16
 * partial sums over d, then added together); softmax in float32 (the maximum subtracted; exp by
 * ``exp_f32`` below, within 2 ulp of expf); o = sum_j p_j v_j / sum_j p_j in float32, rounded once to
 * bf16 (nearest even). Every bf16 input is widened exactly to float32.
 *
 * Built by fast/build_c.py (-O3 -std=c99); on x86-64 with GCC or Clang the hot loops also exist in
 * AVX-512 (target attributes), taken when the CPU has it; otherwise plain C loops that the compiler vectorises
 * (UNFIRE_NATIVE_SIMD=0 takes those everywhere).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

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

/* The K or V row of position p: [kv * d] bf16, in the block the table names. */
static inline const uint16_t *row_at(const uint16_t *store, const int32_t *table, int64_t p, int64_t block_size,
                                     int64_t width) {
    return store + ((int64_t)table[p / block_size] * block_size + p % block_size) * width;
}

/* Hint the cache to load block ``table[b]`` (rows of ``width`` bf16) ahead of use: the tables scatter blocks,
 * so the hardware prefetcher only follows a block once it is being read. */
static inline void prefetch_block(const uint16_t *store, const int32_t *table, int64_t b, int64_t nblocks,
                                  int64_t block_size, int64_t width) {
    if (b >= nblocks)
        return;
    const char *start = (const char *)(store + (int64_t)table[b] * block_size * width);
    for (int64_t off = 0; off < block_size * width * 2; off += 64)
        __builtin_prefetch(start + off, 0, 3);
}

#define PLAIN_ATTR
#define PLAIN(name) name##_plain
#include "attention_plain.h"
#undef PLAIN_ATTR
#undef PLAIN
#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_PLAIN 1
#define PLAIN_ATTR __attribute__((target("avx2")))
#define PLAIN(name) name##_avx2
#include "attention_plain.h"
#undef PLAIN_ATTR
#undef PLAIN
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512_PATH 1

__attribute__((target("avx512f")))
static inline __m512 load_bf16x16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

/* scores_plain with AVX-512: 16 lanes over d, the lanes of each dot product summed as a tree. */
__attribute__((target("avx512f")))
static void scores_avx512(const float *qf, int64_t group, int64_t d, const uint16_t *k,
                          const int32_t *table, int64_t len, int64_t block_size, int64_t kv, float scale, float *s) {
    const int64_t nblocks = (len + block_size - 1) / block_size, vecs = d / 16;
    for (int64_t p = 0; p < len; p++) {
        if (p % block_size == 0)
            prefetch_block(k, table, p / block_size + 1, nblocks, block_size, kv * d);
        const uint16_t *kp = row_at(k, table, p, block_size, kv * d);
        for (int64_t g = 0; g < kv; g++) {
            __m512 kf[16];
            for (int64_t j = 0; j < vecs; j++)
                kf[j] = load_bf16x16(kp + g * d + 16 * j);
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf + h * d), kf[0]);
                for (int64_t j = 1; j < vecs; j++)
                    acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + h * d + 16 * j), kf[j], acc);
                s[h * len + p] = _mm512_reduce_add_ps(acc) * scale;
            }
        }
    }
}

/* values_plain with AVX-512. */
__attribute__((target("avx512f")))
static void values_avx512(const float *w, int64_t heads, int64_t group, int64_t d, const uint16_t *v,
                          const int32_t *table, int64_t len, int64_t block_size, int64_t kv, float *acc) {
    const int64_t nblocks = (len + block_size - 1) / block_size, vecs = d / 16;
    for (int64_t i = 0; i < heads * d; i++)
        acc[i] = 0.0f;
    for (int64_t p = 0; p < len; p++) {
        if (p % block_size == 0)
            prefetch_block(v, table, p / block_size + 1, nblocks, block_size, kv * d);
        const uint16_t *vp = row_at(v, table, p, block_size, kv * d);
        for (int64_t g = 0; g < kv; g++) {
            __m512 vf[16];
            for (int64_t j = 0; j < vecs; j++)
                vf[j] = load_bf16x16(vp + g * d + 16 * j);
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                const __m512 wh = _mm512_set1_ps(w[h * len + p]);
                for (int64_t j = 0; j < vecs; j++) {
                    float *a = acc + h * d + 16 * j;
                    _mm512_storeu_ps(a, _mm512_fmadd_ps(wh, vf[j], _mm512_loadu_ps(a)));
                }
            }
        }
    }
}

/* e^x on 16 lanes by exp_f32's rule (0 below -87.3; a NaN stays NaN). */
__attribute__((target("avx512f")))
static inline __m512 exp_lanes(__m512 x) {
    const __m512 low = _mm512_set1_ps(-87.3f);
    const __m512 xc = _mm512_max_ps(low, x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc));
    __m512 q = _mm512_set1_ps(1.9875691500e-4f);
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507e-3f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
    q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
    q = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    const __m512 e = _mm512_scalef_ps(q, n);
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ), _mm512_setzero_ps());
}

/* sh[p] = e^(sh[p] - m) for p < len (exp_f32's rule, 16 lanes at a time); returns their sum (a tree of lanes). */
__attribute__((target("avx512f")))
static float softmax_exp_avx512(float *sh, int64_t len, float m) {
    const __m512 shift = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p = 0; p < len; p += 16) {
        const __mmask16 live = len - p >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - p)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(live, exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sh + p), shift)));
        _mm512_mask_storeu_ps(sh + p, live, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* The AVX-512 BF16 path, one sequence at a time, for head sizes of 16, 32, 64 and 128 (NV = D / 16 vectors
 * of 16 floats). It computes what the loops above compute, arranged for this CPU:
 * - scores 16 positions at a time: for each head, the 16 dot products are formed by VDPBF16PS straight on the
 *   bf16 query and key (products of two bf16 are exact in float32; the sums are float32) and their lanes summed
 *   by one transpose-and-add tree, so no horizontal sum per position;
 * - the 16 key rows of a tile are read once per tile and stay in L1 while every head of the group uses them;
 * - values: the group's heads accumulate o += p_j v_j in registers (HC heads x NV vectors), no stores per
 *   position;
 * - positions are walked block by block (no division per position).
 * Float32 throughout, the output rounded once to bf16 (nearest even), so the bound is the loops' bound. */
#define TILE 16
/* The loops below prefetch the rows PF_AHEAD tiles ahead into L2 (PF_HINT 2: prefetcht1), a few lines at a time
 * spread over the work of a tile. A burst of a whole tile's lines into L1 (prefetcht0), the tile just ahead, as
 * before, stalled on L1's few outstanding misses: on the project's EPYC, one decode step of 64 sequences (contexts
 * 110-360, 30 layers, blocks of 16 scattered over 336 MB) took 54 ms that way and 29-33 ms this way (same bits),
 * the first tiles of a row's keys prefetched at its start too; and a decode row's values are prefetched while its
 * scores are worked out (the bench_engine workload's decode steps 1.014-1.025x more in a step replay).
 * Decode rows also keep the memory busy while a row's values are summed from L2: the next row's keys (its first
 * NEXT_ROWS rows) are prefetched then, spread over the positions, so its scores start on keys already in L2. The
 * addresses come from walking the block tables (no division per row, which the first version paid per prefetched
 * row), and the values widen 32 bf16 per load. Same bits; in a replay of that step (random block order, 64 rows,
 * 30 layers) 25-28 ms against 27-32 before, prefill rows (keys hot) ~20% less time in the bench_engine run. */
#define PF_AHEAD 2
#define PF_HINT 2
#define NEXT_ROWS 256

__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
static inline __m512 sum_lanes16(__m512 *P) {  /* lane t of the result = sum of the 16 lanes of P[t] */
    __m512 Q[8], R[4], S[2];
    for (int i = 0; i < 8; i++)
        Q[i] = _mm512_add_ps(_mm512_unpacklo_ps(P[2 * i], P[2 * i + 1]), _mm512_unpackhi_ps(P[2 * i], P[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        R[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(Q[2 * i]), _mm512_castps_pd(Q[2 * i + 1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(Q[2 * i]), _mm512_castps_pd(Q[2 * i + 1]))));
    for (int i = 0; i < 2; i++)
        S[i] = _mm512_add_ps(_mm512_shuffle_f32x4(R[2 * i], R[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(R[2 * i], R[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(S[0], S[1], 0x88), _mm512_shuffle_f32x4(S[0], S[1], 0xDD));
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
static inline __m512i round_bf16_lanes(__m512 x) {  /* f32_to_bf16 on 16 lanes, each in the low half of its lane:
                                                      * nearest even, NaN stays a quiet NaN */
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000), _MM_CMPINT_NLE);
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
static inline __m256i round_bf16x16(__m512 x) {  /* the same, the 16 results packed */
    return _mm512_cvtepi32_epi16(round_bf16_lanes(x));
}

__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))
static inline float max_avx512(const float *x, int64_t len) {  /* NaNs skipped, as the scalar loop's compare */
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int64_t p = 0; p < len; p += 16) {
        const __mmask16 live = len - p >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - p)) - 1);
        m = _mm512_mask_max_ps(m, live, _mm512_maskz_loadu_ps(live, x + p), m);
    }
    return _mm512_reduce_max_ps(m);
}

/* Hint the cache (L2, PF_HINT) to load one row of ``row_bytes`` bytes, ahead of use. */
static inline void prefetch_row(const uint16_t *row, int64_t row_bytes) {
    for (int64_t off = 0; off < row_bytes; off += 64)
        __builtin_prefetch((const char *)row + off, 0, PF_HINT);
}

/* Walks a sequence's rows in order through its block table: one division to start, none per row. */
typedef struct {
    const int32_t *table;
    int64_t block_size, blk, off;
} row_walk;

static inline row_walk walk_from(const int32_t *table, int64_t p, int64_t block_size) {
    row_walk w = {table, block_size, p / block_size, p % block_size};
    return w;
}

static inline int64_t walk_next(row_walk *w) {  /* the next row's index in the store (in rows of kv * d values) */
    const int64_t r = (int64_t)w->table[w->blk] * w->block_size + w->off;
    if (++w->off == w->block_size) {
        w->off = 0;
        w->blk++;
    }
    return r;
}

/* Prefetch the first ``n`` rows of a sequence in ``store`` (its K or V), before they are used. */
static inline void prefetch_first(const uint16_t *store, const int32_t *table, int64_t n, int64_t block_size,
                                  int64_t width) {
    row_walk w = walk_from(table, 0, block_size);
    for (int64_t t = 0; t < n; t++)
        prefetch_row(store + walk_next(&w) * width, width * 2);
}

/* The kernel for one sequence. ``next_table``/``next_len``: the next row's sequence (NULL: none), whose keys (up to
 * NEXT_ROWS rows) are prefetched while this one's values are summed. Values: 32 bf16 of a row are widened as two
 * vectors, the even elements (shifted up) and the odd ones (masked), and summed in that order of lanes; each
 * element gets the same products in the same order as the loops above, so the bits are theirs; the even and odd
 * lanes are interleaved again when the output is rounded. */
#define DEFINE_SEQ_KERNEL(NV, HC)                                                                                 \
__attribute__((target("avx512f,avx512bw,avx512dq,avx512bf16")))                                                   \
static void seq_bf16_##NV(const uint16_t *qrow, const uint16_t *k, const uint16_t *v, const int32_t *table,       \
                          int64_t len, int64_t heads, int64_t kv, int64_t block_size, float scale, float *s,      \
                          float *sums, uint16_t *orow, int v_early, const int64_t *spread,                        \
                          const int32_t *next_table, int64_t next_len) {                                          \
    enum { D = NV * 16, NC = (NV + 1) / 2 };                                                                      \
    const int64_t width = kv * D, group = heads / kv, row_bytes = width * 2;                                      \
    const __mmask32 cmask = (NV % 2) ? (__mmask32)0xFFFF : (__mmask32)0xFFFFFFFF; /* last 32-wide chunk */        \
    row_walk w = walk_from(table, 0, block_size);                                                                 \
    const int64_t ahead = len < PF_AHEAD * TILE ? len : PF_AHEAD * TILE;                                          \
    prefetch_first(k, table, ahead, block_size, width);                                                           \
    row_walk wa = walk_from(table, ahead, block_size); /* the rows PF_AHEAD tiles ahead */                        \
    for (int64_t p0 = 0; p0 < len; p0 += TILE) {  /* scores, 16 positions at a time, every head */                \
        const int64_t n = len - p0 < TILE ? len - p0 : TILE;                                                      \
        const uint16_t *rows[TILE], *vrows[TILE], *pf[TILE];                                                      \
        for (int64_t t = 0; t < n; t++) {                                                                         \
            const int64_t r = walk_next(&w) * width;                                                              \
            rows[t] = k + r;                                                                                      \
            vrows[t] = v + r;                                                                                     \
        }                                                                                                         \
        const int64_t pf0 = p0 + PF_AHEAD * TILE, npf = pf0 >= len ? 0 : (len - pf0 < TILE ? len - pf0 : TILE);   \
        for (int64_t t = 0; t < npf; t++)                                                                         \
            pf[t] = k + walk_next(&wa) * width;                                                                   \
        const __mmask16 live = n == TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);                        \
        for (int64_t h = 0; h < heads; h++) {                                                                     \
            const int64_t g = h / group;                                                                          \
            /* head h prefetches its share of the tile ahead (spread[h] .. spread[h + 1] of TILE rows) */         \
            const int64_t a0 = spread[h] < npf ? spread[h] : npf, a1 = spread[h + 1] < npf ? spread[h + 1] : npf;   \
            for (int64_t t = a0; t < a1; t++)                                                                     \
                prefetch_row(pf[t], row_bytes);                                                                   \
            if (v_early) {                                                                                        \
                const int64_t b0 = spread[h] < n ? spread[h] : n, b1 = spread[h + 1] < n ? spread[h + 1] : n;     \
                for (int64_t t = b0; t < b1; t++)                                                                 \
                    prefetch_row(vrows[t], row_bytes);                                                            \
            }                                                                                                     \
            __m512i qv[NC];                                                                                       \
            for (int j = 0; j < NC; j++)                                                                          \
                qv[j] = _mm512_maskz_loadu_epi16(j == NC - 1 ? cmask : 0xFFFFFFFF, qrow + h * D + 32 * j);        \
            __m512 P[TILE];                                                                                       \
            for (int64_t t = 0; t < TILE; t++) {                                                                  \
                __m512 a = _mm512_setzero_ps();                                                                   \
                if (t < n)                                                                                        \
                    for (int j = 0; j < NC; j++)                                                                  \
                        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(                               \
                            j == NC - 1 ? cmask : 0xFFFFFFFF, rows[t] + g * D + 32 * j), (__m512bh)qv[j]);        \
                P[t] = a;                                                                                         \
            }                                                                                                     \
            _mm512_mask_storeu_ps(s + h * len + p0, live, _mm512_mul_ps(sum_lanes16(P), _mm512_set1_ps(scale)));  \
        }                                                                                                         \
    }                                                                                                             \
    if (!v_early)                                                                                                 \
        prefetch_first(v, table, ahead, block_size, width);                                                       \
    for (int64_t h = 0; h < heads; h++) {  /* softmax numerators in place, their sums kept */                     \
        float m = max_avx512(s + h * len, len);                                                                   \
        if (!(m > -INFINITY && m < INFINITY))                                                                     \
            m = 0.0f;                                                                                             \
        sums[h] = softmax_exp_avx512(s + h * len, len, m);                                                        \
    }                                                                                                             \
    /* the next sequence's keys (up to NEXT_ROWS rows), spread over this one's first pass of values */            \
    const int64_t next_rows = next_table == NULL ? 0 : (next_len < NEXT_ROWS ? next_len : NEXT_ROWS);             \
    row_walk wn = walk_from(next_table != NULL ? next_table : table, 0, block_size);                              \
    int64_t owed = 0;                                                                                             \
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);                                                     \
    for (int64_t g = 0; g < kv; g++) {  /* values: HC heads of the group at a time, sums in registers */          \
        const uint16_t *vg = v + g * D;                                                                           \
        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += HC) {                                            \
            const int64_t hc = (g + 1) * group - h0 < HC ? (g + 1) * group - h0 : HC;                             \
            __m512 acc[HC][NV];                                                                                   \
            for (int i = 0; i < HC; i++)                                                                          \
                for (int j = 0; j < NV; j++)                                                                      \
                    acc[i][j] = _mm512_setzero_ps();                                                              \
            const int first = g == 0 && h0 == 0;                                                                  \
            row_walk wv = walk_from(table, 0, block_size);                                                        \
            row_walk wp = walk_from(table, first ? ahead : 0, block_size);                                        \
            for (int64_t p = 0; p < len; p++) {                                                                   \
                const uint16_t *row = vg + walk_next(&wv) * width;                                                \
                if (first && p + PF_AHEAD * TILE < len)                                                           \
                    prefetch_row(v + walk_next(&wp) * width, row_bytes);                                          \
                if (first)  /* next_rows / len rows of the next sequence's keys per position (no division) */     \
                    for (owed += next_rows; owed >= len; owed -= len)                                             \
                        prefetch_row(k + walk_next(&wn) * width, row_bytes);                                      \
                __m512 vf[NV];                                                                                    \
                if (NV % 2 == 0) {  /* even elements, then odd ones, of each 32 */                                \
                    for (int j = 0; j < NV / 2; j++) {                                                            \
                        const __m512i x = _mm512_loadu_si512((const void *)(row + 32 * j));                       \
                        vf[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));                                \
                        vf[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, high));                           \
                    }                                                                                             \
                } else {                                                                                          \
                    for (int j = 0; j < NV; j++)                                                                  \
                        vf[j] = load_bf16x16(row + 16 * j);                                                       \
                }                                                                                                 \
                for (int i = 0; i < HC; i++)                                                                      \
                    if (i < hc) {                                                                                 \
                        const __m512 wt = _mm512_set1_ps(s[(h0 + i) * len + p]);                                  \
                        for (int j = 0; j < NV; j++)                                                              \
                            acc[i][j] = _mm512_fmadd_ps(wt, vf[j], acc[i][j]);                                    \
                    }                                                                                             \
            }                                                                                                     \
            for (int i = 0; i < hc; i++) {                                                                        \
                const __m512 sum = _mm512_set1_ps(sums[h0 + i]);                                                  \
                if (NV % 2 == 0) {                                                                                \
                    for (int j = 0; j < NV / 2; j++) {                                                            \
                        const __m512i e = round_bf16_lanes(_mm512_div_ps(acc[i][2 * j], sum));                    \
                        const __m512i o = round_bf16_lanes(_mm512_div_ps(acc[i][2 * j + 1], sum));                \
                        _mm512_storeu_si512((void *)(orow + (h0 + i) * D + 32 * j),                               \
                                            _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));                        \
                    }                                                                                             \
                } else {                                                                                          \
                    for (int j = 0; j < NV; j++)                                                                  \
                        _mm256_storeu_si256((__m256i *)(orow + (h0 + i) * D + 16 * j),                            \
                                            round_bf16x16(_mm512_div_ps(acc[i][j], sum)));                        \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }                                                                                                             \
}

DEFINE_SEQ_KERNEL(1, 16)
DEFINE_SEQ_KERNEL(2, 8)
DEFINE_SEQ_KERNEL(4, 4)
DEFINE_SEQ_KERNEL(8, 2)

/* ---- The AMX path (Sapphire Rapids and later): every row, decode and prefill alike, by tile products. ----
 * A row's result is a function of its query, its sequence's K/V up to its own length and nothing else: the rows of
 * a step are cut into "columns" (one query row's one head) and up to 16 columns are worked on together, but each
 * column's arithmetic is the same whichever columns share its block (extra positions of a longer neighbour add
 * exact zeros, and a zero result is written as +0), so a row gives the same bits alone (a decode step), in a prefill
 * chunk, or beside decode rows in a mixed step (tests/test_fast_kv_native.py checks all three). Per column, for its
 * kv head g:
 * - scores: s_p = (q . k_p) * scale by TDPBF16PS (exact bf16 products, float32 sums in the unit's order), k-steps
 *   of 32 over d in order. A chunk's rows multiply their queries by the keys laid out as pairs of d across
 *   positions (q K^T); a decode row multiplies the keys, read straight from the cache, by its queries (K q^T), every
 *   kv head into one tile with the other heads' query columns zero. The unit gives an element the same bits either
 *   way (its products and sums do not depend on which operand is which: checked over 5M random elements);
 * - softmax in float32 over the positions up to the row's length: the maximum (NaN scores skipped, a non-finite
 *   maximum taken as 0, as the loops above), e_p = exp_f32(s_p - m) 16 positions a lane, summed per lane in order of
 *   position, the 16 lanes summed by one fixed tree;
 * - values: e_p is split exactly into three bf16 terms (hi + mid + lo, 24 significant bits: float32's), and
 *   o = sum_p e_p v_p is three tile products per 32 positions (lo, mid, hi) into one float32 sum; o / sum rounded
 *   once to bf16. No product is rounded below float32, so the decode bound is the loops' bound.
 * A chunk's values and keys are first laid out for the tiles in scratch (a decode row's values 32 positions at a
 * time, one kv head's slice, right before their products: value_pass), positions past the longest row's length
 * as zeros: slots past a length are never read into a result. An inf or NaN stored in a used slot (a model that
 * overflowed) can reach more than the loops above let it: a value past a row's own length through a zero weight
 * (0 x inf), a decode row's key of one kv head into the other heads' scores at that position.
 * Decode rows stay on the tiles although the loops above are still a little faster there (K/V cold from memory, 64
 * rows of 110-360 positions: 0.93x, bench_attention_cpu; 0.71x before the value passes and per-head tile rows;
 * with K/V in L2 the tiles are ahead): a row must have the same bits in any step, and the loops cannot give the
 * unit's bits. Measured on Sapphire
 * Rapids (200K random cases per setting): one dword pair onto c gives exactly c + round(a0*b0 + a1*b1), but from
 * two pairs on, no chain of FMAs (either order), of rounded pair sums, tree of them, or c + the exactly summed
 * products rounded once (nearest or truncated) matches (9-31% of cases differ with 2 pairs, 56-68% with 16). */
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TAMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#define T512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static int amx_state = -1;

static int amx_ready(void) {  /* the CPU has AMX-BF16 and Linux lets this process use its tiles */
    if (amx_state < 0) {
        unsigned a, b, c, d;
        int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1)
                 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
        ok = ok && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        amx_state = ok;
    }
    return amx_state;
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Bytes of scratch one call's AMX path needs for rows up to max_len positions (64-byte aligned pieces). */
static int64_t amx_scratch_bytes(int64_t kv, int64_t d, int64_t max_len) {
    const int64_t l32 = round_up(max_len, 32);
    return 64                                     /* alignment */
           + 16 * (l32 + 16) * 4                  /* S: 16 columns' scores, then weights */
           + 3 * (l32 / 32) * 1024                /* the weights' three bf16 parts as A tiles */
           + kv * (l32 + 16) * d * 2              /* keys laid out as B tiles */
           + kv * l32 * d * 2                     /* values laid out as B tiles */
           + 4 * 1024                             /* the block's queries as A tiles (d / 32 of them) */
           + 4 * 1024                             /* C tiles stored */
           + kv * 4 * 1024                        /* a decode row's queries as B tiles */
           + 16 * kv * d * 2                      /* 16 keys gathered (block sizes not a multiple of 16) */
           + 16 * 64 * 4;                         /* a decode row's values, 32 positions laid out */
}

T512 static inline void transpose16(__m512i r[16]) {  /* r[i].dword[j] <-> r[j].dword[i] */
    __m512i t[16], u[16], v[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm512_shuffle_i32x4(u[i], u[4 + i], 0x88);
        v[4 + i] = _mm512_shuffle_i32x4(u[i], u[4 + i], 0xDD);
        v[8 + i] = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0x88);
        v[12 + i] = _mm512_shuffle_i32x4(u[8 + i], u[12 + i], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(v[i], v[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_i32x4(v[i], v[8 + i], 0xDD);
        r[4 + i] = _mm512_shuffle_i32x4(v[4 + i], v[12 + i], 0x88);
        r[12 + i] = _mm512_shuffle_i32x4(v[4 + i], v[12 + i], 0xDD);
    }
}

#define LAY_AHEAD 64

/* Prefetch (into L2) the keys and values of a sequence's first ``n`` positions. */
static inline void prefetch_kv(const uint16_t *k, const uint16_t *v, const int32_t *table, int64_t n, int64_t block_size,
                               int64_t width) {
    row_walk w = walk_from(table, 0, block_size);
    for (int64_t t = 0; t < n; t++) {
        const int64_t r = walk_next(&w) * width;
        prefetch_row(k + r, width * 2);
        prefetch_row(v + r, width * 2);
    }
}

/* The next sequence's keys and values, prefetched (into L2) a few rows at a time while this one is worked on: one
 * burst of prefetches would stall on the memory's outstanding-miss limit instead of overlapping the arithmetic. */
typedef struct {
    const uint16_t *k, *v;
    row_walk w;
    int64_t left, per, width;  /* rows still to prefetch, cache lines per step, values per row */
    int64_t line, lines;       /* the next line of the current row's keys then values, and how many a row has */
    const char *kr, *vr;       /* the current row's keys and values (NULL: none started) */
} pf_stream;

static inline void pf_step(pf_stream *s) {  /* the next ``per`` lines (a row's keys, then its values) */
    int64_t n = s->per;
    while (n > 0) {
        if (s->kr == NULL || s->line == 2 * s->lines) {
            if (s->left <= 0)
                return;
            const int64_t r = walk_next(&s->w) * s->width;
            s->kr = (const char *)(s->k + r), s->vr = (const char *)(s->v + r), s->line = 0, s->left--;
        }
        const char *base = s->line < s->lines ? s->kr : s->vr - 64 * s->lines;  /* line l of the row at base + 64 l */
        const int64_t end = s->line < s->lines ? s->lines : 2 * s->lines, m = end - s->line < n ? end - s->line : n;
        for (int64_t l = s->line; l < s->line + m; l++)
            __builtin_prefetch(base + 64 * l, 0, PF_HINT);
        s->line += m, n -= m;
    }
}

/* Keys of a sequence for the score tiles: kn[g][i][p] = the dword (k_p[g][2i], k_p[g][2i + 1]) for pairs i < d / 2
 * and positions p < l16 (zero from len on). Values for the weight tiles: vn[g][i][m] = the dword (v_2i[g][c],
 * v_2i+1[g][c]) for position pairs i < l32 / 2 and c < d (zero from len on), where within each 32 of d the dword
 * m holds c = VN_ORDER(m) (the order of VPUNPCKLWD / VPUNPCKHWD, one instruction each; store_row puts the outputs
 * back in order). */
#define VN_ORDER(m) ((m) < 16 ? 8 * ((m) / 4) + (m) % 4 : 8 * (((m) - 16) / 4) + 4 + ((m) - 16) % 4)
typedef struct {  /* a sequence's keys and values being laid out, 32 positions a step */
    const uint16_t *k, *v;
    row_walk w, wa;  /* the next position, and the next to prefetch */
    int64_t len, kv, d, l16, l32, ahead, p0;
    uint32_t *kn, *vn;  /* kn NULL: values only */
} layout;

static layout layout_start(const uint16_t *k, const uint16_t *v, const int32_t *table, int64_t len, int64_t kv, int64_t d,
                           int64_t block_size, int64_t l16, int64_t l32, uint32_t *kn, uint32_t *vn) {
    /* keys and values LAY_AHEAD positions ahead are prefetched (into L2) as the steps go: the block tables
     * scatter the blocks, so the hardware prefetcher would only follow a block once it is being read */
    const int64_t ahead = len < LAY_AHEAD ? len : LAY_AHEAD;
    layout L = {k, v, walk_from(table, 0, block_size), walk_from(table, ahead, block_size), len, kv, d, l16, l32, ahead,
                0, kn, vn};
    return L;
}

T512 static void layout_step(layout *L) {
    const int64_t width = L->kv * L->d, pairs = L->d / 2, d = L->d, p0 = L->p0, len = L->len, l16 = L->l16;
    const uint16_t *k = L->k, *v = L->v;
    int64_t rows[32];  /* the store rows (in rows of kv * d) of 32 positions; -1 past len */
    const __m512i zero = _mm512_setzero_si512();
    for (int t = 0; t < 32; t++)
        rows[t] = p0 + t < len ? walk_next(&L->w) : -1;
    for (int64_t t = p0 + L->ahead; t < p0 + L->ahead + 32 && t < len; t++) {
        const int64_t r = walk_next(&L->wa) * width;
        prefetch_row(k + r, width * 2);
        prefetch_row(v + r, width * 2);
    }
    for (int64_t g = 0; g < L->kv; g++) {
        for (int half = 0; half < 2 && L->kn != NULL && p0 + 16 * half < l16; half++)  /* keys: 16 positions a time */
            for (int64_t a = 0; a < pairs; a += 16) {
                __m512i r[16];
                for (int t = 0; t < 16; t++) {
                    const int64_t row = rows[16 * half + t];
                    r[t] = row < 0 ? zero : _mm512_loadu_si512((const void *)(k + row * width + g * d + 2 * a));
                }
                transpose16(r);
                for (int i = 0; i < 16; i++)
                    _mm512_storeu_si512((void *)(L->kn + (g * pairs + a + i) * (l16 + 16) + p0 + 16 * half), r[i]);
            }
        for (int t = 0; t < 32; t += 2) {  /* values: pairs of positions */
            const int64_t r0 = rows[t], r1 = rows[t + 1];
            uint32_t *dst = L->vn + (g * (L->l32 / 2) + (p0 + t) / 2) * d;
            for (int64_t c = 0; c < d; c += 32) {  /* 32 of d: dwords in the order of VN_ORDER */
                const __m512i x = r0 < 0 ? zero : _mm512_loadu_si512((const void *)(v + r0 * width + g * d + c));
                const __m512i y = r1 < 0 ? zero : _mm512_loadu_si512((const void *)(v + r1 * width + g * d + c));
                _mm512_storeu_si512((void *)(dst + c), _mm512_unpacklo_epi16(x, y));
                _mm512_storeu_si512((void *)(dst + c + 16), _mm512_unpackhi_epi16(x, y));
            }
        }
    }
    L->p0 += 32;
}

/* bf16 of 16 floats, nearest even (VCVTNEPS2BF16), and back (exact). */
T512 static inline __m512 bf16_round_trip(__m512 x, __m256i *b) {
    *b = (__m256i)_mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(*b), 16));
}

T512 static inline __mmask16 live_lanes(int64_t len, int64_t p) {  /* positions p .. p + 15 below len */
    return len - p >= 16 ? (__mmask16)0xFFFF : len - p <= 0 ? (__mmask16)0 : (__mmask16)((1u << (len - p)) - 1);
}

/* e = exp(s - shift) of 16 positions (0 from ``left`` on), written as three bf16 parts at a (lo), a + 512 (mid)
 * and a + 1024 (hi): e = hi + mid + lo exactly (each part the rounding of what the parts above leave). */
T512 static inline __m512 weigh16(const float *s, int64_t left, float shift, uint16_t *a) {
    const __mmask16 live = live_lanes(left, 0);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_lanes(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s),
                                                                        _mm512_set1_ps(shift))));
    __m256i b;
    const __m512 r1 = _mm512_sub_ps(e, bf16_round_trip(e, &b));
    _mm256_storeu_si256((__m256i *)(a + 1024), b);
    const __m512 r2 = _mm512_sub_ps(r1, bf16_round_trip(r1, &b));
    _mm256_storeu_si256((__m256i *)(a + 512), b);
    bf16_round_trip(r2, &b);
    _mm256_storeu_si256((__m256i *)a, b);
    return e;
}

/* One column's output: nj x 16 floats of C (tiles 256 floats apart; nj even, each pair of tiles 32 of d in the
 * order VN_ORDER) / sum, + 0 (a zero result is +0 whatever the block), rounded to bf16 (nearest even). */
T512 static inline void store_row(const float *c, uint16_t *o, int nj, float sum) {
    static const int32_t order[2][16] = {{0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
                                         {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
    const __m512i lo = _mm512_loadu_si512(order[0]), hi = _mm512_loadu_si512(order[1]);
    const __m512 sv = _mm512_set1_ps(sum), zero = _mm512_setzero_ps();
    for (int j = 0; j < nj; j += 2) {
        const __m512 e = _mm512_loadu_ps(c + 256 * j), f = _mm512_loadu_ps(c + 256 * (j + 1));
        const __m512 a = _mm512_permutex2var_ps(e, lo, f), b = _mm512_permutex2var_ps(e, hi, f);
        _mm256_storeu_si256((__m256i *)(o + 16 * j), round_bf16x16(_mm512_add_ps(_mm512_div_ps(a, sv), zero)));
        _mm256_storeu_si256((__m256i *)(o + 16 * j + 16), round_bf16x16(_mm512_add_ps(_mm512_div_ps(b, sv), zero)));
    }
}

/* A decode row's values, laid out for the weight tiles 32 positions at a time, one kv head's slice of d (columns
 * off .. off + 16 nj) per pass, right before their products: dst[i][m] = the dword (v_2i[c], v_2i+1[c]) of the
 * 32 positions' pairs i, c = off + VN_ORDER(m) for each 32 of the slice (as vn, zero from len on). The slice's
 * lines of the positions a step ahead are prefetched into L1; the whole sequence came into L2 during the one
 * before (pf_stream). Laid out whole beside the scores instead (as a chunk's values), the 98 KB of a 256-position
 * row left L1 and were read back from L2: a third of the row's time with its K/V in L2. */
typedef struct {
    const uint16_t *v;
    row_walk w, wa;
    int64_t len, width, off, p0;
    int nj;
} value_pass;

static value_pass value_pass_start(const uint16_t *v, const int32_t *table, int64_t len, int64_t block_size,
                                   int64_t width, int64_t off, int nj) {
    const int64_t ahead = len < 32 ? len : 32;
    value_pass vp = {v, walk_from(table, 0, block_size), walk_from(table, ahead, block_size), len, width, off, 0, nj};
    row_walk w0 = walk_from(table, 0, block_size);
    for (int64_t t = 0; t < ahead; t++) {
        const char *r = (const char *)(v + walk_next(&w0) * width + off);
        for (int l = 0; l < nj * 32; l += 64)
            __builtin_prefetch(r + l, 0, 3);
    }
    return vp;
}

T512 static void value_pass_step(value_pass *vp, uint32_t *dst) {
    const __m512i zero = _mm512_setzero_si512();
    const int64_t p0 = vp->p0, len = vp->len;
    for (int64_t t = p0 + 32; t < p0 + 64 && t < len; t++) {  /* the next step's lines */
        const char *r = (const char *)(vp->v + walk_next(&vp->wa) * vp->width + vp->off);
        for (int l = 0; l < vp->nj * 32; l += 64)
            __builtin_prefetch(r + l, 0, 3);
    }
    for (int t = 0; t < 32; t += 2) {
        const uint16_t *x0 = p0 + t < len ? vp->v + walk_next(&vp->w) * vp->width + vp->off : NULL;
        const uint16_t *x1 = p0 + t + 1 < len ? vp->v + walk_next(&vp->w) * vp->width + vp->off : NULL;
        uint32_t *o = dst + (t / 2) * 64;
        for (int c = 0; c < vp->nj * 16; c += 32) {
            const __m512i x = x0 == NULL ? zero : _mm512_loadu_si512((const void *)(x0 + c));
            const __m512i y = x1 == NULL ? zero : _mm512_loadu_si512((const void *)(x1 + c));
            _mm512_storeu_si512((void *)(o + c), _mm512_unpacklo_epi16(x, y));
            _mm512_storeu_si512((void *)(o + c + 16), _mm512_unpackhi_epi16(x, y));
        }
    }
    vp->p0 += 32;
}

/* Every tile 16 rows of 64 bytes (LDTILECFG, which zeroes the tiles). */
TAMX static void tiles_full(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Columns of one sequence's rows: column c (0 <= c < R * heads) is row r's head h, in the order kv head g, row r,
 * head within the group; a block takes 16 consecutive columns. */
TAMX static void segment_amx(const uint16_t *q, const int64_t *rows, const int32_t *lens, int64_t R, int64_t heads,
                             int64_t kv, int64_t d, float scale, const uint16_t *k, const uint16_t *v, const int32_t *table,
                             int64_t block_size, const uint32_t *kn, const uint32_t *vn, int64_t l16, int64_t l32,
                             uint8_t *scr, uint16_t *out, pf_stream *pf) {
    const int64_t group = heads / kv, ncols = R * heads, ks_n = d / 32;
    const int64_t ss = l32 + 16;  /* S's row stride: rows a power of two apart would share one L1 set */
    float *S = (float *)scr;                                          /* [16][ss] */
    uint16_t *A = (uint16_t *)(scr + 16 * ss * 4);                    /* [l32 / 32][3][16][32] */
    uint16_t *Aq = A + 3 * (l32 / 32) * 512;                          /* [d / 32][16][32] */
    float *C = (float *)(Aq + 4 * 512);                               /* [4][16][16] */
    uint32_t *Bq = (uint32_t *)(C + 1024);                            /* [kv][d / 32][16][16] */
    uint16_t *Kt = (uint16_t *)(Bq + kv * 4 * 256);                   /* [16][kv * d] */
    uint32_t *Vt = (uint32_t *)(Kt + 16 * kv * d);                    /* [16][64]: a decode row's 32 positions */
    const int64_t width = kv * d;
    /* the next sequence's lines spread over this one's steps: weights (ncols * l32 / 16), score tiles (l32 / 16),
     * value chunks (about kv * l32 / 32) */
    pf->per = pf->left * 2 * pf->lines / ((ncols + 1) * (l32 / 16) + kv * (l32 / 32) + 1) + 1;
    for (int64_t c0 = 0; c0 < ncols; c0 += 16) {
        const int nc = ncols - c0 < 16 ? (int)(ncols - c0) : 16;
        int64_t row_of[16], head_of[16], g_of[16];
        int32_t len_of[16];
        int64_t lb = 0;
        for (int n = 0; n < 16; n++) {
            if (n < nc) {
                const int64_t c = c0 + n, g = c / (R * group), rem = c % (R * group), r = rem / group;
                g_of[n] = g;
                head_of[n] = g * group + rem % group;
                row_of[n] = rows[r];
                len_of[n] = lens[r];
                lb = len_of[n] > lb ? len_of[n] : lb;
            } else {
                g_of[n] = -1, head_of[n] = 0, row_of[n] = rows[0], len_of[n] = 0;
            }
        }
        const int64_t g_lo = g_of[0], g_hi = g_of[nc - 1], lb16 = round_up(lb, 16), lb32 = round_up(lb, 32);
        if (kn == NULL) {
            /* One block for the whole segment (a decode row): scores as S^T = K q^T, the keys' tiles straight from
             * the cache (no layout), every kv head into one C tile with the other heads' query columns zero (their
             * products add exact zeros); the unit gives each element the bits of q K^T (its products and sums do
             * not depend on which operand is which: checked over 5M random elements, and by the tests comparing a
             * row alone with the same row in a prefill chunk). */
            memset(Bq, 0, (size_t)(g_hi - g_lo + 1) * ks_n * 1024);
            for (int n = 0; n < nc; n++) {
                const uint32_t *qn = (const uint32_t *)(q + (row_of[n] * heads + head_of[n]) * d);
                for (int64_t ks = 0; ks < ks_n; ks++)
                    for (int i = 0; i < 16; i++)
                        Bq[(((g_of[n] - g_lo) * ks_n + ks) * 16 + i) * 16 + n] = qn[16 * ks + i];
            }
            const int nb = (int)((g_hi - g_lo + 1) * ks_n);
            if (nb <= 6) {
                _tile_loadd(2, Bq, 64);
                if (nb > 1) _tile_loadd(3, Bq + 256, 64);
                if (nb > 2) _tile_loadd(4, Bq + 512, 64);
                if (nb > 3) _tile_loadd(5, Bq + 768, 64);
                if (nb > 4) _tile_loadd(6, Bq + 1024, 64);
                if (nb > 5) _tile_loadd(7, Bq + 1280, 64);
            }
            for (int64_t t = 0; t < lb16; t += 16, pf_step(pf)) {
                const uint16_t *kt = Kt;
                if (block_size % 16 == 0) {  /* 16 positions of one block: rows past the length are masked */
                    kt = k + ((int64_t)table[t / block_size] * block_size + t % block_size) * width;
                } else {
                    row_walk w = walk_from(table, t, block_size);
                    for (int64_t i = 0; i < 16; i++) {
                        if (t + i < lb)
                            memcpy(Kt + i * width, k + walk_next(&w) * width, (size_t)width * 2);
                        else
                            memset(Kt + i * width, 0, (size_t)width * 2);
                    }
                }
                _tile_zero(0);
                if (nb <= 6) {  /* the queries' tiles stay in registers (a register is reloaded only once the
                                 * products reading it are done) */
                    for (int b = 0; b < nb; b++) {
                        _tile_loadd(1, kt + (g_lo + b / ks_n) * d + 32 * (b % ks_n), width * 2);
                        switch (b) {
                        case 0: _tile_dpbf16ps(0, 1, 2); break;
                        case 1: _tile_dpbf16ps(0, 1, 3); break;
                        case 2: _tile_dpbf16ps(0, 1, 4); break;
                        case 3: _tile_dpbf16ps(0, 1, 5); break;
                        case 4: _tile_dpbf16ps(0, 1, 6); break;
                        default: _tile_dpbf16ps(0, 1, 7); break;
                        }
                    }
                } else {
                    for (int64_t g = g_lo; g <= g_hi; g++)
                        for (int64_t ks = 0; ks < ks_n; ks++) {
                            _tile_loadd(1, kt + g * d + 32 * ks, width * 2);
                            _tile_loadd(2, Bq + ((g - g_lo) * ks_n + ks) * 256, 64);
                            _tile_dpbf16ps(0, 1, 2);
                        }
                }
                _tile_stored(0, C, 64);
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = _mm512_loadu_si512((const void *)(C + 16 * i));
                transpose16(r);
                for (int n = 0; n < nc; n++)
                    _mm512_storeu_si512((void *)(S + n * ss + t), r[n]);
            }
        }
        for (int64_t ks = 0; ks < ks_n && kn != NULL; ks++)  /* the block's queries: A tiles, one per 32 of d */
            for (int n = 0; n < 16; n++) {
                uint16_t *dst = Aq + ks * 512 + n * 32;
                if (n < nc)
                    memcpy(dst, q + (row_of[n] * heads + head_of[n]) * d + 32 * ks, 64);
                else
                    memset(dst, 0, 64);
            }
        if (kn != NULL) {
            _tile_loadd(2, Aq, 64);
            if (ks_n > 1) _tile_loadd(3, Aq + 512, 64);
            if (ks_n > 2) _tile_loadd(4, Aq + 1024, 64);
            if (ks_n > 3) _tile_loadd(5, Aq + 1536, 64);
        }
        /* scores: C[n][16 positions] per kv head; a column keeps its own kv head's */
        for (int64_t t = 0; t < lb16 && kn != NULL; t += 16)
            for (int64_t g = g_lo; g <= g_hi; g++) {
                const int64_t ks = l16 + 16;  /* kn's row stride (padded, as S's) */
                const uint32_t *kg = kn + g * (d / 2) * ks + t;
                _tile_zero(0);
                _tile_loadd(6, kg, ks * 4);
                _tile_dpbf16ps(0, 2, 6);
                if (ks_n > 1) { _tile_loadd(7, kg + 16 * ks, ks * 4); _tile_dpbf16ps(0, 3, 7); }
                if (ks_n > 2) { _tile_loadd(6, kg + 32 * ks, ks * 4); _tile_dpbf16ps(0, 4, 6); }
                if (ks_n > 3) { _tile_loadd(7, kg + 48 * ks, ks * 4); _tile_dpbf16ps(0, 5, 7); }
                if (g_lo == g_hi) {
                    _tile_stored(0, S + t, ss * 4);
                } else {
                    _tile_stored(0, C, 64);
                    for (int n = 0; n < nc; n++)
                        if (g_of[n] == g)
                            _mm512_storeu_ps(S + n * ss + t, _mm512_loadu_ps(C + 16 * n));
                }
            }
        /* softmax per column: the scores scaled, their maximum over the column's positions */
        float shift[16];
        for (int n = 0; n < nc; n++) {
            float *sn = S + n * ss;
            const int64_t len = len_of[n];
            const __m512 sc = _mm512_set1_ps(scale);
            __m512 m = _mm512_set1_ps(-INFINITY);
            for (int64_t p = 0; p < lb16; p += 16) {
                const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sn + p), sc);
                _mm512_storeu_ps(sn + p, x);
                m = _mm512_mask_max_ps(m, live_lanes(len, p), x, m);
            }
            const float mx = _mm512_reduce_max_ps(m);
            shift[n] = mx > -INFINITY && mx < INFINITY ? mx : 0.0f;
        }
        /* then e_p = exp(s_p - max), summed per lane, and its three bf16 parts as A tiles
         * ([chunk][part][16 columns][32]); values: C[n][16 of d] += lo, mid, hi parts x v, 32 positions a step,
         * each column keeping its kv head's. Where the block's C tiles fit in four tile registers the chunks are
         * weighed and multiplied in one pass (the A tiles stay in L1); otherwise all weights first. Same bits. */
        __m512 sums[16];
        for (int n = 0; n < 16; n++)
            sums[n] = _mm512_setzero_ps();
        const int64_t ng = g_hi - g_lo + 1;
        const int fused = kn != NULL && ng * (d / 16) <= 4;
        if (fused) {
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        }
        for (int64_t p = 0; p < lb32; p += 32) {
            uint16_t *a = A + (fused ? 0 : (p / 32) * 3 * 512);
            for (int n = 0; n < nc; n++)  /* (the A rows of columns past nc are left as they are: their C rows
                                              * are not read) */
                for (int64_t h = p; h < p + 32; h += 16, pf_step(pf))
                    sums[n] = _mm512_add_ps(sums[n], weigh16(S + n * ss + h, len_of[n] - h, shift[n],
                                                             a + n * 32 + (h - p)));
            if (!fused)
                continue;
            _tile_loadd(4, a, 64);
            _tile_loadd(5, a + 512, 64);
            _tile_loadd(6, a + 1024, 64);
            for (int64_t g = g_lo; g <= g_hi; g++) {
                const uint32_t *b = vn + (g * (l32 / 2) + p / 2) * d;
                const int tile0 = (int)((g - g_lo) * (d / 16));  /* this kv head's first C tile */
                for (int j = 0; j < d / 16; j++) {
                    _tile_loadd(7, b + 16 * j, d * 4);
                    switch (tile0 + j) {
                    case 0: _tile_dpbf16ps(0, 4, 7); _tile_dpbf16ps(0, 5, 7); _tile_dpbf16ps(0, 6, 7); break;
                    case 1: _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(1, 5, 7); _tile_dpbf16ps(1, 6, 7); break;
                    case 2: _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(2, 5, 7); _tile_dpbf16ps(2, 6, 7); break;
                    default: _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(3, 5, 7); _tile_dpbf16ps(3, 6, 7); break;
                    }
                }
            }
        }
        float sum[16];
        for (int n = 0; n < nc; n++)
            sum[n] = _mm512_reduce_add_ps(sums[n]);
        if (fused) {
            _tile_stored(0, C, 64); _tile_stored(1, C + 256, 64); _tile_stored(2, C + 512, 64); _tile_stored(3, C + 768, 64);
            for (int n = 0; n < nc; n++)
                store_row(C + 256 * ((g_of[n] - g_lo) * (d / 16)) + 16 * n, out + (row_of[n] * heads + head_of[n]) * d,
                          (int)(d / 16), sum[n]);
            continue;
        }
        /* each kv head's columns are consecutive in the block: the weight and C tiles are configured to those
         * columns' rows only (the unit's time goes with a tile's rows; an element's arithmetic does not depend on
         * how many rows share its tile), so a decode row's three heads pay for 3 rows, not 16 */
        int reshaped = 0;
        for (int64_t g = g_lo; g <= g_hi; g++) {
            int n0 = 0, cnt = 0;
            for (int n = 0; n < nc; n++)
                if (g_of[n] == g) {
                    n0 = cnt == 0 ? n : n0;
                    cnt++;
                }
            if (cnt < 16) {  /* tiles 0-3 (C) and 4-6 (weights) of cnt rows; LDTILECFG zeroes every tile */
                amx_config cfg;
                memset(&cfg, 0, sizeof cfg);
                cfg.palette_id = 1;
                for (int t = 0; t < 8; t++) {
                    cfg.colsb[t] = 64;
                    cfg.rows[t] = t == 7 ? 16 : (uint8_t)cnt;
                }
                _tile_loadconfig(&cfg);
                reshaped = 1;
            } else if (reshaped) {
                tiles_full();
                reshaped = 0;
            }
            for (int64_t c = 0; c < d; c += 64) {
                const int nj = d - c >= 64 ? 4 : (int)((d - c) / 16);
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                value_pass vp = value_pass_start(v, table, lb, block_size, width, g * d + c, nj);
                for (int64_t p = 0; p < lb32; p += 32, pf_step(pf)) {
                    const uint16_t *a = A + (p / 32) * 3 * 512 + n0 * 32;
                    const uint32_t *b = vn + (g * (l32 / 2) + p / 2) * d + c;
                    int64_t stride = d * 4;
                    if (kn == NULL) {  /* a decode row: these 32 positions of this slice laid out now (in L1) */
                        value_pass_step(&vp, Vt);
                        b = Vt, stride = 256;
                    }
                    _tile_loadd(4, a, 64);
                    _tile_loadd(5, a + 512, 64);
                    _tile_loadd(6, a + 1024, 64);
                    _tile_loadd(7, b, stride);
                    _tile_dpbf16ps(0, 4, 7); _tile_dpbf16ps(0, 5, 7); _tile_dpbf16ps(0, 6, 7);
                    if (nj > 1) { _tile_loadd(7, b + 16, stride); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(1, 5, 7); _tile_dpbf16ps(1, 6, 7); }
                    if (nj > 2) { _tile_loadd(7, b + 32, stride); _tile_dpbf16ps(2, 4, 7); _tile_dpbf16ps(2, 5, 7); _tile_dpbf16ps(2, 6, 7); }
                    if (nj > 3) { _tile_loadd(7, b + 48, stride); _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(3, 5, 7); _tile_dpbf16ps(3, 6, 7); }
                }
                _tile_stored(0, C + 16 * n0, 64);
                if (nj > 1) _tile_stored(1, C + 256 + 16 * n0, 64);
                if (nj > 2) _tile_stored(2, C + 512 + 16 * n0, 64);
                if (nj > 3) _tile_stored(3, C + 768 + 16 * n0, 64);
                for (int n = 0; n < nc; n++)
                    if (g_of[n] == g)
                        store_row(C + 16 * n, out + (row_of[n] * heads + head_of[n]) * d + c, nj, sum[n]);
            }
        }
        if (reshaped)
            tiles_full();
    }
}

/* Rows i0 .. n of the call, sequence by sequence (consecutive rows of one chunk share their layout). */
TAMX static void rows_amx(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *tables,
                          const int32_t *seq_lens, const int64_t *chunks, const int64_t *rows, const int32_t *row_lens,
                          int64_t n, int64_t heads, int64_t kv, int64_t d, int64_t block_size, int64_t table_width,
                          int64_t max_len, float scale, uint8_t *scr, uint16_t *out) {
    tiles_full();
    const int64_t l32max = round_up(max_len, 32);
    uint8_t *base = (uint8_t *)(((uintptr_t)scr + 63) & ~(uintptr_t)63);
    uint32_t *kn = (uint32_t *)base, *vn = kn + kv * (l32max + 16) * d / 2;
    uint8_t *blocks = (uint8_t *)(vn + kv * l32max * d / 2);
    int32_t one_len[1];
    for (int64_t i = 0; i < n;) {
        int64_t j = i + 1;
        while (j < n && chunks[j] == chunks[i] && row_lens != NULL)
            j++;
        const int64_t c = chunks[i];
        const int32_t *lens = row_lens != NULL ? row_lens + i : one_len;
        one_len[0] = seq_lens[c];
        int64_t len = 0;
        for (int64_t r = 0; r < j - i; r++)
            len = lens[r] > len ? lens[r] : len;
        const int64_t l16 = round_up(len, 16), l32 = round_up(len, 32);
        if (i == 0)
            prefetch_kv(k, v, tables + c * table_width, len < LAY_AHEAD ? len : LAY_AHEAD, block_size, kv * d);
        const int one_block = (j - i) * heads <= 16;  /* a decode row: its scores from the cache's keys */
        layout lay = layout_start(k, v, tables + c * table_width, len, kv, d, block_size, l16, l32,
                                  one_block ? NULL : kn, vn);
        while (!one_block && lay.p0 < l32)  /* a decode row lays its values out in the value passes */
            layout_step(&lay);
        pf_stream pf = {k, v, walk_from(tables + c * table_width, 0, block_size), 0, 1, kv * d, 0,
                        (kv * d * 2 + 63) / 64, NULL, NULL};
        if (j < n) {  /* the next sequence's keys and values arrive while this one is worked on */
            int64_t nl = row_lens != NULL ? row_lens[j] : seq_lens[chunks[j]];
            for (int64_t r = j + 1; row_lens != NULL && r < n && chunks[r] == chunks[j]; r++)
                nl = row_lens[r] > nl ? row_lens[r] : nl;
            pf.w = walk_from(tables + chunks[j] * table_width, 0, block_size);
            pf.left = nl;
        }
        segment_amx(q, rows + i, lens, j - i, heads, kv, d, scale, k, v, tables + c * table_width, block_size,
                    one_block ? NULL : kn, vn, l16, l32, blocks, out, &pf);
        i = j;
    }
    _tile_release();
}
#endif

/* 1 where the AVX-512 loops run (without them the torch path is faster: fast/kv/attention_c.py). */
int unf_decode_attention_simd(void) {
#ifdef HAVE_AVX512_PATH
    return __builtin_cpu_supports("avx512f") != 0;
#else
    return 0;
#endif
}

/* 1 where the AMX path runs (simd 1, head sizes 32, 64 and 128). */
int unf_decode_attention_amx(void) {
#ifdef HAVE_AVX512_PATH
    return amx_ready();
#else
    return 0;
#endif
}

/* Floats of scratch one call needs (per thread) for rows of up to max_len positions. */
int64_t unf_decode_attention_scratch(int64_t heads, int64_t kv, int64_t d, int64_t max_len) {
    int64_t floats = heads * (max_len + 2 * d);
#ifdef HAVE_AVX512_PATH
    const int64_t amx = (amx_scratch_bytes(kv, d, max_len) + 3) / 4;
    floats = amx > floats ? amx : floats;
#else
    (void)kv;
#endif
    return floats;
}

/* q: bf16 [*, heads, D] (row rows[i] for sequence i); k, v: bf16 [num_blocks, block_size, kv, D];
 * tables: int32 [B, table_width]; seq_lens: int32 [B]; chunks[i]: sequence i's row in tables/seq_lens;
 * out: bf16 [*, heads, D] (row rows[i]). scratch: see below.
 * row_lens: NULL (row i attends to its sequence's seq_lens[chunks[i]] positions, a decode row) or int32 [n],
 * the positions row i attends to (a prefill chunk's rows: start + 1, start + 2, ...; causal), at most its
 * sequence's length.
 * Returns 0; 1: a length outside [1, min(seq_lens[c], max_len, table_width * block_size)]; 2: a block id outside
 * [0, num_blocks); 3: head sizes this kernel does not take (D not a multiple of 16 or above 256).
 * simd 0: the plain loops even where AVX-512 is there (tests compare the two); 4: the same loops compiled for
 * AVX2 (same bits; the path of CPUs without AVX-512); 2: the AVX-512 float32 loops; 3: the AVX-512 BF16 loops
 * even where AMX is there; 1: the best this CPU has (AMX, then AVX-512 BF16).
 * scratch: unf_decode_attention_scratch(heads, kv, d, max_len) floats. */
static int last_path = -1;

/* The path the last call took (tests): 4 AMX, 3 AVX-512 BF16, 2 AVX-512 float32, 0 plain C, 5 plain C in its AVX2
 * build, -1 none yet. */
int unf_decode_attention_last_path(void) { return last_path; }

int unf_decode_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *tables,
                         const int32_t *seq_lens, const int64_t *chunks, const int64_t *rows,
                         const int32_t *row_lens, int64_t n,
                         int64_t heads, int64_t kv, int64_t d, int64_t block_size, int64_t num_blocks,
                         int64_t table_width, int64_t max_len, float scale, float *scratch, uint16_t *out, int simd) {
    if (d % LANES != 0 || d > 256 || kv <= 0 || heads % kv != 0 || block_size <= 0)
        return 3;
    const int64_t group = heads / kv;
#ifdef HAVE_AVX2_PLAIN
    const int avx2 = simd == 4 && __builtin_cpu_supports("avx2");
#else
    const int avx2 = 0;
#endif
    if (simd == 4)
        simd = 0; /* the plain loops (in their AVX2 build where the CPU has it) */
#ifdef HAVE_AVX512_PATH
    const int avx512 = simd && __builtin_cpu_supports("avx512f");
    const int bf16_path = avx512 && simd != 2 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")
                          && (d == 16 || d == 32 || d == 64 || d == 128);
#endif
    float *s = scratch, *qf = scratch + heads * max_len, *acc = qf + heads * d;
    /* decode rows read K/V cold from memory: their values are prefetched during the scores too; a prefill chunk's
     * rows find them warm (just written), where the extra prefetches only cost */
    const int v_early = row_lens == NULL;
    for (int64_t i = 0; i < n; i++) {  /* every row checked before any is computed (and before any is prefetched) */
        const int64_t c = chunks[i], len = row_lens ? row_lens[i] : seq_lens[c];
        if (len < 1 || len > seq_lens[c] || len > max_len || len > table_width * block_size)
            return 1;
        const int32_t *table = tables + c * table_width;
        for (int64_t b = 0; b < (len + block_size - 1) / block_size; b++)
            if (table[b] < 0 || table[b] >= num_blocks)
                return 2;
    }
#ifdef HAVE_AVX512_PATH
    if (simd == 1 && bf16_path && (d == 32 || d == 64 || d == 128) && amx_ready()) {
        last_path = 4;
        rows_amx(q, k, v, tables, seq_lens, chunks, rows, row_lens, n, heads, kv, d, block_size, table_width, max_len,
                 scale, (uint8_t *)scratch, out);
        return 0;
    }
    last_path = bf16_path ? 3 : avx512 ? 2 : avx2 ? 5 : 0;
    int64_t spread[heads + 1];  /* head h of a tile prefetches rows spread[h] .. spread[h + 1] of the tile ahead */
    for (int64_t h = 0; h <= heads; h++)
        spread[h] = h * TILE / heads;
#else
    last_path = avx2 ? 5 : 0;
    (void)v_early;  /* only the AVX-512 BF16 loops prefetch */
#endif
    for (int64_t i = 0; i < n; i++) {
        const int64_t c = chunks[i], len = row_lens ? row_lens[i] : seq_lens[c];
        const int32_t *table = tables + c * table_width;
        const uint16_t *qrow = q + rows[i] * heads * d;
#ifdef HAVE_AVX512_PATH
        if (bf16_path) {
            uint16_t *orow = out + rows[i] * heads * d;
            /* decode rows: the next row's keys are prefetched while this one's values are summed */
            const int32_t *nt = v_early && i + 1 < n ? tables + chunks[i + 1] * table_width : NULL;
            const int64_t nl = nt != NULL ? seq_lens[chunks[i + 1]] : 0;
            switch (d) {
            case 16: seq_bf16_1(qrow, k, v, table, len, heads, kv, block_size, scale, s, qf, orow, v_early, spread,
                               nt, nl); break;
            case 32: seq_bf16_2(qrow, k, v, table, len, heads, kv, block_size, scale, s, qf, orow, v_early, spread,
                               nt, nl); break;
            case 64: seq_bf16_4(qrow, k, v, table, len, heads, kv, block_size, scale, s, qf, orow, v_early, spread,
                               nt, nl); break;
            default: seq_bf16_8(qrow, k, v, table, len, heads, kv, block_size, scale, s, qf, orow, v_early, spread,
                                nt, nl); break;
            }
            continue;
        }
#endif
        for (int64_t j = 0; j < heads * d; j++)
            qf[j] = bf16_to_f32(qrow[j]);
#ifdef HAVE_AVX512_PATH
        if (avx512)
            scores_avx512(qf, group, d, k, table, len, block_size, kv, scale, s);
        else
#endif
#ifdef HAVE_AVX2_PLAIN
        if (avx2)
            scores_avx2(qf, heads, group, d, k, table, len, block_size, kv, scale, s);
        else
#endif
            scores_plain(qf, heads, group, d, k, table, len, block_size, kv, scale, s);
        for (int64_t h = 0; h < heads; h++) {  /* softmax numerators in place; acc[h * d] keeps the sums */
            float *sh = s + h * len, m = sh[0];
            for (int64_t p = 1; p < len; p++)
                m = sh[p] > m ? sh[p] : m;
            if (!(m > -INFINITY && m < INFINITY))  /* inf among the scores: no shift (the result is NaN) */
                m = 0.0f;
#ifdef HAVE_AVX512_PATH
            if (avx512)
                qf[h] = softmax_exp_avx512(sh, len, m);  /* qf is no longer needed: it holds the sums */
            else
#endif
#ifdef HAVE_AVX2_PLAIN
            if (avx2)
                qf[h] = softmax_exp_avx2(sh, len, m);
            else
#endif
                qf[h] = softmax_exp_plain(sh, len, m);
        }
#ifdef HAVE_AVX512_PATH
        if (avx512)
            values_avx512(s, heads, group, d, v, table, len, block_size, kv, acc);
        else
#endif
#ifdef HAVE_AVX2_PLAIN
        if (avx2)
            values_avx2(s, heads, group, d, v, table, len, block_size, kv, acc);
        else
#endif
            values_plain(s, heads, group, d, v, table, len, block_size, kv, acc);
        uint16_t *orow = out + rows[i] * heads * d;
        for (int64_t h = 0; h < heads; h++)
            for (int64_t j = 0; j < d; j++)
                orow[h * d + j] = f32_to_bf16(acc[h * d + j] / qf[h]);
    }
    return 0;
}
