/* The rANS-mode decoder for the CPU, in C (FORMAT.md section 9): rANS form -> bf16.
 *
 * fast/codec/decode_rans_c.py builds this file with the system C compiler on first use (as decode.c),
 * loads it with ctypes and calls unw_rans_isa once (UNFIRE_CPU_ISA's cap), unw_rans_decode (and, in the tests,
 * unw_rans_use). Python checks
 * first what is cheap and small (RansTensor.check_header: parameters, every array's dtype and length; check_index: alphabet, tables
 * summing to M, block_table < K, block_words and block_escapes rising from 0 to W and E, escapes per
 * block, states >= 2^16; the CRC-32 of those small arrays; the padding of the last packed group).
 * This file does the rest of FORMAT.md 9.6: the CRC-32 of raw, stream and escapes (computed by the
 * threads, a piece per block) and of the decoded data (per block, while it is in cache), and per
 * block that it reads exactly its own words and escapes and that every lane ends in state 2^16.
 * Every read is bounded by the array's real length whatever the index arrays say (a stream index is
 * clamped, an escape past the end reads 0): damaged input gives an error, never a wild read.
 *
 * How it decodes. Blocks are independent; threads take the next block until none is left. A block:
 *   1. the lanes, step by step and in lane order (the order that fixes which lane takes which word,
 *      9.4): slot = x mod M, one lookup gives f, slot - c and the value (a 64-bit entry of a table
 *      of M entries per frequency table), x = f * (x >> p) + slot - c, and a refill without a branch
 *      (the word is read anyway from a clamped index; whether it is used is arithmetic). The 32
 *      lanes' chains are independent, so the CPU overlaps them. With AVX2 (the defaults: 32 lanes,
 *      p = 12; lanes_avx2) eight lanes go at once, on 32-bit entries (f - 1, slot - c and the class: one
 *      gather; the slot is kept and its value looked up after the lanes), the refills by one byte shuffle of
 *      the next 8 words looked up from the mask of the lanes that need one; a thread takes blocks two at a
 *      time and runs their steps side by side (one block's 4 chains of gathers and multiplies leave the core
 *      idle most of the time);
 *   2. the escapes, in weight order: each escape symbol's value is the next escape field;
 *   3. bf16 = sign | value << (7 - m) | low mantissa bits, the raw field read with one 64-bit load
 *      (m = 2: four fields per 3 bytes; with AVX2, 8 weights per byte shuffle).
 * Two stages (k = low_bits > 0, FORMAT.md 9.4): each step decodes every lane's value, then every lane's k low
 * bits from the second-stage table its value's symbol names (the class: bits 48-63 of the 64-bit entry, bits
 * 12-19 of the 32-bit one), in decode_lanes2 or, with AVX2, a second gather per 8 lanes in lanes_avx2;
 * bf16 = sign | value << (7 - m) | low << q | q raw bits (with AVX2 and m + k = 7, 16 weights at a time
 * together with the values and escapes: join1_avx2).
 * Tables by context (FORMAT.md 9.2: weight i's table context_table[(i // D) mod P]): the portable lanes keep each
 * lane's i mod D and (i / D) mod P and move them on by `lanes` a step (ctx_step); the AVX2 lanes store a slot with
 * its table (table << 12 | slot, at most 16 tables) and find the 32 lanes' tables by one load (the column, D = 1),
 * a blend of two rows' (D >= 32) or a gather (any D). Other m than 2: join8_avx2 (8 weights a shuffle, any width).
 * On Whisper tiny.en's embedding (51864 x 384, one thread, Intel Xeon): tables by block, m = 4, 2.05 -> 1.00 ns
 * per weight with join8_avx2; by column 2.76 (gathers) -> 1.31 (one load a group of 8 lanes).
 * One core of an Intel Xeon (Sapphire Rapids class), a whole model through decode_rans_cpu: SmolLM2 (two
 * stages) 6.6 ns per weight before the AVX2 two-stage lanes, 2.1 ns with them; MiniLM (one stage) 2.7 ns with
 * the earlier AVX2 lanes, 2.0 ns with these.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "builds.h"
#include "crc32.h"
#include "threads.h"

#define ESCAPE 0xFFFFu /* the value an escape symbol's entry holds (alphabet values are < 2^15) */
#define STATE_LOW 65536u

enum { OK, BAD_WORDS, BAD_ESCAPES, BAD_CRC, NO_MEMORY };

static int lanes_taken; /* the AVX2 lanes that ran since unw_rans_lanes_taken last asked: 1 one stage, 2 two */

/* Tables by context (FORMAT.md 9.2, context_period P > 0): weight i's first-stage table is
 * context_table[(i // D) % P]; base[c] is where table context_table[c] starts in the decoding tables. */
typedef struct {
    const uint32_t *base; /* [P + 32]: table << p (in the AVX2 lanes' 32-bit tables: << 12, the same), entry
                           * P + j repeating entry j mod P (32 lanes from any context: one contiguous load) */
    int64_t stride, period;
} Ctx;

/* How the AVX2 lanes find a lane's context: none (tables by block), the column (D = 1: the 32 lanes of a step take
 * consecutive contexts, a load from base), long rows (D >= 32: the lanes of a step span at most two rows, a blend)
 * or any (each lane's r and c kept in vectors, a gather from base). */
enum { CTX_NONE, CTX_COLUMN, CTX_ROWS, CTX_ANY };

/* The context of each of n lanes for the weights first, first + 1, ...: r = i mod D and c = (i / D) mod P. */
static inline __attribute__((always_inline)) void ctx_start(const Ctx *cx, int64_t first, int n, int64_t *r,
                                                            int64_t *c) {
    for (int l = 0; l < n; l++) {
        int64_t i = first + l;
        r[l] = i % cx->stride;
        c[l] = i / cx->stride % cx->period;
    }
}

/* Each lane's (r, c) moved on by lanes weights (one step): ir = lanes mod D, ic = (lanes / D) mod P. */
static inline __attribute__((always_inline)) void ctx_step(const Ctx *cx, int64_t ir, int64_t ic, int n, int64_t *r,
                                                           int64_t *c) {
    for (int l = 0; l < n; l++) {
        int64_t rr = r[l] + ir, cc = c[l] + ic;
        if (rr >= cx->stride)
            rr -= cx->stride, cc++;
        if (cc >= cx->period) /* c < P and ic < P: one subtraction brings it back */
            cc -= cx->period;
        r[l] = rr, c[l] = cc;
    }
}

typedef struct {
    const uint8_t *raw, *escapes, *block_table;
    const uint16_t *stream;
    const uint32_t *block_words, *block_escapes, *states;
    const uint64_t *dec; /* K tables of M entries: class << 48 | f << 32 | (slot - c) << 16 | value */
    const uint64_t *dec2; /* two stages: C tables of M entries: f << 32 | (slot - c) << 16 | low bits */
    /* the AVX2 lanes (32 lanes, p = 12): the tables in 32 bits (f - 1 | class << 12 | (slot - c) << 20, and with
     * two stages f - 1 | low bits << 12 | (slot - c) << 20) and each slot's value; NULL elsewhere */
    const uint32_t *decw, *dec2w, *valw;
    int64_t raw_len, esc_len, words, n_escapes, n, block_size, n_blocks, next_block;
    int lanes, p, m, k, n_tables;
    Ctx ctx; /* ctx.period > 0: tables by context (block_table unused) */
    uint16_t *out;
    struct Block *blocks;
} Rans;

typedef struct Block { /* one block's results */
    uint32_t crc_out, crc_raw, crc_stream, crc_esc; /* of the block's output, and its piece of each array */
    int64_t raw_bytes, stream_bytes, esc_bytes;
    int error;
    int64_t detail;
} Block;

