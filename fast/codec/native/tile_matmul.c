/* y = x W^T on the CPU for W held in tile order, plain bf16 or palette form (12 bits per weight).
 *
 * Tile order (fast/codec/matmul_c.py builds it at load): W [N, K] is cut into panels of 16 output
 * features and steps of 32 inputs; tile (p, t) holds 512 bf16 words, word i*32 + n*2 + e being
 * W[16p + n][32t + 2i + e] (0 outside the matrix). That is the layout AMX's TDPBF16PS takes for its
 * B operand (pairs of inputs side by side), and an AVX-512 row of 16 pairs is one output per lane.
 *
 * A compressed tile stores the same words as an sm byte each (sign and mantissa, in tile order) and
 * a 4-bit palette index each (two per byte, the even word in the low nibble); words whose exponent is
 * not in the palette (FORMAT.md's verbatim chunks) are patched after the palette decode from a short
 * list per tile. Decoding a tile gives exactly the words of the plain tile, so the two loaders feed
 * the same arithmetic: compressed and plain products are equal bit for bit ("same-kernel exact").
 *
 * One product family per machine, chosen by the caller from the CPU (fast/cpu_isa.py, capped by
 * UNFIRE_CPU_ISA), identical for both loaders and for every number of rows M:
 *   path 1, amx: AMX; the 4 x T tiles of four panels are decoded into an L1/L2 buffer once and
 *           multiplied with every 32-row block of x by TDPBF16PS.
 *   path 0, avx512: AVX-512 BF16 (VDPBF16PS). Up to 4 rows each tile is decoded into registers/L1 and
 *           used at once; above, four panels' tiles are decoded once into an L2 buffer and met by every
 *           block of 4 rows.
 *   path 3, avx2, path 4, neon and path 2, scalar: the same sums as path 0, by float32 FMAs.
 * The portable order (paths 0, 2, 3, 4): each output is one chain from +0 over the pairs of inputs
 * (2i, 2i + 1) in order of k, the odd input first: acc = fma(w[2i+1], x[2i+1], acc), then
 * acc = fma(w[2i], x[2i], acc), each rounded to nearest even, bf16 subnormal inputs and float32
 * subnormal results flushed to zero. That is what VDPBF16PS computes (checked on random and subnormal-
 * heavy pairs), a bf16 x bf16 product is exact in float32 and an FMA rounds once, so every path that
 * follows it gives the same bits: AVX-512 BF16, AVX2 (MXCSR set to flush), NEON (FPCR.FZ) and the
 * scalar fmaf loop (flushing by hand), on any CPU. AMX rounds its pair sums its own way (about 1 output
 * in 10^4 differs by one bf16 step); on one machine one path serves every M, so a row's outputs never
 * depend on the other rows of the batch.
 * Threads split the panels (the output features).
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "threads.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TM_X86 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#endif
#if defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define TM_NEON 1
#include <arm_neon.h>
#endif
#include <math.h>

#define TILE_WORDS 512
#ifndef TM_STREAM_BYTES
#define TM_STREAM_BYTES (4 << 20) /* outputs this large bypass the caches (they would evict x and B from L2) */
#endif
#ifndef TM_GROUP_BYTES
#define TM_GROUP_BYTES (512 << 10) /* compressed panels decoded at once for many rows (beside a pass of x in L2) */
#endif

enum { PATH_AVX512 = 0, PATH_AMX = 1, PATH_SCALAR = 2, PATH_AVX2 = 3, PATH_NEON = 4 };

typedef struct {
    const uint16_t *x;      /* [Mp][Kp] zero padded */
    int64_t M, Mp, Kp, N, T;
    const uint16_t *plain;  /* [P][T][512] or NULL */
    const uint8_t *sm, *idx, *pal; /* [P][T][512], [P][T][256], [16] */
    const int64_t *pstart;  /* [P*T + 1] */
    const uint16_t *pword;
    const uint8_t *pexp;
    uint16_t *y;            /* [M][N] */
    const uint16_t *xa;     /* path 1: x as A tiles [Mp/16][T][16 x 32] */
    const float *xf;        /* paths 2-4: x widened to float32 [M][Kp] */
    int64_t p0, p1;
    int path, status;
    int stream; /* y is large (>= TM_STREAM_BYTES): whole lines of it are written with non-temporal stores */
} job;

/* Working memory kept per thread between calls (a product is too short to pay for fresh pages each
 * time): slot 0 x's A tiles (the caller), 1 decoded tiles, 2 partial sums (each worker). Grows only. */
static __thread void *kept[3];
static __thread size_t kept_bytes[3];

static void *scratch(int slot, size_t bytes) {
    if (kept_bytes[slot] < bytes) {
        free(kept[slot]);
        kept_bytes[slot] = 0;
        kept[slot] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        if (!kept[slot])
            return NULL;
        kept_bytes[slot] = bytes;
    }
    return kept[slot];
}

static inline uint16_t to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t word_of(uint8_t sm, uint8_t exponent) {
    return (uint16_t)(((sm & 0x80u) << 8) | ((unsigned)exponent << 7) | (sm & 0x7fu));
}

static void patch_tile(const job *j, int64_t tile, uint16_t *out) {
    const uint8_t *sm = j->sm + tile * TILE_WORDS;
    for (int64_t q = j->pstart[tile]; q < j->pstart[tile + 1]; q++)
        out[j->pword[q]] = word_of(sm[j->pword[q]], j->pexp[q]);
}

#ifndef TM_PCG
#define TM_PCG 3 /* compressed tiles fetched this many steps ahead by the few-row products (paths 0, 3, 4) */
#endif
/* The sm and index bytes of compressed tile (p, t + TM_PCG), into L1 ahead of its decode (a panel's tiles are
 * consecutive, but NP panels' streams at once are more than the hardware prefetchers follow well). */
static inline void fetch_ahead(const job *j, int64_t p, int64_t t) {
    if (t + TM_PCG >= j->T)
        return;
    const int64_t tile = p * j->T + t + TM_PCG;
    for (int l = 0; l < 8; l++)
        __builtin_prefetch(j->sm + tile * TILE_WORDS + 64 * l, 0, 3);
    for (int l = 0; l < 4; l++)
        __builtin_prefetch(j->idx + tile * (TILE_WORDS / 2) + 64 * l, 0, 3);
}

static void decode_tile_scalar(const job *j, int64_t tile, uint16_t *out) {
    const uint8_t *sm = j->sm + tile * TILE_WORDS, *ix = j->idx + tile * (TILE_WORDS / 2);
    for (int w = 0; w < TILE_WORDS; w++)
        out[w] = word_of(sm[w], j->pal[(ix[w >> 1] >> ((w & 1) * 4)) & 15]);
    patch_tile(j, tile, out);
}

/* compressed panels decoded together for more than TM_RING_ROWS rows: a multiple of 4, at least 4 */
static int64_t group_panels(int64_t T) {
    const int64_t g = TM_GROUP_BYTES / (T * TILE_WORDS * 2) / 4 * 4;
    return g < 4 ? 4 : g;
}

/* ---- path 2: scalar, the portable order ---- */
static inline float flushed(float f) { /* a subnormal -> a zero of its sign */
    return fabsf(f) < 1.17549435e-38f ? copysignf(0.0f, f) : f;
}

/* Rows of panel p: each output one fmaf chain over the pairs in order of k, the odd input first, with
 * subnormals flushed by hand (so the bits do not hang on the FPU's mode or on how libm's fmaf works). */
