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

/* s[h * len + p] = (q_h . k_p[g(h)]) * scale for every head h (qf: float32 [heads][d]), positions [0, len). */
static void scores_plain(const float *qf, int64_t heads, int64_t group, int64_t d, const uint16_t *k,
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
static void values_plain(const float *w, int64_t heads, int64_t group, int64_t d, const uint16_t *v,
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
static float softmax_exp_plain(float *sh, int64_t len, float m) {
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

/* sh[p] = e^(sh[p] - m) for p < len (exp_f32's rule, 16 lanes at a time); returns their sum (a tree of lanes). */
__attribute__((target("avx512f")))
static float softmax_exp_avx512(float *sh, int64_t len, float m) {
    const __m512 shift = _mm512_set1_ps(m), low = _mm512_set1_ps(-87.3f), log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 c1 = _mm512_set1_ps(0.693359375f), c2 = _mm512_set1_ps(-2.12194440e-4f), one = _mm512_set1_ps(1.0f);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p = 0; p < len; p += 16) {
        const __mmask16 live = len - p >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - p)) - 1);
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(live, sh + p), shift);
        __m512 xc = _mm512_max_ps(low, x);  /* a NaN x stays NaN */
        __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(n, c2, _mm512_fnmadd_ps(n, c1, xc));
        __m512 q = _mm512_set1_ps(1.9875691500e-4f);
        q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507e-3f));
        q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
        q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
        q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
        q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
        q = _mm512_add_ps(_mm512_fmadd_ps(q, _mm512_mul_ps(r, r), r), one);
        __m512 e = _mm512_scalef_ps(q, n);
        e = _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(x, low, _CMP_LT_OQ), _mm512_setzero_ps());
        e = _mm512_maskz_mov_ps(live, e);
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
#endif

/* 1 where the AVX-512 loops run (without them the torch path is faster: fast/kv/attention_c.py). */
int unf_decode_attention_simd(void) {
#ifdef HAVE_AVX512_PATH
    return __builtin_cpu_supports("avx512f") != 0;
#else
    return 0;
#endif
}

/* q: bf16 [*, heads, D] (row rows[i] for sequence i); k, v: bf16 [num_blocks, block_size, kv, D];
 * tables: int32 [B, table_width]; seq_lens: int32 [B]; chunks[i]: sequence i's row in tables/seq_lens;
 * out: bf16 [*, heads, D] (row rows[i]). scratch: float32 of heads * (max_len + 2 D) entries.
 * row_lens: NULL (row i attends to its sequence's seq_lens[chunks[i]] positions, a decode row) or int32 [n],
 * the positions row i attends to (a prefill chunk's rows: start + 1, start + 2, ...; causal), at most its
 * sequence's length.
 * Returns 0; 1: a length outside [1, min(seq_lens[c], max_len, table_width * block_size)]; 2: a block id outside
 * [0, num_blocks); 3: head sizes this kernel does not take (D not a multiple of 16 or above 256).
 * simd 0: the plain loops even where AVX-512 is there (tests compare the two). */
int unf_decode_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int32_t *tables,
                         const int32_t *seq_lens, const int64_t *chunks, const int64_t *rows,
                         const int32_t *row_lens, int64_t n,
                         int64_t heads, int64_t kv, int64_t d, int64_t block_size, int64_t num_blocks,
                         int64_t table_width, int64_t max_len, float scale, float *scratch, uint16_t *out, int simd) {
    if (d % LANES != 0 || d > 256 || kv <= 0 || heads % kv != 0 || block_size <= 0)
        return 3;
    const int64_t group = heads / kv;
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
    int64_t spread[heads + 1];  /* head h of a tile prefetches rows spread[h] .. spread[h + 1] of the tile ahead */
    for (int64_t h = 0; h <= heads; h++)
        spread[h] = h * TILE / heads;
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
                qf[h] = softmax_exp_plain(sh, len, m);
        }
#ifdef HAVE_AVX512_PATH
        if (avx512)
            values_avx512(s, heads, group, d, v, table, len, block_size, kv, acc);
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