static inline __attribute__((always_inline)) int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Field i (width w <= 16 bits) of a packed array of len bytes (FORMAT.md 9.1); bytes past the end read 0. */
static inline __attribute__((always_inline)) uint32_t field(const uint8_t *a, int64_t len, int64_t i, int w) {
    int64_t off = i * w, byte = off >> 3;
    uint64_t v = 0;
    if (byte + 8 <= len)
        memcpy(&v, a + byte, 8);
    else
        for (int64_t k = byte; k < len && k < byte + 8; k++)
            v |= (uint64_t)a[k] << (8 * (k - byte));
    return (uint32_t)(v >> (off & 7)) & ((1u << w) - 1);
}

/* The CRC of piece b of n_blocks even pieces of an array of len bytes; its length in *bytes. */
static uint32_t crc_piece(const uint8_t *a, int64_t len, int64_t b, int64_t n_blocks, int64_t *bytes) {
    int64_t lo = len * b / n_blocks, hi = len * (b + 1) / n_blocks;
    *bytes = hi - lo;
    return ~crc_update(~0u, a + lo, (size_t)(hi - lo));
}

/* The lanes of one block, step by step (FORMAT.md 9.4): values into vals, states in x; returns the word
 * position after the block. P: prob_bits (a constant in the common case, so shifts are immediates).
 * CLAMP: whether a read may pass the stream's end (else the caller has made sure it cannot). With a context
 * (cx not NULL: tab is then every table, and first the index of the first weight in the tensor), each weight's
 * table is its context's; cnt: 2 * lanes of scratch. */
static inline __attribute__((always_inline)) uint64_t decode_lanes(const uint64_t *tab, const uint16_t *stream,
                                                                   uint64_t pos, uint64_t last_word, uint32_t *x,
                                                                   uint16_t *vals, int64_t len, int lanes,
                                                                   const int P, const int CLAMP, const Ctx *cx,
                                                                   int64_t first, int64_t *cnt) {
    const uint32_t mask = (1u << P) - 1;
    int64_t *cr = cnt, *cc = cnt + lanes, ir = 0, ic = 0;
    if (cx) {
        ctx_start(cx, first, lanes, cr, cc);
        ir = lanes % cx->stride, ic = lanes / cx->stride % cx->period;
    }
    for (int64_t base = 0; base < len; base += lanes) { /* step t = base / lanes */
        int nl = (int)min64(lanes, len - base);
        for (int l = 0; l < nl; l++) {
            uint32_t xl = x[l];
            uint64_t e = cx ? tab[cx->base[cc[l]] + (xl & mask)] : tab[xl & mask];
            xl = (uint32_t)(e >> 32) * (xl >> P) + ((uint32_t)e >> 16);
            uint32_t need = xl < STATE_LOW, word = stream[CLAMP && pos > last_word ? last_word : pos];
            xl = xl << (need << 4) | (word & (0u - need)); /* arithmetic, not a select: compilers branch on it */
            pos += need;
            x[l] = xl;
            vals[base + l] = (uint16_t)e;
        }
        if (cx)
            ctx_step(cx, ir, ic, nl, cr, cc);
    }
    return pos;
}

/* decode_lanes with two stages (FORMAT.md 9.4): in each step every lane decodes its first symbol (value; the
 * entry's bits 48-63 name the second-stage table of the symbol), then every lane its second symbol (the low
 * bits) from that table, each sub-step's refills in lane order. cls: lanes bytes of scratch. */
static inline __attribute__((always_inline)) uint64_t decode_lanes2(const uint64_t *tab, const uint64_t *tab2,
                                                                    const uint16_t *stream, uint64_t pos,
                                                                    uint64_t last_word, uint32_t *x, uint16_t *vals,
                                                                    uint8_t *lows, uint8_t *cls, int64_t len,
                                                                    int lanes, const int P, const int CLAMP,
                                                                    const Ctx *cx, int64_t first, int64_t *cnt) {
    const uint32_t mask = (1u << P) - 1;
    int64_t *cr = cnt, *cc = cnt + lanes, ir = 0, ic = 0;
    if (cx) {
        ctx_start(cx, first, lanes, cr, cc);
        ir = lanes % cx->stride, ic = lanes / cx->stride % cx->period;
    }
    for (int64_t base = 0; base < len; base += lanes) {
        int nl = (int)min64(lanes, len - base);
        for (int l = 0; l < nl; l++) {
            uint32_t xl = x[l];
            uint64_t e = cx ? tab[cx->base[cc[l]] + (xl & mask)] : tab[xl & mask];
            xl = ((uint32_t)(e >> 32) & 0xFFFFu) * (xl >> P) + ((uint32_t)e >> 16);
            uint32_t need = xl < STATE_LOW, word = stream[CLAMP && pos > last_word ? last_word : pos];
            xl = xl << (need << 4) | (word & (0u - need));
            pos += need;
            x[l] = xl;
            vals[base + l] = (uint16_t)e;
            cls[l] = (uint8_t)(e >> 48);
        }
        for (int l = 0; l < nl; l++) {
            uint32_t xl = x[l];
            uint64_t e = tab2[((uint32_t)cls[l] << P) + (xl & mask)];
            xl = (uint32_t)(e >> 32) * (xl >> P) + ((uint32_t)e >> 16);
            uint32_t need = xl < STATE_LOW, word = stream[CLAMP && pos > last_word ? last_word : pos];
            xl = xl << (need << 4) | (word & (0u - need));
            pos += need;
            x[l] = xl;
            lows[base + l] = (uint8_t)e;
        }
        if (cx)
            ctx_step(cx, ir, ic, nl, cr, cc);
    }
    return pos;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_LANES_AVX2 1
static pthread_once_t word_bytes_once = PTHREAD_ONCE_INIT;
/* For a mask of the 8 lanes that need a word: a byte shuffle of the next 8 words (in both 128-bit halves) that
 * gives lane l its word (the lanes that need one take them in lane order), or 0 to a lane that needs none. */
static uint8_t word_bytes[256][32];

static void word_bytes_init(void) {
    for (int m = 0; m < 256; m++)
        for (int l = 0; l < 8; l++) {
            int w = __builtin_popcount((unsigned)m & ((1u << l) - 1)), take = m >> l & 1;
            uint8_t *b = word_bytes[m] + 4 * l;
            b[0] = take ? (uint8_t)(2 * w) : 0x80, b[1] = take ? (uint8_t)(2 * w + 1) : 0x80, b[2] = b[3] = 0x80;
        }
}

/* One sub-step of 8 lanes in AVX2: e holds the lanes' 32-bit entries (f - 1 in bits 0-11, slot - c in bits 20-31,
 * p = 12), xs their states; the new states, refilled from the words at stream + pos in lane order (a byte shuffle
 * of the next 8 words, word_bytes, that leaves 0 to the lanes taking none); m: the lanes that took a word. */
#define SUBSTEP_AVX2(e, xs, stream, pos, m)                                                                       \
    do {                                                                                                         \
        __m256i q_ = _mm256_srli_epi32(xs, 12);                                                                  \
        __m256i y_ = _mm256_add_epi32(_mm256_mullo_epi32(_mm256_and_si256(e, slot_mask), q_),                    \
                                      _mm256_add_epi32(q_, _mm256_srli_epi32(e, 20)));                           \
        __m256i need_ = _mm256_cmpeq_epi32(_mm256_srli_epi32(y_, 16), zero);                                       \
        m = _mm256_movemask_ps(_mm256_castsi256_ps(need_));                                                      \
        __m128i eight_ = _mm_loadu_si128((const __m128i *)((stream) + (pos)));                                    \
        __m256i w_ = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(eight_),                                    \
                                         _mm256_loadu_si256((const __m256i *)word_bytes[m]));                    \
        xs = _mm256_or_si256(_mm256_sllv_epi32(y_, _mm256_and_si256(need_, sixteen)), w_);                        \
    } while (0)