static void panel_scalar(const job *j, int64_t p, uint16_t *buf) {
    for (int64_t m = 0; m < j->M; m++) {
        float acc[16] = {0};
        const float *xr = j->xf + m * j->Kp; /* flushed already */
        for (int64_t t = 0; t < j->T; t++) {
            const uint16_t *tl = j->plain ? j->plain + (p * j->T + t) * TILE_WORDS : buf;
            if (!j->plain)
                decode_tile_scalar(j, p * j->T + t, buf);
            for (int i = 0; i < 16; i++)
                for (int n = 0; n < 16; n++) {
                    const float odd = flushed(from_bf16(tl[i * 32 + 2 * n + 1]));
                    const float even = flushed(from_bf16(tl[i * 32 + 2 * n]));
                    acc[n] = flushed(fmaf(odd, xr[32 * t + 2 * i + 1], acc[n]));
                    acc[n] = flushed(fmaf(even, xr[32 * t + 2 * i], acc[n]));
                }
        }
        for (int n = 0; n < 16 && 16 * p + n < j->N; n++)
            j->y[m * j->N + 16 * p + n] = to_bf16(acc[n]);
    }
}

/* 16 float sums of rows m of panel p -> y (fewer at the matrix's edge) */
static inline void store_sums(const job *j, int64_t m, int64_t p, const float *sums) {
    for (int n = 0; n < 16 && 16 * p + n < j->N; n++)
        j->y[m * j->N + 16 * p + n] = to_bf16(sums[n]);
}

/* The portable order with vectors of LANES outputs (paths 3 and 4): rows m0 .. m0 + MB - 1 of panels p
 * and p + 1 (np of them), tiles of step t at b[q] + t * TILE_WORDS; where b[0] is NULL (compressed, few
 * rows) each step's tiles are decoded into ring just before use by DECODE. A tile row i holds 16 pairs:
 * H vectors of LANES pairs, whose even words (the low halves) are inputs 2i and odd words inputs 2i + 1.
 * VEC, LOADW, EVEN, ODD, BCAST, FMA, ZERO, STORE are the ISA's operations. */
#define DEFINE_FMA_ROWS(NAME, TGT, VEC, LANES, LOADW, EVEN, ODD, BCAST, FMA, ZERO, STORE, DECODE, MB)           \
    TGT static void NAME##_##MB(const job *j, const void *tab, const uint16_t *const b[2], int np, int64_t p,   \
                                int64_t m0, uint16_t *ring) {                                                   \
        enum { H = 16 / LANES };                                                                                \
        VEC acc[MB][2][H];                                                                                      \
        for (int m = 0; m < MB; m++)                                                                            \
            for (int q = 0; q < 2; q++)                                                                         \
                for (int h = 0; h < H; h++)                                                                     \
                    acc[m][q][h] = ZERO();                                                                      \
        for (int64_t t = 0; t < j->T; t++) {                                                                    \
            const uint16_t *tl[2];                                                                              \
            for (int q = 0; q < 2; q++) {                                                                       \
                const int qq = q < np ? q : 0;                                                                  \
                if (b[0]) {                                                                                     \
                    tl[q] = b[qq] + t * TILE_WORDS;                                                             \
                } else {                                                                                        \
                    if (q < np) {                                                                               \
                        fetch_ahead(j, p + q, t);                                                               \
                        DECODE(j, tab, (p + q) * j->T + t, ring + q * TILE_WORDS);                              \
                    }                                                                                           \
                    tl[q] = ring + qq * TILE_WORDS;                                                             \
                }                                                                                               \
            }                                                                                                   \
            const float *xr = j->xf + m0 * j->Kp + 32 * t;                                                      \
            for (int i = 0; i < 16; i++)                                                                        \
                for (int q = 0; q < 2; q++)                                                                     \
                    for (int h = 0; h < H; h++) {                                                               \
                        const VEC e = EVEN(LOADW(tl[q] + 32 * i + 2 * LANES * h));                              \
                        const VEC o = ODD(LOADW(tl[q] + 32 * i + 2 * LANES * h));                               \
                        for (int m = 0; m < MB; m++) { /* the odd input first (the portable order) */           \
                            acc[m][q][h] = FMA(o, BCAST(xr + m * j->Kp + 2 * i + 1), acc[m][q][h]);             \
                            acc[m][q][h] = FMA(e, BCAST(xr + m * j->Kp + 2 * i), acc[m][q][h]);                 \
                        }                                                                                       \
                    }                                                                                           \
        }                                                                                                       \
        float sums[16];                                                                                         \
        for (int m = 0; m < MB; m++)                                                                            \
            for (int q = 0; q < np; q++) {                                                                      \
                for (int h = 0; h < H; h++)                                                                     \
                    STORE(sums + LANES * h, acc[m][q][h]);                                                      \
                store_sums(j, m0 + m, p + q, sums);                                                             \
            }                                                                                                   \
    }

/* Panels [p0, p1) two at a time, rows two at a time. Compressed: for up to 2 rows each step's tiles are
 * decoded right before use; for more, the two panels' tiles are decoded once into buf (L2) and every
 * pair of rows meets them. */
#define DEFINE_FMA_PANELS(NAME, TGT, ROWS1, ROWS2)                                                              \
    TGT static void NAME(const job *j, const void *tab, uint16_t *buf,                                          \
                         void (*decode)(const job *, const void *, int64_t, uint16_t *)) {                      \
        const int64_t T = j->T;                                                                                 \
        for (int64_t p = j->p0; p < j->p1; p += 2) {                                                            \
            const int np = j->p1 - p < 2 ? 1 : 2;                                                               \
            const uint16_t *b[2] = {NULL, NULL};                                                                \
            if (j->plain) {                                                                                     \
                for (int q = 0; q < np; q++)                                                                    \
                    b[q] = j->plain + (p + q) * T * TILE_WORDS;                                                 \
            } else if (j->M > 2) {                                                                              \
                for (int q = 0; q < np; q++) {                                                                  \
                    for (int64_t t = 0; t < T; t++)                                                             \
                        decode(j, tab, (p + q) * T + t, buf + (q * T + t) * TILE_WORDS);                        \
                    b[q] = buf + q * T * TILE_WORDS;                                                            \
                }                                                                                               \
            }                                                                                                   \
            int64_t m = 0;                                                                                      \
            for (; m + 2 <= j->M; m += 2)                                                                       \
                ROWS2(j, tab, b, np, p, m, buf);                                                                \
            if (m < j->M)                                                                                       \
                ROWS1(j, tab, b, np, p, m, buf);                                                                \
        }                                                                                                       \
    }

/* the exponent tables of a palette for a byte shuffle: bit 7 of a word's low byte, bits 0-6 of its high */
static void palette_tables(const uint8_t *pal, uint8_t lo[16], uint8_t hi[16]) {
    for (int i = 0; i < 16; i++) {
        lo[i] = pal ? (uint8_t)((pal[i] & 1u) << 7) : 0;
        hi[i] = pal ? (uint8_t)(pal[i] >> 1) : 0;
    }
}

#ifdef TM_X86
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16")))
#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,amx-tile,amx-bf16")))
#define TD32 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16")))

static const uint8_t interleave[2][64] = {
    {0, 64, 1, 65, 2, 66, 3, 67, 4, 68, 5, 69, 6, 70, 7, 71, 8, 72, 9, 73, 10, 74, 11, 75, 12, 76, 13, 77,
     14, 78, 15, 79, 16, 80, 17, 81, 18, 82, 19, 83, 20, 84, 21, 85, 22, 86, 23, 87, 24, 88, 25, 89, 26, 90,
     27, 91, 28, 92, 29, 93, 30, 94, 31, 95},
    {32, 96, 33, 97, 34, 98, 35, 99, 36, 100, 37, 101, 38, 102, 39, 103, 40, 104, 41, 105, 42, 106, 43, 107,
     44, 108, 45, 109, 46, 110, 47, 111, 48, 112, 49, 113, 50, 114, 51, 115, 52, 116, 53, 117, 54, 118, 55,
     119, 56, 120, 57, 121, 58, 122, 59, 123, 60, 124, 61, 125, 62, 126, 63, 127}};