/* One block's lanes for the AVX2 lanes: its first-stage table (tabw: f - 1 | class << 12 | (slot - c) << 20), word
 * position, states, and where the slots (of the values, looked up after the lanes) and low bits go. */
typedef struct {
    const uint32_t *tabw;
    uint64_t pos;
    uint32_t *x;
    uint16_t *slots;
    uint8_t *lows;
    int64_t first; /* with a context: the index of the block's first weight in the tensor */
} LanesW;

/* The lanes for 32 lanes and p = 12 in AVX2 (FORMAT.md 9.4), on 32-bit entries, for NB blocks side by side (one
 * block's 32 lanes are 4 chains of gathers and multiplies, too few to keep the core busy: two blocks' steps
 * overlap). A step of a block: the four groups of 8 lanes decode their first symbol (one gather from tabw; the
 * slot is kept, its value looked up after the lanes), then with two stages (TWO) their low bits (one gather from
 * tab2w at class * 4096 + slot: f - 1 | low bits << 12 | (slot - c) << 20), each sub-step's refills in lane
 * order; the step's 32 slots and low bits are stored at once. Steps from t0 while every block has steps left
 * (steps) and a step cannot read past the stream's end; returns the step it stopped at. */
__attribute__((target("avx2,bmi,bmi2,popcnt"))) static inline __attribute__((always_inline)) int64_t
lanes_avx2(const uint32_t *tab2w, const uint16_t *stream, uint64_t words, LanesW *L, int64_t t0, int64_t steps,
           const int NB, const int TWO, const Ctx *cx, const int KIND) {
    pthread_once(&word_bytes_once, word_bytes_init);
    const __m256i slot_mask = _mm256_set1_epi32(4095), zero = _mm256_setzero_si256();
    const __m256i sixteen = _mm256_set1_epi32(16), class_mask = _mm256_set1_epi32(0xFF000);
    const __m256i byte = _mm256_set1_epi32(255);
    __m256i xs[NB][4];
    uint64_t pos[NB];
    /* a context (D and P < 2^31, at most 16 tables: a slot and its table fit 16 bits): each lane's
     * r = i mod D and c = (i / D) mod P, moved on by 32 weights a step as in ctx_step */
    __m256i cr[NB][4], cc[NB][4], ir = zero, ic = zero, dm1 = zero, pm1 = zero, dd = zero, pp = zero;
    int64_t r0[NB], c0[NB]; /* CTX_COLUMN, CTX_ROWS: lane 0's r and c */
    const __m256i lane8 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    if (KIND == CTX_ROWS)
        dm1 = _mm256_set1_epi32((int)cx->stride - 1);
    if (KIND == CTX_COLUMN || KIND == CTX_ROWS)
        for (int k = 0; k < NB; k++) {
            int64_t i = L[k].first + 32 * t0;
            r0[k] = i % cx->stride, c0[k] = i / cx->stride % cx->period;
        }
    if (KIND == CTX_ANY) {
        ir = _mm256_set1_epi32((int)(32 % cx->stride)), ic = _mm256_set1_epi32((int)(32 / cx->stride % cx->period));
        dd = _mm256_set1_epi32((int)cx->stride), pp = _mm256_set1_epi32((int)cx->period);
        dm1 = _mm256_set1_epi32((int)cx->stride - 1), pm1 = _mm256_set1_epi32((int)cx->period - 1);
    }
    for (int k = 0; k < NB; k++) {
        pos[k] = L[k].pos;
        for (int g = 0; g < 4; g++)
            xs[k][g] = _mm256_loadu_si256((const __m256i *)(L[k].x + 8 * g));
        if (KIND == CTX_ANY) {
            int64_t r64[32], c64[32];
            int32_t r32[32], c32[32];
            ctx_start(cx, L[k].first + 32 * t0, 32, r64, c64);
            for (int l = 0; l < 32; l++)
                r32[l] = (int32_t)r64[l], c32[l] = (int32_t)c64[l];
            for (int g = 0; g < 4; g++) {
                cr[k][g] = _mm256_loadu_si256((const __m256i *)(r32 + 8 * g));
                cc[k][g] = _mm256_loadu_si256((const __m256i *)(c32 + 8 * g));
            }
        }
    }
    int64_t t = t0;
    for (; t < steps; t++) {
        int room = 1;
        for (int k = 0; k < NB; k++)
            room &= pos[k] + 32 * (1 + TWO) <= words; /* a step reads at most 32 words per stage */
        if (!room)
            break;
        for (int k = 0; k < NB; k++) {
            __m256i e[4], slot[4];
            for (int g = 0; g < 4; g++) { /* first symbols: the values' slots (with a context: and tables) */
                slot[g] = _mm256_and_si256(xs[k][g], slot_mask);
                if (KIND == CTX_COLUMN) /* lanes 8g ... 8g + 7: contexts c0 + 8g ... (base repeats past P) */
                    slot[g] = _mm256_or_si256(slot[g], _mm256_loadu_si256((const __m256i *)(cx->base + c0[k] + 8 * g)));
                if (KIND == CTX_ROWS) { /* row c0, or the next one for the lanes past its end */
                    int64_t c1 = c0[k] + 1 == cx->period ? 0 : c0[k] + 1;
                    __m256i next = _mm256_cmpgt_epi32(_mm256_add_epi32(lane8, _mm256_set1_epi32((int)(r0[k] + 8 * g))),
                                                      dm1);
                    slot[g] = _mm256_or_si256(slot[g], _mm256_blendv_epi8(_mm256_set1_epi32((int)cx->base[c0[k]]),
                                                                          _mm256_set1_epi32((int)cx->base[c1]), next));
                }
                if (KIND == CTX_ANY) {
                    slot[g] = _mm256_or_si256(slot[g], _mm256_i32gather_epi32((const int *)cx->base, cc[k][g], 4));
                    __m256i r_ = _mm256_add_epi32(cr[k][g], ir);
                    __m256i wrap_ = _mm256_cmpgt_epi32(r_, dm1); /* -1 where r >= D */
                    cr[k][g] = _mm256_sub_epi32(r_, _mm256_and_si256(wrap_, dd));
                    __m256i c_ = _mm256_sub_epi32(_mm256_add_epi32(cc[k][g], ic), wrap_);
                    cc[k][g] = _mm256_sub_epi32(c_, _mm256_and_si256(_mm256_cmpgt_epi32(c_, pm1), pp));
                }
                e[g] = _mm256_i32gather_epi32((const int *)L[k].tabw, slot[g], 4);
            }
            /* 32 slots to 16 bits: packs work in 128-bit halves (g0 g1 g0 g1), the permutes undo that */
            __m256i s01 = _mm256_permute4x64_epi64(_mm256_packus_epi32(slot[0], slot[1]), 0xD8);
            __m256i s23 = _mm256_permute4x64_epi64(_mm256_packus_epi32(slot[2], slot[3]), 0xD8);
            _mm256_storeu_si256((__m256i *)(L[k].slots + 32 * t), s01);
            _mm256_storeu_si256((__m256i *)(L[k].slots + 32 * t + 16), s23);
            if (KIND == CTX_COLUMN) { /* the next step's contexts: 32 on (32 mod P < P: one subtraction) */
                c0[k] += 32 % cx->period;
                c0[k] -= c0[k] >= cx->period ? cx->period : 0;
            }
            if (KIND == CTX_ROWS && (r0[k] += 32) >= cx->stride) /* D >= 32: at most one row on */
                r0[k] -= cx->stride, c0[k] = c0[k] + 1 == cx->period ? 0 : c0[k] + 1;
            for (int g = 0; g < 4; g++) {
                __m256i base2 = _mm256_and_si256(e[g], class_mask); /* class * 4096 */
                int m;
                SUBSTEP_AVX2(e[g], xs[k][g], stream, pos[k], m);
                pos[k] += (uint64_t)__builtin_popcount((unsigned)m);
                e[g] = base2;
            }
            if (!TWO)
                continue;
            for (int g = 0; g < 4; g++) /* second symbols: the low bits */
                e[g] = _mm256_i32gather_epi32((const int *)tab2w,
                                              _mm256_or_si256(e[g], _mm256_and_si256(xs[k][g], slot_mask)), 4);
            for (int g = 0; g < 4; g++) {
                int m;
                SUBSTEP_AVX2(e[g], xs[k][g], stream, pos[k], m);
                pos[k] += (uint64_t)__builtin_popcount((unsigned)m);
                e[g] = _mm256_and_si256(_mm256_srli_epi32(e[g], 12), byte); /* the low bits */
            }
            /* 32 low bits to bytes: the packs give g0 g1 g2 g3 per 32-bit quarter of each half, the permute orders */
            __m256i u = _mm256_packus_epi16(_mm256_packus_epi32(e[0], e[1]), _mm256_packus_epi32(e[2], e[3]));
            u = _mm256_permutevar8x32_epi32(u, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(L[k].lows + 32 * t), u);
        }
    }
    for (int k = 0; k < NB; k++) {
        L[k].pos = pos[k];
        for (int g = 0; g < 4; g++)
            _mm256_storeu_si256((__m256i *)(L[k].x + 8 * g), xs[k][g]);
    }
    return t;
}

/* lanes_avx2 for one block (from step t0) or two (from step 0), one stage or two */
#define LANES_AVX2(name, NB, TWO)                                                                                \
    __attribute__((target("avx2,bmi,bmi2,popcnt"))) static int64_t name(const uint32_t *tab2w,                  \
                                                                         const uint16_t *stream, uint64_t words, \
                                                                         LanesW *L, int64_t t0, int64_t steps) { \
        return lanes_avx2(tab2w, stream, words, L, t0, steps, NB, TWO, NULL, CTX_NONE);                          \
    }                                                                                                            \
    LANES_AVX2_CTX(name##_column, NB, TWO, CTX_COLUMN)                                                           \
    LANES_AVX2_CTX(name##_rows, NB, TWO, CTX_ROWS)                                                               \
    LANES_AVX2_CTX(name##_any, NB, TWO, CTX_ANY)
#define LANES_AVX2_CTX(name, NB, TWO, KIND)                                                                      \
    __attribute__((target("avx2,bmi,bmi2,popcnt"))) static int64_t name(                                        \
        const uint32_t *tab2w, const uint16_t *stream, uint64_t words, LanesW *L, int64_t t0, int64_t steps,     \
        const Ctx *cx) {                                                                                         \
        return lanes_avx2(tab2w, stream, words, L, t0, steps, NB, TWO, cx, KIND);                                \
    }
LANES_AVX2(lanes1_avx2, 1, 0)
LANES_AVX2(lanes1_avx2_pair, 2, 0)
LANES_AVX2(lanes2_avx2, 1, 1)
LANES_AVX2(lanes2_avx2_pair, 2, 1)

/* The AVX2 lanes for one block or two, one stage or two, by block or by context */
static int64_t lanes_wide(const Rans *r, int pair, LanesW *L, int64_t t0, int64_t steps) {
    const uint16_t *stream = r->stream;
    uint64_t words = (uint64_t)r->words;
    typedef int64_t (*CtxLanes)(const uint32_t *, const uint16_t *, uint64_t, LanesW *, int64_t, int64_t,
                                const Ctx *);
    static const CtxLanes by_kind[3][2][2] = { /* [kind - CTX_COLUMN][two stages][pair] */
        {{lanes1_avx2_column, lanes1_avx2_pair_column}, {lanes2_avx2_column, lanes2_avx2_pair_column}},
        {{lanes1_avx2_rows, lanes1_avx2_pair_rows}, {lanes2_avx2_rows, lanes2_avx2_pair_rows}},
        {{lanes1_avx2_any, lanes1_avx2_pair_any}, {lanes2_avx2_any, lanes2_avx2_pair_any}}};
    if (r->ctx.period) {
        int kind = r->ctx.stride == 1 ? CTX_COLUMN : r->ctx.stride >= 32 ? CTX_ROWS : CTX_ANY;
        return by_kind[kind - CTX_COLUMN][r->k > 0][pair](r->dec2w, stream, words, L, t0, steps, &r->ctx);
    }
    return (r->k ? (pair ? lanes2_avx2_pair : lanes2_avx2) : (pair ? lanes1_avx2_pair : lanes1_avx2))(
        r->dec2w, stream, words, L, t0, steps);
}

/* The values of 16 slots from value (a block's table: each slot's value, 32 bits), by two gathers. */
__attribute__((target("avx2,bmi,bmi2"))) static inline __attribute__((always_inline)) __m256i
values16_avx2(const uint32_t *value, const uint16_t *slots) {
    __m256i v0 = _mm256_i32gather_epi32((const int *)value,
                                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)slots)), 4);
    __m256i v1 = _mm256_i32gather_epi32((const int *)value,
                                        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(slots + 8))), 4);
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(v0, v1), 0xD8); /* packs work in 128-bit halves */
}

/* The values of n slots (in place) from value, 16 at a time. */
__attribute__((target("avx2,bmi,bmi2"))) static void values_avx2(uint16_t *vals, const uint32_t *value, int64_t n) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        _mm256_storeu_si256((__m256i *)(vals + j), values16_avx2(value, vals + j));
    }
    for (; j < n; j++)
        vals[j] = (uint16_t)value[vals[j]];
}

/* bf16 from slots (lanes2_avx2's), low bits and 1-bit raw fields (m + k = 7: the sign), 16 weights at a time:
 * the slots' values by two gathers from value (the block's table: each slot's value, 32 bits), escapes resolved
 * in weight order (the next escape field; *esc_io counts them), the sign bits of 2 raw bytes spread over 16
 * lanes by a broadcast and a compare. Returns how many weights it did (whole bytes of raw inside q_end). */
__attribute__((target("avx2,bmi,bmi2"))) static int64_t join1_avx2(const Rans *r, uint16_t *o, const uint16_t *slots,
                                                                const uint32_t *value, const uint8_t *lows,
                                                                const uint8_t *q, const uint8_t *q_end, int64_t len,
                                                                int low, uint64_t *esc_io, uint64_t esc_end) {
    const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                          -32768);
    const __m256i sign = _mm256_set1_epi16(-32768), escape = _mm256_set1_epi16(-1);
    const __m128i shift = _mm_cvtsi32_si128(low);
    uint64_t esc = *esc_io;
    int64_t j = 0;
    for (; j + 16 <= len && q + 2 <= q_end; j += 16, q += 2) {
        __m256i v = values16_avx2(value, slots + j);
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi16(v, escape))) { /* rare: each escape takes the next field */
            uint16_t vs[16];
            _mm256_storeu_si256((__m256i *)vs, v);
            for (int i = 0; i < 16; i++)
                if (vs[i] == ESCAPE) {
                    vs[i] = esc < esc_end && esc < (uint64_t)r->n_escapes
                                ? (uint16_t)field(r->escapes, r->esc_len, (int64_t)esc, 8 + r->m) : 0;
                    esc++;
                }
            v = _mm256_loadu_si256((const __m256i *)vs);
        }
        uint16_t two;
        memcpy(&two, q, 2);
        __m256i s = _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)two), bit), bit),
                                     sign);
        __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(lows + j)));
        _mm256_storeu_si256((__m256i *)(o + j), _mm256_or_si256(s, _mm256_or_si256(_mm256_sll_epi16(v, shift), u)));
    }
    *esc_io = esc;
    return j;
}