typedef struct { __m512i lo, hi, il0, il1, m7f, m80, m0f, m0f00; } decoder;

T512 static decoder decoder_for(const uint8_t *pal) {
    uint8_t lo[64] = {0}, hi[64] = {0};
    for (int i = 0; i < 16; i++) {
        lo[i] = (uint8_t)((pal[i] & 1u) << 7); /* the exponent's low bit, as bit 7 of the low byte */
        hi[i] = (uint8_t)(pal[i] >> 1);        /* its 7 high bits, as bits 0-6 of the high byte */
    }
    decoder d = {_mm512_loadu_si512(lo), _mm512_loadu_si512(hi), _mm512_loadu_si512(interleave[0]),
                 _mm512_loadu_si512(interleave[1]), _mm512_set1_epi8(0x7f), _mm512_set1_epi8((char)0x80),
                 _mm512_set1_epi16(0x0f), _mm512_set1_epi16(0x0f00)};
    return d;
}

/* 64 words (two tile rows) from 64 sm bytes and 32 index bytes, before any patch */
T512 static inline void decode64(const decoder *d, const uint8_t *sm, const uint8_t *ix, __m512i *w0,
                                 __m512i *w1) {
    const __m512i s = _mm512_loadu_si512(sm);
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)ix));
    /* byte 2b = low nibble of index byte b (word 2b), byte 2b+1 = its high nibble (word 2b+1) */
    const __m512i nib = _mm512_ternarylogic_epi64(_mm512_and_si512(w, d->m0f), _mm512_slli_epi16(w, 4),
                                                  d->m0f00, 0xf8); /* a | (b & c) */
    const __m512i lo = _mm512_ternarylogic_epi64(s, d->m7f, _mm512_permutexvar_epi8(nib, d->lo), 0xea);
    const __m512i hi = _mm512_ternarylogic_epi64(s, d->m80, _mm512_permutexvar_epi8(nib, d->hi), 0xea);
    *w0 = _mm512_permutex2var_epi8(lo, d->il0, hi);
    *w1 = _mm512_permutex2var_epi8(lo, d->il1, hi);
}

/* one tile's 512 words from its sm bytes and palette indices, 64 at a time, then the patches */
T512 static inline void decode_tile(const job *j, const decoder *d, int64_t tile, uint16_t *out) {
    const uint8_t *sm = j->sm + tile * TILE_WORDS, *ix = j->idx + tile * (TILE_WORDS / 2);
    const decoder dd = *d; /* in registers: the stores below could alias *d for all the compiler knows */
    for (int q = 0; q < 8; q++) {
        __m512i w0, w1;
        decode64(&dd, sm + 64 * q, ix + 32 * q, &w0, &w1);
        _mm512_storeu_si512(out + 64 * q, w0);
        _mm512_storeu_si512(out + 64 * q + 32, w1);
    }
    patch_tile(j, tile, out);
}

/* no patch in tile (p, t) of np consecutive panels starting at tile index first (stride T) */
static inline int no_patches(const job *j, int64_t first, int64_t T, int np) {
    for (int q = 0; q < np; q++)
        if (j->pstart[first + q * T] != j->pstart[first + q * T + 1])
            return 0;
    return 1;
}

/* 16 floats -> 16 bf16 words, exactly as to_bf16 (round to nearest even; NaN stays NaN, quiet) */
T512 static inline __m256i bf16_words(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

/* row m of panel p's 16 outputs (fewer at the matrix's edge) */
T512 static inline void store_row(const job *j, int64_t m, int64_t p, __m512 acc) {
    const int64_t left = j->N - 16 * p;
    const __mmask16 keep = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    _mm256_mask_storeu_epi16(j->y + m * j->N + 16 * p, keep, bf16_words(acc));
}

/* ---- path 0: AVX-512 BF16, MB <= 8 rows, NP panels at a time (MB x NP <= 16 sums in registers) ---- */
#define DEFINE_GEMV(MB, NP)                                                                                     \
    T512 static void gemv_##MB(const job *j, const decoder *d, uint16_t *buf) {                                 \
        for (int64_t p = j->p0; p < j->p1; p += NP) {                                                           \
            const int np = (int)(j->p1 - p < NP ? j->p1 - p : NP);                                              \
            __m512 acc[MB][NP];                                                                                 \
            for (int m = 0; m < MB; m++)                                                                        \
                for (int q = 0; q < NP; q++)                                                                    \
                    acc[m][q] = _mm512_setzero_ps();                                                            \
            for (int64_t t = 0; t < j->T; t++) {                                                                \
                const uint32_t *xr = (const uint32_t *)(j->x + 32 * t);                                         \
                if (!j->plain && np == NP && no_patches(j, p * j->T + t, j->T, NP)) {                           \
                    for (int q = 0; q < NP; q++) {                                                              \
                        const int64_t tile = (p + q) * j->T + t;                                                \
                        fetch_ahead(j, p + q, t);                                                               \
                        const uint8_t *sm = j->sm + tile * TILE_WORDS, *ix = j->idx + tile * (TILE_WORDS / 2);  \
                        for (int h = 0; h < 8; h++) {                                                           \
                            __m512i w0, w1;                                                                     \
                            decode64(d, sm + 64 * h, ix + 32 * h, &w0, &w1);                                    \
                            for (int m = 0; m < MB; m++) {                                                      \
                                const uint32_t *xm = xr + m * (j->Kp / 2) + 2 * h;                              \
                                acc[m][q] = _mm512_dpbf16_ps(acc[m][q], (__m512bh)w0,                           \
                                                             (__m512bh)_mm512_set1_epi32((int)xm[0]));          \
                                acc[m][q] = _mm512_dpbf16_ps(acc[m][q], (__m512bh)w1,                           \
                                                             (__m512bh)_mm512_set1_epi32((int)xm[1]));          \
                            }                                                                                   \
                        }                                                                                       \
                    }                                                                                           \
                    continue;                                                                                   \
                }                                                                                               \
                const uint16_t *tl[NP];                                                                         \
                for (int q = 0; q < NP; q++) {                                                                  \
                    const int64_t tile = (p + (q < np ? q : 0)) * j->T + t;                                     \
                    if (j->plain) {                                                                             \
                        tl[q] = j->plain + tile * TILE_WORDS;                                                   \
                    } else {                                                                                    \
                        if (q < np)                                                                             \
                            decode_tile(j, d, tile, buf + q * TILE_WORDS);                                      \
                        tl[q] = buf + (q < np ? q : 0) * TILE_WORDS;                                            \
                    }                                                                                           \
                }                                                                                               \
                for (int i = 0; i < 16; i++) {                                                                  \
                    __m512i w[NP];                                                                              \
                    for (int q = 0; q < NP; q++)                                                                \
                        w[q] = _mm512_loadu_si512(tl[q] + 32 * i);                                              \
                    for (int m = 0; m < MB; m++) {                                                              \
                        const __m512i xb = _mm512_set1_epi32((int)xr[m * (j->Kp / 2) + i]);                     \
                        for (int q = 0; q < NP; q++)                                                            \
                            acc[m][q] = _mm512_dpbf16_ps(acc[m][q], (__m512bh)w[q], (__m512bh)xb);              \
                    }                                                                                           \
                }                                                                                               \
            }                                                                                                   \
            for (int m = 0; m < MB; m++)                                                                        \
                for (int q = 0; q < np; q++)                                                                    \
                    store_row(j, m, p + q, acc[m][q]);                                                          \
        }                                                                                                       \
    }
DEFINE_GEMV(1, 4)
DEFINE_GEMV(2, 4)
DEFINE_GEMV(3, 4)
DEFINE_GEMV(4, 4)
DEFINE_GEMV(5, 2)
DEFINE_GEMV(6, 2)
DEFINE_GEMV(7, 2)
DEFINE_GEMV(8, 2)