/* The escapes of a block in weight order (FORMAT.md 9.4): each escape symbol's value becomes the next
 * escape field; 16 values are checked at once. Returns the escape count after the block. */
__attribute__((target("avx2,bmi,bmi2,popcnt"))) static uint64_t escapes_avx2(const Rans *r, uint16_t *vals,
                                                                          int64_t len, uint64_t esc,
                                                                          uint64_t esc_end) {
    const __m256i escape = _mm256_set1_epi16(-1);
    for (int64_t j = 0; j < len; j += 16) {
        unsigned m = 0xFFFFFFFFu;
        if (j + 16 <= len)
            m = (unsigned)_mm256_movemask_epi8(
                _mm256_cmpeq_epi16(_mm256_loadu_si256((const __m256i *)(vals + j)), escape));
        for (int64_t k = j; m && k < j + 16 && k < len; k++, m >>= 2)
            if (vals[k] == ESCAPE) {
                vals[k] = esc < esc_end && esc < (uint64_t)r->n_escapes
                              ? (uint16_t)field(r->escapes, r->esc_len, (int64_t)esc, 8 + r->m) : 0;
                esc++;
            }
    }
    return esc;
}

/* bf16 from values (escapes resolved) and raw fields of 6 bits (m = 2), 8 weights at a time: the 6 bytes
 * of 8 fields spread over 8 lanes by one byte shuffle and one shift per lane. q: the raw byte of
 * weight 0 (a multiple of 4); stops 8 bytes before q_end. Returns how many weights it did. */
__attribute__((target("avx2,bmi,bmi2"))) static int64_t join6_avx2(uint16_t *o, const uint16_t *vals,
                                                                const uint8_t *q, const uint8_t *q_end,
                                                                int64_t len) {
    const __m256i bytes = _mm256_setr_epi8(0, 1, -1, -1, 0, 1, -1, -1, 1, 2, -1, -1, 2, 3, -1, -1,
                                           3, 4, -1, -1, 3, 4, -1, -1, 4, 5, -1, -1, 5, 6, -1, -1);
    const __m256i shift = _mm256_setr_epi32(0, 6, 4, 2, 0, 6, 4, 2), six = _mm256_set1_epi32(63);
    const __m256i sign = _mm256_set1_epi32(32), low = _mm256_set1_epi32(31);
    int64_t j = 0;
    for (; j + 8 <= len && q + 8 <= q_end; j += 8, q += 6) {
        uint64_t eight;
        memcpy(&eight, q, 8);
        __m256i raw = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)eight), bytes);
        raw = _mm256_and_si256(_mm256_srlv_epi32(raw, shift), six);
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(vals + j)));
        __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(raw, sign), 10),
                                       _mm256_or_si256(_mm256_slli_epi32(v, 5), _mm256_and_si256(raw, low)));
        _mm_storeu_si128((__m128i *)(o + j), _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                                              _mm256_extracti128_si256(bits, 1)));
    }
    return j;
}

/* bf16 from values (escapes resolved), raw fields of w = 8 - m - k bits (sign, then q = w - 1 mantissa bits; the
 * 8 fields of 8 weights lie in w bytes) and, with k > 0, low bits, 8 weights at a time: the w bytes broadcast,
 * each lane's two bytes picked by one byte shuffle and shifted into place (any w: the shuffle and shifts are built
 * for it). q: the raw byte of weight 0 (a multiple of 8 weights); stops 8 bytes before q_end. Returns how many
 * weights it did. */
__attribute__((target("avx2,bmi,bmi2"))) static int64_t join8_avx2(uint16_t *o, const uint16_t *vals,
                                                                const uint8_t *lows, const uint8_t *q,
                                                                const uint8_t *q_end, int64_t len, int m, int k) {
    const int w = 8 - m - k, qb = w - 1, low = 7 - m;
    int8_t pick[32];
    int32_t shift[8];
    for (int i = 0; i < 8; i++) {
        int b = w * i >> 3;
        shift[i] = w * i & 7;
        for (int h = 0; h < 2; h++) { /* both 128-bit halves hold the same 8 bytes */
            int8_t *c = pick + 16 * h + 4 * (i & 3);
            if ((i >> 2) != h)
                continue;
            c[0] = (int8_t)b, c[1] = b + 1 < 8 ? (int8_t)(b + 1) : (int8_t)-128, c[2] = c[3] = -128;
        }
    }
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)pick);
    const __m256i shifts = _mm256_loadu_si256((const __m256i *)shift), fmask = _mm256_set1_epi32((1 << w) - 1);
    const __m256i qmask = _mm256_set1_epi32((1 << qb) - 1);
    const __m128i qcount = _mm_cvtsi32_si128(qb), lowcount = _mm_cvtsi32_si128(low), signcount = _mm_cvtsi32_si128(15 - qb);
    int64_t j = 0;
    for (; j + 8 <= len && q + 8 <= q_end; j += 8, q += w) {
        uint64_t eight;
        memcpy(&eight, q, 8);
        __m256i raw = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)eight), bytes);
        raw = _mm256_and_si256(_mm256_srlv_epi32(raw, shifts), fmask);
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(vals + j)));
        __m256i sign = _mm256_sll_epi32(_mm256_andnot_si256(qmask, raw), signcount); /* bit q -> bit 15 */
        __m256i bits = _mm256_or_si256(sign, _mm256_or_si256(_mm256_sll_epi32(v, lowcount), _mm256_and_si256(raw, qmask)));
        if (k) {
            __m128i u8 = _mm_loadl_epi64((const __m128i *)(lows + j));
            bits = _mm256_or_si256(bits, _mm256_sll_epi32(_mm256_cvtepu8_epi32(u8), qcount));
        }
        _mm_storeu_si128((__m128i *)(o + j), _mm_packus_epi32(_mm256_castsi256_si128(bits),
                                                              _mm256_extracti128_si256(bits, 1)));
    }
    return j;
}
#endif

/* bf16 of weights j, j + 8, ... of a block whose first weight start is a multiple of 8, 8 at a time: the 8 raw
 * fields of w = 8 - m - k bits (sign, then q = 7 - m - k mantissa bits) lie in w whole bytes, read with one
 * 64-bit load; values (escapes resolved in weight order) and, with k > 0, low bits. Stops where a load would pass
 * the raw array's end; returns the weights done. */
static inline __attribute__((always_inline)) int64_t join8(const Rans *r, uint16_t *o, uint16_t *vals,
                                                           const uint8_t *lows, int k, int64_t j, int64_t len,
                                                           int64_t start, uint64_t *esc_io, uint64_t esc_end) {
    const int w = 8 - r->m - k, q = 7 - r->m - k, low = 7 - r->m, w_esc = 8 + r->m;
    const uint64_t fmask = (1u << w) - 1, qmask = (1u << q) - 1;
    uint64_t esc = *esc_io;
    if ((start + j) % 8)
        return j;
    for (; j + 8 <= len && (start + j) / 8 * w + 8 <= r->raw_len; j += 8) {
        uint64_t eight;
        memcpy(&eight, r->raw + (start + j) / 8 * w, 8);
        for (int i = 0; i < 8; i++) {
            uint32_t v = vals[j + i], raw = (uint32_t)(eight >> (w * i) & fmask);
            if (v == ESCAPE) {
                v = esc < esc_end && esc < (uint64_t)r->n_escapes ? field(r->escapes, r->esc_len, (int64_t)esc, w_esc)
                                                                   : 0;
                esc++;
            }
            uint32_t u = k ? (uint32_t)lows[j + i] << q : 0;
            o[j + i] = (uint16_t)((raw >> q) << 15 | v << low | u | (raw & qmask));
        }
    }
    *esc_io = esc;
    return j;
}

/* Block b's lanes at their start: states into x; returns its first word's position. */
static inline __attribute__((always_inline)) uint64_t block_start(const Rans *r, int64_t b, uint32_t *x) {
    memcpy(x, r->states + b * r->lanes, sizeof(uint32_t) * (size_t)r->lanes);
    return r->block_words[b];
}

/* Whether blocks go through the AVX2 lanes (32 lanes, p = 12, the AVX2 build: the 32-bit tables were built; with a
 * context, D and P < 2^31 and at most 16 tables). */
static inline __attribute__((always_inline)) int wide(const Rans *r) {
    return use_wide && r->decw != NULL
           && (!r->ctx.period || (r->n_tables <= 16 && r->ctx.stride < INT32_MAX && r->ctx.period < INT32_MAX));
}

/* Block b's first-stage table (by block; 0 with a context, whose tables are looked up per weight). */
static inline __attribute__((always_inline)) int64_t block_table(const Rans *r, int64_t b) {
    return r->ctx.period ? 0 : (int64_t)min64(r->block_table[b], r->n_tables - 1);
}

/* Decode block b (see the top of this file). x: its lanes' states and pos its word position after `done`
 * weights (0, or whole steps a pair of the AVX2 lanes decoded into vals, as slots, and lows). */
static inline __attribute__((always_inline)) void decode_block(const Rans *r, int64_t b, uint16_t *vals,
                                                               uint8_t *lows, uint8_t *cls, int64_t *cnt, uint32_t *x,
                                                               int64_t done, uint64_t pos) {
    Block *job = &r->blocks[b];
    const int lanes = r->lanes, low = 7 - r->m, w_raw = 8 - r->m - r->k, w_esc = 8 + r->m;
    int64_t start = b * r->block_size, len = min64(r->block_size, r->n - start);
    job->crc_raw = crc_piece(r->raw, r->raw_len, b, r->n_blocks, &job->raw_bytes);
    job->crc_stream = crc_piece((const uint8_t *)r->stream, 2 * r->words, b, r->n_blocks, &job->stream_bytes);
    job->crc_esc = crc_piece(r->escapes, r->esc_len, b, r->n_blocks, &job->esc_bytes);
    const uint64_t *tab = r->dec + (block_table(r, b) << r->p);
    const Ctx *cx = r->ctx.period ? &r->ctx : NULL;
    static const uint16_t no_word = 0;
    const uint16_t *stream = r->words ? r->stream : &no_word;
    const uint64_t last_word = r->words ? (uint64_t)r->words - 1 : 0;
    int64_t slots = 0; /* with the AVX2 lanes: vals[0 .. slots) holds slots (their values: value) */
    const uint32_t *value = NULL;
#ifdef HAVE_LANES_AVX2
    if (wide(r)) { /* the whole steps the pair left */
        int64_t table = block_table(r, b) << 12;
        LanesW L = {r->decw + table, pos, x, vals, lows, start};
        slots = done = 32 * lanes_wide(r, 0, &L, done / 32, len / 32);
        pos = L.pos;
        value = r->valw + table;
        __atomic_or_fetch(&lanes_taken, r->k ? 2 : 1, __ATOMIC_RELAXED);
    }
#endif
    if (r->k) { /* two stages: two words per weight at most */
        const uint64_t *tab2 = r->dec2;
        int64_t rest = len - done;
        int64_t first = start + done;
        if (rest && cx)
            pos = decode_lanes2(r->dec, tab2, stream, pos, last_word, x, vals + done, lows + done, cls, rest, lanes, r->p,
                                1, cx, first, cnt);
        else if (rest && r->p == 12 && pos + 2 * (uint64_t)rest <= (uint64_t)r->words)
            pos = decode_lanes2(tab, tab2, stream, pos, last_word, x, vals + done, lows + done, cls, rest, lanes, 12, 0,
                                NULL, 0, cnt);
        else if (rest && r->p == 12)
            pos = decode_lanes2(tab, tab2, stream, pos, last_word, x, vals + done, lows + done, cls, rest, lanes, 12, 1,
                                NULL, 0, cnt);
        else if (rest)
            pos = decode_lanes2(tab, tab2, stream, pos, last_word, x, vals + done, lows + done, cls, rest, lanes, r->p, 1,
                                NULL, 0, cnt);
        done = len;
    }
    int safe = pos + (uint64_t)(len - done) <= (uint64_t)r->words; /* a word per weight at most: no read past the end */
    if (done == len)
        ;
    else if (cx)
        pos = decode_lanes(r->dec, stream, pos, last_word, x, vals + done, len - done, lanes, r->p, 1, cx, start + done,
                           cnt);
    else if (r->p == 12 && safe)
        pos = decode_lanes(tab, stream, pos, last_word, x, vals + done, len - done, lanes, 12, 0, NULL, 0, cnt);
    else if (r->p == 12)
        pos = decode_lanes(tab, stream, pos, last_word, x, vals + done, len - done, lanes, 12, 1, NULL, 0, cnt);
    else
        pos = decode_lanes(tab, stream, pos, last_word, x, vals + done, len - done, lanes, r->p, 1, NULL, 0, cnt);
    int lanes_home = 1;
    for (int l = 0; l < lanes; l++)
        lanes_home &= x[l] == STATE_LOW;
    if (pos != r->block_words[b + 1] || !lanes_home) {
        job->error = BAD_WORDS;
        return;
    }
    /* escapes (in weight order: each escape symbol takes the next escape field) and bf16, in one pass */
    uint64_t esc = r->block_escapes[b], esc_end = r->block_escapes[b + 1];
    uint16_t *restrict o = r->out + start;
    int64_t j = 0;
    if (r->k) { /* two stages: bf16 = sign | value << (7 - m) | low << q | q raw bits */
        const int q = 7 - r->m - r->k;
#ifdef HAVE_LANES_AVX2
        if (slots && w_raw == 1 && start % 8 == 0) /* the slots' values, escapes and bf16 in one pass */
            j = join1_avx2(r, o, vals, value, lows, r->raw + start / 8, r->raw + r->raw_len, slots, low, &esc, esc_end);
        if (j < slots) /* the slots' values where join1_avx2 did not take them */
            values_avx2(vals + j, value, slots - j);
        if (use_wide && w_raw > 1 && start % 8 == 0) { /* escapes first, then 8 weights at a time */
            esc = escapes_avx2(r, vals, len, esc, esc_end);
            j = join8_avx2(o, vals, lows, r->raw + start / 8 * w_raw, r->raw + r->raw_len, len, r->m, r->k);
        }
#endif
        if (w_raw > 1 && start % 8 == 0) /* raw bits besides the sign: 8 raw fields in w bytes, one 64-bit load */
            j = join8(r, o, vals, lows, r->k, j, len, start, &esc, esc_end);
        if (w_raw == 1 && start % 8 == 0) /* m + k = 7 (what the encoder picks): the signs, 8 to a raw byte */
            for (const uint8_t *s = r->raw + (start + j) / 8; j + 8 <= len && s < r->raw + r->raw_len; j += 8, s++)
                for (int i = 0; i < 8; i++) {
                    uint32_t v = vals[j + i];
                    if (v == ESCAPE) {
                        v = esc < esc_end && esc < (uint64_t)r->n_escapes
                                ? field(r->escapes, r->esc_len, (int64_t)esc, w_esc) : 0;
                        esc++;
                    }
                    o[j + i] = (uint16_t)((uint32_t)(*s >> i & 1) << 15 | v << low | lows[j + i]);
                }
        for (; j < len; j++) { /* any m and k (and the last few weights of the case above) */
            uint32_t v = vals[j], raw = field(r->raw, r->raw_len, start + j, w_raw);
            if (v == ESCAPE) {
                v = esc < esc_end && esc < (uint64_t)r->n_escapes ? field(r->escapes, r->esc_len, (int64_t)esc, w_esc)
                                                                   : 0;
                esc++;
            }
            o[j] = (uint16_t)((raw >> q) << 15 | v << low | (uint32_t)lows[j] << q | (raw & ((1u << q) - 1)));
        }
    }
#ifdef HAVE_LANES_AVX2
    if (slots && !r->k) /* the slots' values */
        values_avx2(vals, value, slots);
    if (use_wide && w_raw == 6 && start % 4 == 0 && !r->k) { /* escapes first, then 8 weights at a time */
        esc = escapes_avx2(r, vals, len, esc, esc_end);
        j = join6_avx2(o, vals, r->raw + start / 4 * 3, r->raw + r->raw_len, len);
    } else if (use_wide && start % 8 == 0 && !r->k) { /* any other m: the same, by join8_avx2 */
        esc = escapes_avx2(r, vals, len, esc, esc_end);
        j = join8_avx2(o, vals, NULL, r->raw + start / 8 * w_raw, r->raw + r->raw_len, len, r->m, 0);
    }
#endif
    if (w_raw == 6 && start % 4 == 0 && !r->k) /* m = 2 (the default): 4 raw fields in every 3 bytes */
        for (const uint8_t *q = r->raw + (start + j) / 4 * 3; j + 4 <= len && q + 4 <= r->raw + r->raw_len; j += 4, q += 3) {
            uint32_t four;
            memcpy(&four, q, 4);
            for (int k = 0; k < 4; k++) {
                uint32_t v = vals[j + k], raw = (four >> (6 * k)) & 63;
                if (v == ESCAPE) {
                    v = esc < esc_end && esc < (uint64_t)r->n_escapes ? field(r->escapes, r->esc_len, (int64_t)esc,
                                                                               w_esc) : 0;
                    esc++;
                }
                o[j + k] = (uint16_t)((raw >> 5) << 15 | v << 5 | (raw & 31));
            }
        }
    if (!r->k && start % 8 == 0) /* any m: 8 raw fields of w bits in every w bytes, one 64-bit load */
        j = join8(r, o, vals, NULL, 0, j, len, start, &esc, esc_end);
    for (; j < len; j++) { /* any m (and the last few weights of the specialised cases) */
        uint32_t v = vals[j], raw = field(r->raw, r->raw_len, start + j, w_raw);
        if (v == ESCAPE) {
            v = esc < esc_end && esc < (uint64_t)r->n_escapes ? field(r->escapes, r->esc_len, (int64_t)esc, w_esc) : 0;
            esc++;
        }
        o[j] = (uint16_t)((raw >> low) << 15 | v << low | (raw & ((1u << low) - 1)));
    }
    if (esc != esc_end) {
        job->error = BAD_ESCAPES;
        return;
    }
    job->crc_out = ~crc_update(~0u, (const uint8_t *)o, (size_t)(2 * len));
}