/* ---- path 0 above 8 rows: rows m0 .. m0 + MB - 1 of panels p .. p + np - 1, tiles of step t at
 * b[q] + t * TILE_WORDS, each output summed in order of k by VDPBF16PS exactly as gemv_* sums it ---- */
#define DEFINE_ROWS512(MB)                                                                                      \
    T512 static void rows512_##MB(const job *j, const uint16_t *const b[4], int np, int64_t p, int64_t m0) {    \
        __m512 acc[MB][4];                                                                                      \
        for (int m = 0; m < MB; m++)                                                                            \
            for (int q = 0; q < 4; q++)                                                                         \
                acc[m][q] = _mm512_setzero_ps();                                                                \
        const uint32_t *x0 = (const uint32_t *)(j->x + m0 * j->Kp);                                             \
        for (int64_t t = 0; t < j->T; t++)                                                                      \
            for (int i = 0; i < 16; i++) {                                                                      \
                __m512i w[4];                                                                                   \
                for (int q = 0; q < 4; q++)                                                                     \
                    w[q] = _mm512_loadu_si512(b[q < np ? q : 0] + t * TILE_WORDS + 32 * i);                     \
                for (int m = 0; m < MB; m++) {                                                                  \
                    const __m512i xb = _mm512_set1_epi32((int)x0[m * (j->Kp / 2) + 16 * t + i]);                \
                    for (int q = 0; q < 4; q++)                                                                 \
                        acc[m][q] = _mm512_dpbf16_ps(acc[m][q], (__m512bh)w[q], (__m512bh)xb);                  \
                }                                                                                               \
            }                                                                                                   \
        for (int m = 0; m < MB; m++)                                                                            \
            for (int q = 0; q < np; q++)                                                                        \
                store_row(j, m0 + m, p + q, acc[m][q]);                                                         \
    }
DEFINE_ROWS512(1)
DEFINE_ROWS512(2)
DEFINE_ROWS512(3)
DEFINE_ROWS512(4)
DEFINE_ROWS512(5)
DEFINE_ROWS512(6)

/* path 0 for any M: up to 8 rows gemv_M (tiles decoded as they are used, every row's sums in registers);
 * above, four panels at a time, their tiles (decoded once into buf if compressed) met by every block of
 * 6 rows (24 sums in registers: 10 loads for 24 VDPBF16PS, 2-5% faster than blocks of 4 at 64-256 rows) */
T512 static void avx512_panels(const job *j, const decoder *d, uint16_t *buf) {
    static void (*const gemv[8])(const job *, const decoder *, uint16_t *) = {gemv_1, gemv_2, gemv_3, gemv_4,
                                                                              gemv_5, gemv_6, gemv_7, gemv_8};
    static void (*const rows[6])(const job *, const uint16_t *const *, int, int64_t, int64_t) = {
        rows512_1, rows512_2, rows512_3, rows512_4, rows512_5, rows512_6};
    if (j->M <= 8) {
        gemv[j->M - 1](j, d, buf);
        return;
    }
    const int64_t T = j->T;
    for (int64_t p = j->p0; p < j->p1; p += 4) {
        const int np = (int)(j->p1 - p < 4 ? j->p1 - p : 4);
        const uint16_t *b[4] = {NULL, NULL, NULL, NULL};
        for (int q = 0; q < np; q++) {
            if (j->plain) {
                b[q] = j->plain + (p + q) * T * TILE_WORDS;
                continue;
            }
            for (int64_t t = 0; t < T; t++)
                decode_tile(j, d, (p + q) * T + t, buf + (q * T + t) * TILE_WORDS);
            b[q] = buf + q * T * TILE_WORDS;
        }
        for (int64_t m = 0; m < j->M; m += 6)
            rows[(j->M - m < 6 ? j->M - m : 6) - 1](j, b, np, p, m);
    }
}

/* ---- path 1: AMX ---- */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* C tiles -> rows m0.. of panel pp (rows past M are padding: not stored) */
TAMX static inline void store_tile(const job *j, int c, int64_t m0, int64_t pp, float *scratch) {
    switch (c) { /* the tile number must be a constant */
    case 0: _tile_stored(0, scratch, 64); break;
    case 1: _tile_stored(1, scratch, 64); break;
    case 2: _tile_stored(2, scratch, 64); break;
    default: _tile_stored(3, scratch, 64); break;
    }
    for (int r = 0; r < 16 && m0 + r < j->M; r++)
        store_row(j, m0 + r, pp, _mm512_load_ps(scratch + 16 * r));
}

#define TM_PF 4  /* B tiles fetched this many steps ahead on their first use (from memory) */
#define TM_PC 4  /* compressed tiles fetched this many steps ahead (small batches) */
#ifndef TM_RING_ROWS
#define TM_RING_ROWS 128 /* compressed: up to this many rows decode each step just before its products */
#endif
#ifndef TM_PASS_BYTES
#define TM_PASS_BYTES (1 << 20) /* A tiles of one pass over the panels (rows of x kept in L2) */
#endif
#define TM_KC 64 /* at most this many steps of k per block (a pair of panels: <= 128 KB of B tiles, in L2) */
#define AMX_STEP(A0, A1, B0, B1)                                                                                \
    do {                                                                                                        \
        _tile_stream_loadd(4, A0, 64);                                                                          \
        _tile_loadd(6, B0, 64);                                                                                 \
        _tile_stream_loadd(5, A1, 64);                                                                          \
        _tile_loadd(7, B1, 64);                                                                                 \
        _tile_dpbf16ps(0, 4, 6);                                                                                \
        _tile_dpbf16ps(2, 5, 6);                                                                                \
        _tile_dpbf16ps(1, 4, 7);                                                                                \
        _tile_dpbf16ps(3, 5, 7);                                                                                \
    } while (0)

static inline void fetch_tile(const uint16_t *tile) { /* its 16 cache lines, into L1 */
    for (int l = 0; l < 16; l++)
        _mm_prefetch((const char *)tile + 64 * l, _MM_HINT_T0);
}

/* C tiles whose conversion to bf16 waits: stored as float32 in buf (4 x 256), to be written to y
 * a little later, a few rows per step while the next block's products run (an AMX store read back
 * at once stalls, and converting a whole block in one step held up the products by a third). */
typedef struct {
    int n, two, pair, done; /* done: rows converted so far (of 16, or 32 if two) */
    int64_t m0, p;
    float *buf;
} pending;

#define TM_FLUSH_AFTER 2 /* a finished block's rows are converted from this step of the next block on */
#define TM_FLUSH_ROWS 4  /* rows converted per step */

/* Row i (0-31) of a pending block's two C tiles side by side (panels p and p + 1) -> 32 bf16 words of
 * y: VCVTNE2PS2BF16 rounds as to_bf16 does (nearest even, NaN kept quiet) except that it flushes
 * float32 subnormals to zero, so a row holding one takes the exact integer path (store_row) instead. */