/* A thread: take the next block until none is left (two at a time through the AVX2 lanes). */
static inline __attribute__((always_inline)) void *work_body(void *arg) {
    Rans *r = arg;
    size_t most = (size_t)min64(r->block_size, r->n > 0 ? r->n : 1);
    uint16_t *vals = malloc(2 * sizeof(uint16_t) * most);
    uint8_t *lows = malloc(r->k ? 2 * most : 1), *cls = malloc((size_t)r->lanes);
    uint32_t *x = malloc(2 * sizeof(uint32_t) * (size_t)r->lanes);
    int64_t *cnt = malloc(2 * sizeof(int64_t) * (size_t)r->lanes);
    int64_t b;
    while (1) {
        int pair = 0;
#ifdef HAVE_LANES_AVX2
        pair = wide(r);
#endif
        if ((b = __atomic_fetch_add(&r->next_block, 1 + pair, __ATOMIC_RELAXED)) >= r->n_blocks)
            break;
        if (!(vals && lows && cls && x && cnt)) {
            for (int64_t c = b; c <= b + pair && c < r->n_blocks; c++)
                r->blocks[c].error = NO_MEMORY;
            continue;
        }
        uint64_t pos = block_start(r, b, x);
        if (!pair || b + 1 == r->n_blocks) {
            decode_block(r, b, vals, lows, cls, cnt, x, 0, pos);
            continue;
        }
#ifdef HAVE_LANES_AVX2
        /* two blocks: their common whole steps side by side, then each on its own */
        int64_t steps = min64(r->block_size, r->n - (b + 1) * r->block_size) / 32;
        uint8_t *lows1 = r->k ? lows + most : lows; /* (one stage: no low bits) */
        LanesW L[2] = {{r->decw + (block_table(r, b) << 12), pos, x, vals, lows, b * r->block_size},
                       {r->decw + (block_table(r, b + 1) << 12), block_start(r, b + 1, x + 32), x + 32, vals + most,
                        lows1, (b + 1) * r->block_size}};
        int64_t done = 32 * lanes_wide(r, 1, L, 0, steps);
        decode_block(r, b, vals, lows, cls, cnt, x, done, L[0].pos);
        decode_block(r, b + 1, vals + most, lows1, cls, cnt, x + 32, done, L[1].pos);
#endif
    }
    free(vals);
    free(lows);
    free(cls);
    free(x);
    free(cnt);
    return NULL;
}

TWO_BUILDS(work, work_body) /* builds.h: any CPU, or AVX2 + BMI2 */

/* Use the AVX2 + BMI2 build if wide (and the CPU has it); returns 1 if it is in use. For the tests. */
int unw_rans_use(int wide) { return builds_use(wide); }

/* Which AVX2 lanes decoded blocks since the last call (bit 0: one stage, bit 1: two stages), and forget. For the
 * tests (that two-stage tensors take the AVX2 lanes where the cap allows). */
int unw_rans_lanes_taken(void) { return __atomic_exchange_n(&lanes_taken, 0, __ATOMIC_RELAXED); }

/* Cap the paths at instruction set isa (builds.h's ISA_*: UNFIRE_CPU_ISA, set by decode_rans_c.py when it
 * loads the library): the AVX2 lanes (the AVX2 + BMI2 build) from avx2 on, the CRC as crc_isa. Returns the
 * paths in use: bit 0 the AVX2 + BMI2 build, bits 2-3 the CRC level (as unw_isa of decode.c). */
int unw_rans_isa(int isa) { return builds_isa(isa) | crc_isa(isa) << 2; }

/* The decoding table of each frequency table: entry k * M + slot = class << 48 | f[s] << 32 | (slot - c[s]) << 16
 * | value of the symbol s owning the slot (value: ESCAPE for s == A, or the symbol itself when alphabet is NULL;
 * class: its second-stage table, symbol_class[s] clamped below n_classes, or 0 without symbol_class). Rows summing
 * to more than M are cut at M; slots of rows summing to less stay 0 (Python has refused both already). */
static void build_tables(uint64_t *dec, const uint16_t *tables, const uint16_t *alphabet, int a, int k, int p,
                         const uint8_t *symbol_class, int n_classes) {
    int64_t m = (int64_t)1 << p;
    for (int t = 0; t < k; t++) {
        int64_t slot = 0;
        for (int s = 0; s <= a && slot < m; s++) {
            uint64_t f = tables[(int64_t)t * (a + 1) + s], value = !alphabet ? (uint64_t)s : s < a ? alphabet[s] : ESCAPE;
            uint64_t cls = symbol_class ? (uint64_t)(symbol_class[s] < n_classes ? symbol_class[s] : n_classes - 1) : 0;
            for (uint64_t i = 0; i < f && slot < m; i++, slot++)
                dec[t * m + slot] = cls << 48 | f << 32 | i << 16 | value;
        }
    }
}

/* Decode a checked rANS-form tensor (see the top of this file) into out (uint16 [n]). crc_io[0..3]: the
 * expected CRC-32 of raw, stream, escapes and the data. Returns OK or an error code, with crc_io[4] the
 * block (or, for BAD_CRC, which of the four) and crc_io[5] a detail. */
int unw_rans_decode(const uint8_t *raw, int64_t raw_len, const uint16_t *alphabet, int alphabet_size,
                    const uint16_t *tables, int n_tables, const uint16_t *stream, int64_t words,
                    const uint32_t *block_words, const uint32_t *states, const uint8_t *block_table,
                    const uint8_t *escapes, int64_t esc_len, const uint32_t *block_escapes, int64_t n_escapes,
                    int64_t n, int64_t block_size, int lanes, int prob_bits, int mantissa_bits, int low_bits,
                    const uint8_t *symbol_class, const uint16_t *low_freqs, int low_tables,
                    const uint8_t *context_table, int64_t context_stride, int64_t context_period, int threads,
                    uint32_t *crc_io, uint16_t *out) {
    Rans r;
    crc_setup();
    builds_setup();
    memset(&r, 0, sizeof r);
    r.raw = raw, r.raw_len = raw_len, r.stream = stream, r.words = words, r.block_words = block_words;
    r.states = states, r.block_table = block_table, r.escapes = escapes, r.esc_len = esc_len;
    r.block_escapes = block_escapes, r.n_escapes = n_escapes, r.n = n, r.block_size = block_size;
    r.lanes = lanes, r.p = prob_bits, r.m = mantissa_bits, r.k = low_bits, r.n_tables = n_tables, r.out = out;
    r.n_blocks = n > 0 ? (n + block_size - 1) / block_size : 0;
    if (r.n_blocks == 0) { /* nothing coded: only the CRCs of the (empty) arrays and data are left */
        uint32_t got[4] = {~crc_update(~0u, raw, (size_t)raw_len), ~crc_update(~0u, (const uint8_t *)stream,
                           (size_t)(2 * words)), ~crc_update(~0u, escapes, (size_t)esc_len), 0};
        for (int a = 0; a < 4; a++)
            if (got[a] != crc_io[a]) {
                crc_io[4] = (uint32_t)a;
                return BAD_CRC;
            }
        return OK;
    }
    uint64_t *dec = calloc((size_t)(n_tables > 0 ? n_tables : 1) << prob_bits, sizeof(uint64_t));
    /* two stages: at least one (zero) second-stage table, so that a class never points outside */
    size_t n_dec2 = (size_t)(low_tables > 0 ? low_tables : 1) << prob_bits;
    size_t n_dec = (size_t)(n_tables > 0 ? n_tables : 1) << prob_bits;
    uint64_t *dec2 = low_bits ? calloc(n_dec2, sizeof(uint64_t)) : NULL;
    /* the AVX2 lanes' 32-bit tables (f - 1 and slot - c take 12 bits each at p = 12, the class or low bits 8) */
    int wide_tables = prob_bits == 12 && lanes == 32 && use_wide;
    uint32_t *decw = wide_tables ? malloc(n_dec * sizeof(uint32_t)) : NULL;
    uint32_t *dec2w = wide_tables && low_bits ? malloc(n_dec2 * sizeof(uint32_t)) : NULL;
    uint32_t *valw = wide_tables ? malloc(n_dec * sizeof(uint32_t)) : NULL;
    Block *blocks = calloc((size_t)r.n_blocks, sizeof(Block));
    /* by context: where each context's table starts (table << p; tables past the last read the last) */
    uint32_t *ctx_base = context_period > 0 ? malloc((size_t)(context_period + 32) * sizeof(uint32_t)) : NULL;
    if (!dec || !blocks || (low_bits && !dec2) || (wide_tables && (!decw || !valw || (low_bits && !dec2w)))
        || (context_period > 0 && !ctx_base)) {
        free(ctx_base);
        free(dec);
        free(dec2);
        free(decw);
        free(dec2w);
        free(valw);
        free(blocks);
        return NO_MEMORY;
    }
    build_tables(dec, tables, alphabet, alphabet_size, n_tables, prob_bits, low_bits ? symbol_class : NULL,
                 low_tables > 0 ? low_tables : 1);
    if (low_bits)
        build_tables(dec2, low_freqs, NULL, (1 << low_bits) - 1, low_tables, prob_bits, NULL, 1);
    for (size_t i = 0; wide_tables && i < n_dec; i++) { /* f <= M after build_tables' cut; a slot left 0 reads f = 1 */
        decw[i] = (uint32_t)((dec[i] >> 32) - 1) & 0xFFF | (uint32_t)(dec[i] >> 48) << 12
                  | (uint32_t)(dec[i] >> 16 & 0xFFF) << 20;
        valw[i] = (uint16_t)dec[i];
    }
    for (size_t i = 0; wide_tables && low_bits && i < n_dec2; i++)
        dec2w[i] = (uint32_t)((dec2[i] >> 32) - 1) & 0xFFF | (uint32_t)(dec2[i] & 0xFF) << 12
                   | (uint32_t)(dec2[i] >> 16 & 0xFFF) << 20;
    r.dec = dec, r.dec2 = dec2, r.decw = decw, r.dec2w = dec2w, r.valw = valw, r.blocks = blocks;
    r.n_tables = n_tables > 0 ? n_tables : 1;
    for (int64_t c = 0; c < context_period; c++)
        ctx_base[c] = (uint32_t)min64(context_table[c], r.n_tables - 1) << prob_bits;
    for (int64_t c = context_period; c > 0 && c < context_period + 32; c++) /* repeating: see Ctx */
        ctx_base[c] = ctx_base[c % context_period];
    r.ctx.base = ctx_base, r.ctx.stride = context_stride > 0 ? context_stride : 1, r.ctx.period = context_period;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    run_threads(work, &r, 0, (int)min64(threads, r.n_blocks));
    int error = OK;
    for (int64_t b = 0; b < r.n_blocks && !error; b++)
        if ((error = blocks[b].error)) {
            crc_io[4] = (uint32_t)b;
            crc_io[5] = (uint32_t)blocks[b].detail;
        }
    /* The arrays' CRCs first (a damaged array is named even when it also broke the decoding), then
     * the block's error, then the data's CRC. */
    uint32_t got[4] = {blocks[0].crc_raw, blocks[0].crc_stream, blocks[0].crc_esc, blocks[0].crc_out};
    CrcShift shift[4] = {{-1, 0}, {-1, 0}, {-1, 0}, {-1, 0}};
    for (int64_t b = 1; b < r.n_blocks; b++) {
        got[0] = crc_join(got[0], blocks[b].crc_raw, blocks[b].raw_bytes, &shift[0]);
        got[1] = crc_join(got[1], blocks[b].crc_stream, blocks[b].stream_bytes, &shift[1]);
        got[2] = crc_join(got[2], blocks[b].crc_esc, blocks[b].esc_bytes, &shift[2]);
        if (!error)
            got[3] = crc_join(got[3], blocks[b].crc_out, 2 * min64(block_size, n - b * block_size), &shift[3]);
    }
    free(dec);
    free(dec2);
    free(decw);
    free(dec2w);
    free(valw);
    free(blocks);
    free(ctx_base);
    if (error == NO_MEMORY)
        return error;
    for (int a = 0; a < 3; a++)
        if (got[a] != crc_io[a]) {
            crc_io[4] = (uint32_t)a;
            return BAD_CRC;
        }
    if (error)
        return error;
    for (int a = 3; a < 4; a++)
        if (got[a] != crc_io[a]) {
            crc_io[4] = (uint32_t)a;
            return BAD_CRC;
        }
    return OK;
}