TD32 static inline void flush_row(const job *j, const pending *w, int i, __mmask32 keep) {
    const int64_t m = w->m0 + i;
    const float *lo = w->buf + 512 * (i >> 4) + 16 * (i & 15), *hi = lo + 256;
    const __m512 a = _mm512_load_ps(lo), b = w->pair ? _mm512_load_ps(hi) : a;
    if (_mm512_fpclass_ps_mask(a, 0x20) | _mm512_fpclass_ps_mask(b, 0x20)) { /* a subnormal */
        store_row(j, m, w->p, a);
        if (w->pair)
            store_row(j, m, w->p + 1, b);
        return;
    }
    uint16_t *to = j->y + m * j->N + 16 * w->p;
    if (j->stream && keep == 0xffffffffu && !((uintptr_t)to & 63)) /* a whole line: around the caches */
        _mm512_stream_si512((void *)to, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    else
        _mm512_mask_storeu_epi16(to, keep, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

/* Rows [w->done, upto) of the pending block (of 16, or 32 if two; none past M) */
TD32 static void flush_rows(const job *j, pending *w, int upto) {
    const int rows = w->two ? 32 : 16;
    const int64_t left = j->N - 16 * w->p;
    const __mmask32 keep = !w->pair ? (left >= 16 ? 0xffffu : (1u << left) - 1)
                           : left >= 32 ? 0xffffffffu : (__mmask32)((1ull << left) - 1);
    if (upto > rows)
        upto = rows;
    const int64_t end = j->M - w->m0 < upto ? j->M - w->m0 : upto;
    for (int i = w->done; i < end; i++)
        flush_row(j, w, i, keep);
    w->done = upto;
    if (upto == rows)
        w->n = 0;
}

TD32 static inline void flush(const job *j, pending *w) { flush_rows(j, w, 32); }

/* during step t of a block that started at k0: the next rows of the pending block, if any (from step
 * `after` on, `per` rows a step: amx_block takes all at once when there is one row block per panel) */
#define FLUSH_STEP(j, w, t, k0)                                                                                 \
    do {                                                                                                        \
        if ((w).n && (t) - (k0) >= after)                                                                       \
            flush_rows(j, &(w), (w).done + per);                                                                \
    } while (0)

/* Panels [p, p + np) (np <= 4), B tiles at b[q] (T tiles each, 512 words apart), every row of x.
 * Two panels at a time, in blocks of at most TM_KC steps of k (equal blocks): the pair's B tiles of
 * the block stay in cache while every 32-row block of x (2 A tiles per step, read from L2) meets
 * them in 2 x 2 C tiles (a last block of 16 rows takes 1 x 2). (Blocks of <= 20 steps,
 * whose B tiles fit L1, ran 5-7% slower at 256-2048 rows: the C tiles' stores and reloads between
 * blocks cost more than L2 reads of B.) Partial sums wait in
 * cbuf as float32 between blocks (stored and reloaded exactly); finished C tiles go to sbuf (two
 * sets, used in turn) and are converted during the next block's first step. Each output thus sums
 * its pairs in order of k, one TDPBF16PS per step, whatever the blocking or M. */
TAMX static void amx_block(const job *j, const uint16_t *const b[4], int np, int64_t p, float *cbuf,
                           float *sbuf) {
    static const uint16_t zero[TILE_WORDS] __attribute__((aligned(64)));
    const int64_t T = j->T, blocks = j->Mp <= 32 ? 1 : (T + TM_KC - 1) / TM_KC; /* one row block: no reuse */
    const int64_t kc = (T + blocks - 1) / blocks;
    pending w = {0, 0, 0, 0, 0, 0, NULL};
    const int after = j->Mp <= 32 ? 0 : TM_FLUSH_AFTER, per = j->Mp <= 32 ? 32 : TM_FLUSH_ROWS;
    int set = 0;
    for (int qq = 0; qq < np; qq += 2) {
        const uint16_t *b0 = b[qq], *b1 = qq + 1 < np ? b[qq + 1] : zero;
        const int64_t s1 = qq + 1 < np ? TILE_WORDS : 0;
        for (int64_t k0 = 0; k0 < T; k0 += kc) {
            const int64_t k1 = k0 + kc < T ? k0 + kc : T;
            const int first = k0 == 0, last = k1 == T;
            for (int64_t m0 = 0; m0 < j->Mp; m0 += 32) {
                const int two = m0 + 32 <= j->Mp; /* else 16 rows left */
                const uint16_t *x0 = j->xa + m0 / 16 * T * TILE_WORDS, *x1 = x0 + T * TILE_WORDS;
                float *c = cbuf + m0 / 32 * 1024; /* [Mp/32][4 tiles][256] */
                if (first) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                } else {
                    _tile_loadd(0, c, 64);
                    _tile_loadd(1, c + 256, 64);
                    _tile_loadd(2, c + 512, 64);
                    _tile_loadd(3, c + 768, 64);
                }
                if (two) {
                    const int ahead = m0 == 0 && j->plain; /* the B tiles' first use: fetch them ahead */
                    for (int64_t t = k0; t < k1; t++) {
                        if (ahead) {
                            fetch_tile(b0 + (t + TM_PF) * TILE_WORDS);
                            fetch_tile(b1 + (t + TM_PF) * s1);
                        } /* x's tiles come from L2 in order: the hardware prefetchers follow them (fetching them
                           * a step ahead here too, 32 lines a step, took 17% more time at 2048 rows) */
                        AMX_STEP(x0 + t * TILE_WORDS, x1 + t * TILE_WORDS, b0 + t * TILE_WORDS, b1 + t * s1);
                        FLUSH_STEP(j, w, t, k0);
                    }
                } else { /* 16 rows (or fewer: the tile rows are configured to M < 16) */
                    const int ahead = m0 == 0 && j->plain;
                    for (int64_t t = k0; t < k1; t++) {
                        if (ahead) {
                            fetch_tile(b0 + (t + TM_PF) * TILE_WORDS);
                            fetch_tile(b1 + (t + TM_PF) * s1);
                        }
                        _tile_loadd(4, x0 + t * TILE_WORDS, 64);
                        _tile_loadd(6, b0 + t * TILE_WORDS, 64);
                        _tile_loadd(7, b1 + t * s1, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        if (w.n)
                            flush(j, &w);
                    }
                }
                if (!last) {
                    _tile_stored(0, c, 64);
                    _tile_stored(1, c + 256, 64);
                    _tile_stored(2, c + 512, 64);
                    _tile_stored(3, c + 768, 64);
                    continue;
                }
                float *out = sbuf + set * 1024;
                set ^= 1;
                _tile_stored(0, out, 64);
                _tile_stored(1, out + 256, 64);
                if (two) {
                    _tile_stored(2, out + 512, 64);
                    _tile_stored(3, out + 768, 64);
                }
                if (w.n) /* a block too short to convert the previous one's rows in its steps */
                    flush(j, &w);
                w = (pending){1, two, s1 != 0, 0, m0, p + qq, out};
            }
        }
    }
    if (w.n)
        flush(j, &w);
}

/* C tiles 0-3 -> rows m.. of panels p (tiles 0, 2) and p + 1 (tiles 1, 3, if pair); tiles 2, 3 (rows
 * m + 16..) only if two */
TAMX static void store_block(const job *j, int64_t m, int64_t p, int pair, int two, float *scratch) {
    store_tile(j, 0, m, p, scratch);
    if (pair)
        store_tile(j, 1, m, p + 1, scratch);
    if (two) {
        store_tile(j, 2, m + 16, p, scratch);
        if (pair)
            store_tile(j, 3, m + 16, p + 1, scratch);
    }
}

/* Compressed panels [p, p + np) for at most TM_RING_ROWS rows (decode steps, small batches): each
 * step's two tiles are decoded one step before their products (the vector decode of step t + 1
 * overlaps the tile products of step t) into a 2 KB L1 ring of two buffers for up to 32 rows, or
 * kept in buf for more, where the first 32-row block decodes and the next blocks reuse the tiles.
 * The C tiles hold the sums over all of k. Same products, same order as amx_block. */
TAMX static void amx_small(const job *j, const decoder *d, int64_t p, int np, uint16_t *ring,
                           float *scratch) {
    const int64_t T = j->T, keep = j->Mp > 32; /* keep: every step's tiles stay for the next row blocks */
    const uint16_t *xa = j->xa;
    const int64_t m0 = 0;
    for (int qq = 0; qq < np; qq += 2) {
        const int pair = qq + 1 < np;
        const int64_t first0 = (p + qq) * T, first1 = (p + qq + 1) * T;
        if (!pair) /* the second panel's tiles are zero */
            for (int64_t t = 0; t < (keep ? T : 2); t++)
                memset(ring + (2 * t + 1) * TILE_WORDS, 0, TILE_WORDS * 2);
        decode_tile(j, d, first0, ring);
        if (pair)
            decode_tile(j, d, first1, ring + TILE_WORDS);
        const int two = j->Mp - m0 >= 32; /* two blocks of 16 rows: 2 x 2 C tiles */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *b0 = ring + (keep ? t : t & 1) * 2 * TILE_WORDS;
            _tile_stream_loadd(4, xa + t * TILE_WORDS, 64);
            _tile_loadd(6, b0, 64);
            _tile_loadd(7, b0 + TILE_WORDS, 64);
            if (two)
                _tile_stream_loadd(5, xa + (T + t) * TILE_WORDS, 64);
            const int far = t + TM_PC < T;
            if (far) { /* the compressed bytes a few steps ahead: the first panel's before its decode */
                const int64_t ahead0 = first0 + t + TM_PC;
                for (int l = 0; l < 8; l++)
                    _mm_prefetch((const char *)(j->sm + ahead0 * TILE_WORDS) + 64 * l, _MM_HINT_T0);
                for (int l = 0; l < 4; l++)
                    _mm_prefetch((const char *)(j->idx + ahead0 * (TILE_WORDS / 2)) + 64 * l, _MM_HINT_T0);
            }
            uint16_t *next = ring + (keep ? t + 1 : (t + 1) & 1) * 2 * TILE_WORDS;
            if (t + 1 < T)
                decode_tile(j, d, first0 + t + 1, next);
            if (far && pair) { /* the second's between the two decodes */
                const int64_t ahead1 = first1 + t + TM_PC;
                for (int l = 0; l < 8; l++)
                    _mm_prefetch((const char *)(j->sm + ahead1 * TILE_WORDS) + 64 * l, _MM_HINT_T0);
                for (int l = 0; l < 4; l++)
                    _mm_prefetch((const char *)(j->idx + ahead1 * (TILE_WORDS / 2)) + 64 * l, _MM_HINT_T0);
            }
            if (t + 1 < T && pair)
                decode_tile(j, d, first1 + t + 1, next + TILE_WORDS);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        store_block(j, m0, p + qq, pair, two, scratch);
        for (int64_t m1 = 32; keep && m1 < j->Mp; m1 += 32) { /* the next row blocks: tiles from buf */
            const uint16_t *x0 = j->xa + m1 / 16 * T * TILE_WORDS, *x1 = x0 + T * TILE_WORDS;
            const int both = j->Mp - m1 >= 32;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t t = 0; t < T; t++) {
                const uint16_t *b0 = ring + 2 * t * TILE_WORDS;
                _tile_stream_loadd(4, x0 + t * TILE_WORDS, 64);
                _tile_loadd(6, b0, 64);
                _tile_loadd(7, b0 + TILE_WORDS, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (both) {
                    _tile_stream_loadd(5, x1 + t * TILE_WORDS, 64);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            store_block(j, m1, p + qq, pair, both, scratch);
        }
    }
}

/* path 1: x has Mp rows (a multiple of 16, zero padded). Panels four at a time; compressed ones are
 * decoded once into buf (a group of them, L2) and used by every row block. */
TAMX static void amx_panels(const job *j, const decoder *d, uint16_t *buf) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    if (j->M < 16) /* one block of M rows: C and A tiles of M rows (the products cost by the row) */
        cfg.rows[0] = cfg.rows[1] = cfg.rows[2] = cfg.rows[3] = cfg.rows[4] = cfg.rows[5] = (uint8_t)j->M;
    _tile_loadconfig(&cfg);
    float sets[2048] __attribute__((aligned(64))); /* amx_block's two sets of C tiles */
    const int spill = j->T > TM_KC && j->Mp > 32; /* amx_block splits k */
    float *cbuf = spill ? scratch(2, (size_t)(j->Mp + 16) * 32 * 4) : NULL;
    if (spill && !cbuf) {
        _tile_release();
        ((job *)j)->status = 1;
        return;
    }
    const int64_t T = j->T;
    /* Rows in passes of at most TM_PASS_BYTES of A tiles (a multiple of 32 rows, at least
     * TM_RING_ROWS): each pass's x stays in L2 while the panels meet it; past that (a 2048-token
     * prefill step's x is MBs) each panel pair would read all of x from L3 again. Plain panels: the
     * passes outside (B is read again per pass, from L3). Compressed ones: a group of panels (up to
     * TM_GROUP_BYTES of tiles) is decoded once into buf, then every pass meets it, 4 panels at a time. */
    int64_t pass = TM_PASS_BYTES / (T * TILE_WORDS * 2 * 2) * 32; /* 32 rows: 2 A tiles per step */
    if (pass < TM_RING_ROWS)
        pass = TM_RING_ROWS;
    const int64_t group = j->plain ? 4 : group_panels(T);
    const int64_t outer = j->plain ? pass : j->Mp;
    for (int64_t m1 = 0; m1 < j->Mp; m1 += outer) {
        for (int64_t p = j->p0; p < j->p1; p += group) {
            const int64_t ng = j->p1 - p < group ? j->p1 - p : group;
            if (!j->plain && j->Mp <= TM_RING_ROWS) {
                for (int64_t q = 0; q < ng; q += 4)
                    amx_small(j, d, p + q, (int)(ng - q < 4 ? ng - q : 4), buf, sets);
                continue;
            }
            if (!j->plain)
                for (int64_t q = 0; q < ng; q++)
                    for (int64_t t = 0; t < T; t++)
                        decode_tile(j, d, (p + q) * T + t, buf + (q * T + t) * TILE_WORDS);
            const uint16_t *tiles = j->plain ? j->plain + p * T * TILE_WORDS : buf;
            const int64_t m_end = m1 + outer < j->Mp ? m1 + outer : j->Mp;
            for (int64_t m = m1; m < m_end; m += pass) {
                job rows = *j; /* rows [m, m + pass) of x and y */
                rows.xa = j->xa + m / 16 * T * TILE_WORDS;
                rows.y = j->y + m * j->N;
                rows.Mp = j->Mp - m < pass ? j->Mp - m : pass;
                rows.M = j->M - m < rows.Mp ? j->M - m : rows.Mp;
                for (int64_t q = 0; q < ng; q += 4) {
                    const int np = (int)(ng - q < 4 ? ng - q : 4);
                    const uint16_t *b[4] = {NULL, NULL, NULL, NULL};
                    for (int i = 0; i < np; i++)
                        b[i] = tiles + (q + i) * T * TILE_WORDS;
                    amx_block(&rows, b, np, p + q, cbuf, sets);
                }
            }
        }
    }
    if (j->stream)
        _mm_sfence(); /* the non-temporal stores are visible before the caller reads y */
    _tile_release();
}

static int amx_state = -1;

int tm_amx_ready(void) { /* the CPU has AMX-BF16 and Linux lets this process use its tiles */
    if (amx_state < 0) {
        unsigned a, b, c, d;
        int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((d >> 22) & 1) && ((d >> 24) & 1);
        ok = ok && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        amx_state = ok;
    }
    return amx_state;
}

int tm_avx512_ready(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bf16");
}

/* ---- path 3: AVX2 + FMA, the portable order (8 outputs a vector) ---- */
#define T2 __attribute__((target("avx2,fma")))
T2 static inline __m256i v2_loadw(const uint16_t *w) { return _mm256_loadu_si256((const __m256i *)w); }
T2 static inline __m256 v2_even(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
T2 static inline __m256 v2_odd(__m256i w) {
    return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}
T2 static inline __m256 v2_bcast(const float *x) { return _mm256_broadcast_ss(x); }
T2 static inline __m256 v2_fma(__m256 w, __m256 x, __m256 acc) { return _mm256_fmadd_ps(w, x, acc); }
T2 static inline __m256 v2_zero(void) { return _mm256_setzero_ps(); }
T2 static inline void v2_store(float *to, __m256 v) { _mm256_storeu_ps(to, v); }

/* one compressed tile's 512 words: palette by a byte shuffle (the tables are 16 bytes, twice), 32 words
 * a round, then the patches */
T2 static void decode_tile_avx2(const job *j, const void *tab, int64_t tile, uint16_t *out) {
    const __m256i tlo = _mm256_loadu_si256((const __m256i *)tab), thi = _mm256_loadu_si256((const __m256i *)tab + 1);
    const uint8_t *sm = j->sm + tile * TILE_WORDS, *ix = j->idx + tile * (TILE_WORDS / 2);
    const __m128i m0f = _mm_set1_epi8(0x0f);
    const __m256i m7f = _mm256_set1_epi8(0x7f), m80 = _mm256_set1_epi8((char)0x80);
    for (int q = 0; q < 16; q++) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(ix + 16 * q));
        const __m128i lo = _mm_and_si128(b, m0f), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m0f);
        const __m256i nib = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
        const __m256i s = _mm256_loadu_si256((const __m256i *)(sm + 32 * q));
        const __m256i low = _mm256_or_si256(_mm256_and_si256(s, m7f), _mm256_shuffle_epi8(tlo, nib));
        const __m256i high = _mm256_or_si256(_mm256_and_si256(s, m80), _mm256_shuffle_epi8(thi, nib));
        const __m256i r0 = _mm256_unpacklo_epi8(low, high), r1 = _mm256_unpackhi_epi8(low, high); /* per lane */
        _mm256_storeu_si256((__m256i *)(out + 32 * q), _mm256_permute2x128_si256(r0, r1, 0x20));
        _mm256_storeu_si256((__m256i *)(out + 32 * q + 16), _mm256_permute2x128_si256(r0, r1, 0x31));
    }
    patch_tile(j, tile, out);
}

DEFINE_FMA_ROWS(rows_avx2, T2, __m256, 8, v2_loadw, v2_even, v2_odd, v2_bcast, v2_fma, v2_zero, v2_store,
                decode_tile_avx2, 1)
DEFINE_FMA_ROWS(rows_avx2, T2, __m256, 8, v2_loadw, v2_even, v2_odd, v2_bcast, v2_fma, v2_zero, v2_store,
                decode_tile_avx2, 2)
DEFINE_FMA_PANELS(avx2_panels, T2, rows_avx2_1, rows_avx2_2)

int tm_avx2_ready(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
int tm_amx_ready(void) { return 0; }
int tm_avx512_ready(void) { return 0; }
int tm_avx2_ready(void) { return 0; }
#endif

#ifdef TM_NEON
/* ---- path 4: NEON, the portable order (4 outputs a vector) ---- */
static inline uint32x4_t vn_loadw(const uint16_t *w) { return vld1q_u32((const uint32_t *)w); }
static inline float32x4_t vn_even(uint32x4_t w) { return vreinterpretq_f32_u32(vshlq_n_u32(w, 16)); }
static inline float32x4_t vn_odd(uint32x4_t w) { return vreinterpretq_f32_u32(vandq_u32(w, vdupq_n_u32(0xffff0000u))); }
static inline float32x4_t vn_bcast(const float *x) { return vld1q_dup_f32(x); }
static inline float32x4_t vn_fma(float32x4_t w, float32x4_t x, float32x4_t acc) { return vfmaq_f32(acc, w, x); }
static inline float32x4_t vn_zero(void) { return vdupq_n_f32(0.0f); }
static inline void vn_store(float *to, float32x4_t v) { vst1q_f32(to, v); }

/* one compressed tile's 512 words: palette by a table lookup (TBL), 32 words a round, then the patches */
static void decode_tile_neon(const job *j, const void *tab, int64_t tile, uint16_t *out) {
    const uint8x16_t tlo = vld1q_u8((const uint8_t *)tab), thi = vld1q_u8((const uint8_t *)tab + 32);
    const uint8_t *sm = j->sm + tile * TILE_WORDS, *ix = j->idx + tile * (TILE_WORDS / 2);
    for (int q = 0; q < 16; q++) {
        const uint8x16_t b = vld1q_u8(ix + 16 * q);
        const uint8x16x2_t nib = vzipq_u8(vandq_u8(b, vdupq_n_u8(0x0f)), vshrq_n_u8(b, 4)); /* words in order */
        for (int h = 0; h < 2; h++) {
            const uint8x16_t s = vld1q_u8(sm + 32 * q + 16 * h);
            uint8x16x2_t w;
            w.val[0] = vorrq_u8(vandq_u8(s, vdupq_n_u8(0x7f)), vqtbl1q_u8(tlo, nib.val[h]));
            w.val[1] = vorrq_u8(vandq_u8(s, vdupq_n_u8(0x80)), vqtbl1q_u8(thi, nib.val[h]));
            vst2q_u8((uint8_t *)(out + 32 * q + 16 * h), w); /* low byte, high byte: little-endian words */
        }
    }
    patch_tile(j, tile, out);
}

DEFINE_FMA_ROWS(rows_neon, , float32x4_t, 4, vn_loadw, vn_even, vn_odd, vn_bcast, vn_fma, vn_zero, vn_store,
                decode_tile_neon, 1)
DEFINE_FMA_ROWS(rows_neon, , float32x4_t, 4, vn_loadw, vn_even, vn_odd, vn_bcast, vn_fma, vn_zero, vn_store,
                decode_tile_neon, 2)
DEFINE_FMA_PANELS(neon_panels, , rows_neon_1, rows_neon_2)

int tm_neon_ready(void) { return 1; }
#else
int tm_neon_ready(void) { return 0; }
#endif

static void *work(void *arg) {
    job *j = arg;
    if (j->p0 >= j->p1)
        return NULL;
    const int64_t words = j->path == PATH_AMX      ? group_panels(j->T) * j->T * TILE_WORDS
                          : j->path == PATH_SCALAR ? TILE_WORDS
                                                   : 4 * j->T * TILE_WORDS; /* four panels' tiles */
    uint16_t *buf = j->plain ? NULL : scratch(1, (size_t)words * 2);
    if (!j->plain && !buf) {
        j->status = 1;
        return NULL;
    }
    uint8_t tab[64]; /* the palette's byte-shuffle tables (paths 3, 4): low bits at 0 and 16, high at 32, 48 */
    palette_tables(j->pal, tab, tab + 32);
    memcpy(tab + 16, tab, 16);
    memcpy(tab + 48, tab + 32, 16);
#ifdef TM_X86
    if (j->path == PATH_AVX512 || j->path == PATH_AMX) {
        static const uint8_t no_palette[16];
        const decoder d = decoder_for(j->pal ? j->pal : no_palette);
        if (j->path == PATH_AMX)
            amx_panels(j, &d, buf);
        else
            avx512_panels(j, &d, buf);
        return NULL;
    }
    const unsigned csr = _mm_getcsr(); /* the portable order: round to nearest, flush subnormals (DAZ, FTZ) */
    _mm_setcsr(0x9fc0);
    if (j->path == PATH_AVX2)
        avx2_panels(j, tab, buf, decode_tile_avx2);
#endif
#ifdef TM_NEON
    uint64_t fpcr;
    __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
    __asm__ volatile("msr fpcr, %0" ::"r"((fpcr & ~(3ull << 22)) | (1ull << 24))); /* nearest even, FZ */
    if (j->path == PATH_NEON)
        neon_panels(j, tab, buf, decode_tile_neon);
#endif
    if (j->path == PATH_SCALAR)
        for (int64_t p = j->p0; p < j->p1; p++)
            panel_scalar(j, p, buf);
#ifdef TM_X86
    _mm_setcsr(csr);
#endif
#ifdef TM_NEON
    __asm__ volatile("msr fpcr, %0" ::"r"(fpcr));
#endif
    return NULL;
}

/* 1 when this build and CPU can run path */
static int path_ready(int path) {
    switch (path) {
    case PATH_AVX512: return tm_avx512_ready();
    case PATH_AMX: return tm_amx_ready();
    case PATH_AVX2: return tm_avx2_ready();
    case PATH_NEON: return tm_neon_ready();
    case PATH_SCALAR: return 1;
    default: return 0;
    }
}

/* Returns 0, 1 if memory ran out, 2 for a path this build or CPU cannot run, 3 for bad sizes. */
int tm_matmul(const uint16_t *x, int64_t M, int64_t Mp, int64_t Kp, int64_t N, const uint16_t *plain,
              const uint8_t *sm, const uint8_t *idx, const uint8_t *pal, const int64_t *pstart,
              const uint16_t *pword, const uint8_t *pexp, uint16_t *y, int path, int threads, int64_t ldx,
              int64_t K) {
    /* x: M rows of K inputs, ldx apart; the AMX path packs them (zero padded) itself, the others read
     * x as [Mp][Kp] (ldx == Kp, padded by the caller) */
    if (M < 1 || N < 1 || Kp < 32 || Kp % 32 || Mp < M || (path == PATH_AMX && Mp % 16) || K < 1 || K > Kp ||
        Kp - K >= 32 || ldx < K || (path != PATH_AMX && ldx != Kp))
        return 3;
    if (!path_ready(path))
        return 2;
    const int64_t P = (N + 15) / 16;
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    const int64_t unit = 4; /* panels a thread takes together */
    const int64_t units = (P + unit - 1) / unit;
    if (threads > units)
        threads = (int)units;
    uint16_t *xa = NULL;
    if (path == 1) { /* x as A tiles: each 16 x 32 block contiguous (one 1 KB load), zero padded */
        xa = scratch(0, (size_t)Mp * Kp * 2);
        if (!xa)
            return 1;
        const int64_t T = Kp / 32;
        for (int64_t b = 0; b < Mp / 16; b++)
            for (int64_t t = 0; t < T; t++)
                for (int r = 0; r < 16; r++) {
                    uint16_t *to = xa + ((b * T + t) * 16 + r) * 32;
                    const int64_t row = 16 * b + r, have = K - 32 * t < 32 ? K - 32 * t : 32;
                    if (row < M && have == 32) {
                        memcpy(to, x + row * ldx + 32 * t, 64);
                    } else {
                        memset(to, 0, 64);
                        if (row < M)
                            memcpy(to, x + row * ldx + 32 * t, (size_t)have * 2);
                    }
                }
    }
    float *xf = NULL;
    if (path == PATH_SCALAR || path == PATH_AVX2 || path == PATH_NEON) { /* x widened to float32, once */
        xf = scratch(0, (size_t)M * Kp * 4);
        if (!xf)
            return 1;
        for (int64_t i = 0; i < M * Kp; i++) /* bf16 subnormals flushed, as VDPBF16PS reads them */
            xf[i] = (x[i] & 0x7f80) ? from_bf16(x[i]) : from_bf16(x[i] & 0x8000);
    }
    job jobs[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        job j = {x, M, Mp, Kp, N, Kp / 32, plain, sm, idx, pal, pstart, pword, pexp, y, xa, xf, 0, 0, path, 0,
                 M * N * 2 >= TM_STREAM_BYTES};
        j.p0 = units * t / threads * unit;
        j.p1 = units * (t + 1) / threads * unit;
        if (j.p1 > P)
            j.p1 = P;
        jobs[t] = j;
    }
    pool_run(work, jobs, sizeof(job), threads);
    for (int t = 0; t < threads; t++)
        if (jobs[t].status)
            return jobs[t].status;
    return 0;
}

/* the words of compressed tiles [first, first + count) (for tests and for checking a load) */
int tm_decode_tiles(const uint8_t *sm, const uint8_t *idx, const uint8_t *pal, const int64_t *pstart,
                    const uint16_t *pword, const uint8_t *pexp, int64_t first, int64_t count, uint16_t *out,
                    int vector) {
    job j = {NULL, 0, 0, 0, 0, 0, NULL, sm, idx, pal, pstart, pword, pexp, NULL, NULL, NULL, 0, 0, 0, 0, 0};
#ifdef TM_X86
    if (vector && tm_avx512_ready()) {
        const decoder d = decoder_for(pal);
        for (int64_t t = 0; t < count; t++)
            decode_tile(&j, &d, first + t, out + t * TILE_WORDS);
        return 0;
    }
#endif
    if (vector)
        return 2;
    for (int64_t t = 0; t < count; t++)
        decode_tile_scalar(&j, first + t, out + t * TILE_WORDS);
    return 0;
}

/* The weight as a row-major bf16 matrix [N, K] (out), from compressed tiles: the decoded-matrix path
 * that a product by another library (oneDNN, for many rows) takes. Rows are split over threads. */
typedef struct {
    job j;
    int64_t K;
    uint16_t *out;
} unpack_job;

static void unpack_panel_scalar(const unpack_job *u, int64_t p, uint16_t *buf) {
    const job *j = &u->j;
    for (int64_t t = 0; t < j->T; t++) {
        decode_tile_scalar(j, p * j->T + t, buf);
        for (int n = 0; n < 16 && 16 * p + n < j->N; n++)
            for (int w = 0; w < 32 && 32 * t + w < u->K; w++)
                u->out[(16 * p + n) * u->K + 32 * t + w] = buf[(w >> 1) * 32 + 2 * n + (w & 1)];
    }
}

#ifdef TM_X86
T512 static void unpack_panel(const unpack_job *u, int64_t p, uint16_t *buf) {
    const job *j = &u->j;
    const decoder d = decoder_for(j->pal);
    const __m512i stride = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208,
                                             224, 240);
    for (int64_t t = 0; t < j->T; t++) {
        decode_tile(j, &d, p * j->T + t, buf);
        const int64_t left = u->K - 32 * t;
        const __mmask32 keep = left >= 32 ? ~0u : ((1u << left) - 1);
        for (int n = 0; n < 16 && 16 * p + n < j->N; n++) {
            const __m512i row = _mm512_i32gather_epi32(stride, (const int *)buf + n, 4);
            _mm512_mask_storeu_epi16(u->out + (16 * p + n) * u->K + 32 * t, keep, row);
        }
    }
}
#endif

static void *unpack_work(void *arg) {
    unpack_job *u = arg;
    uint16_t buf[TILE_WORDS] __attribute__((aligned(64)));
    for (int64_t p = u->j.p0; p < u->j.p1; p++) {
#ifdef TM_X86
        if (u->j.path == 0) {
            unpack_panel(u, p, buf);
            continue;
        }
#endif
        unpack_panel_scalar(u, p, buf);
    }
    return NULL;
}

int tm_unpack(const uint8_t *sm, const uint8_t *idx, const uint8_t *pal, const int64_t *pstart,
              const uint16_t *pword, const uint8_t *pexp, int64_t N, int64_t K, uint16_t *out, int vector,
              int threads) {
    if (N < 1 || K < 1)
        return 3;
#ifdef TM_X86
    if (vector && !tm_avx512_ready())
        return 2;
#else
    if (vector)
        return 2;
#endif
    const int64_t P = (N + 15) / 16;
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > P)
        threads = (int)P;
    unpack_job jobs[MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        job j = {NULL, 0, 0, 0, N, (K + 31) / 32, NULL, sm, idx, pal, pstart, pword, pexp, NULL, NULL, NULL,
                 P * t / threads, P * (t + 1) / threads, vector ? 0 : 2, 0, 0};
        jobs[t].j = j;
        jobs[t].K = K;
        jobs[t].out = out;
    }
    pool_run(unpack_work, jobs, sizeof(unpack_job), threads);
    return 0;
}
