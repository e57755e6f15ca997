/* The rANS-mode decoder for the CPU, in C (FORMAT.md section 9): rANS form -> bf16.
 *
 * fast/codec/decode_rans_c.py builds this file with the system C compiler on first use (as decode.c),
 * loads it with ctypes and calls unw_rans_isa once (UNFIRE_CPU_ISA's cap), unw_rans_decode (and, in the tests,
 * unw_rans_use). Python checks first the header (RansTensor.check_header: parameters, every array's dtype and
 * length) and the padding of the last packed group. This file does the rest of FORMAT.md 9.6: first what is cheap
 * and small (the CRC-32 of the small arrays; unw_rans_check, RansTensor.check_index's checks: alphabet, tables
 * summing to M, block_table < K, block_words and block_escapes rising from 0 to W and E, escapes per block,
 * states >= 2^16), then the CRC-32 of raw, stream and escapes (computed by the
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
 * With AVX-512 (F, BW, VL, DQ, VBMI; UNFIRE_CPU_ISA avx512 or amx) the AVX-512 lanes take the AVX2 lanes' place
 * (see lanes_avx512): 16 lanes a vector, four blocks side by side, the refills by one expand, each value looked up
 * in registers when the tensor has at most 256 symbols (its table entries then hold the symbol), and bf16 written
 * by the lanes themselves (no pass over values and raw bits after them). The tables are built straight in their
 * 32-bit form, the portable C after the wide lanes reads them too (decode_lanes_w), and every buffer is kept
 * between calls (scratch.h). Same machine, the sum over a model's tensors of decode_rans_cpu (best of 3 each),
 * UNFIRE_CPU_ISA=avx2 (the AVX2 lanes) against the AVX-512 lanes, in one run: SmolLM2 2.05 -> 1.79 ns per weight,
 * Whisper tiny.en 1.69 -> 1.27, MiniLM 1.39 -> 1.12; the steps then taken phase by phase across the blocks (see
 * lanes_avx512), the sum of decode_rans_cpu (best of 3) in one run: SmolLM2 1.99 -> 1.38 ns per weight, Whisper
 * 1.36 -> 1.33, MiniLM 1.06 -> 1.09.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "builds.h"
#include "crc32.h"
#include "scratch.h"
#include "threads.h"

#define ESCAPE 0xFFFFu /* the value an escape symbol's entry holds (alphabet values are < 2^15) */
#define STATE_LOW 65536u

enum { OK, BAD_WORDS, BAD_ESCAPES, BAD_CRC, NO_MEMORY, BAD_INDEX };

static int lanes_taken; /* the lanes that ran since unw_rans_lanes_taken last asked: AVX2 1 one stage, 2 two;
                         * AVX-512 4 one stage, 8 two */
/* the AVX-512 lanes: the CPU has AVX-512 F, BW, VL, DQ and VBMI; UNFIRE_CPU_ISA allows them (avx512 on); in use (that, the
 * AVX2 build in use, and not switched off by unw_rans_use512) */
static int avx512_cpu, avx512_cap = 1, avx512_on = 1;

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

/* The wide lanes' contexts at the weight `first` (32 lanes a step): lane 0's r and c (CTX_COLUMN, CTX_ROWS) ... */
static inline __attribute__((always_inline)) void ctx_lane0(const Ctx *cx, int64_t first, int64_t *r0, int64_t *c0) {
    *r0 = first % cx->stride, *c0 = first / cx->stride % cx->period;
}

/* ... and every lane's, as 32-bit r and c (CTX_ANY: D and P < 2^31). */
static inline __attribute__((always_inline)) void ctx_lanes32(const Ctx *cx, int64_t first, int32_t *r32,
                                                              int32_t *c32) {
    int64_t r64[32], c64[32];
    ctx_start(cx, first, 32, r64, c64);
    for (int l = 0; l < 32; l++)
        r32[l] = (int32_t)r64[l], c32[l] = (int32_t)c64[l];
}

/* Whether each of the nb blocks' next step of the wide lanes reads inside the stream (at most 32 words a stage). */
static inline __attribute__((always_inline)) int room_for_step(const uint64_t *pos, int nb, int two, uint64_t words) {
    int room = 1;
    for (int k = 0; k < nb; k++)
        room &= pos[k] + 32 * (1 + two) <= words;
    return room;
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
    int l512, bf16; /* the AVX-512 lanes decode the blocks' whole steps; they write bf16 (m + k = 7) */
    const uint16_t *sym; /* with the AVX-512 lanes and at most 64 symbols (or 256, one stage): each symbol's value
                          * [256] and class << 4 [64] (decw then holds symbols, not classes); else NULL */
    int sym_level;       /* lanes512_fns' first index: 0 no sym, 1 at most 64 symbols, 2 at most 256 */
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

/* The value of the escape taken as number esc of a block whose escapes end before esc_end (FORMAT.md 9.4): the
 * next escape field, or 0 past the block's or the array's escapes (damaged input, reported by the count after). */
static inline __attribute__((always_inline)) uint32_t escape_value(const Rans *r, uint64_t esc, uint64_t esc_end) {
    return esc < esc_end && esc < (uint64_t)r->n_escapes ? field(r->escapes, r->esc_len, (int64_t)esc, 8 + r->m) : 0;
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

/* decode_lanes (and decode_lanes2, with two stages) on the wide lanes' 32-bit tables (p = 12, 32 lanes: see
 * build_wide), in portable C, every read clamped: what the wide lanes leave of a block (its last partial step, the
 * steps near the stream's end). tabw: the block's table (by context: all of them), valw its values (or the
 * symbols' values and classes, r->sym); vals and lows from the block's weight `first - block start` on. */
static uint64_t decode_lanes_w(const Rans *r, const uint32_t *tabw, const uint32_t *valw, const uint16_t *stream,
                               uint64_t pos, uint64_t last_word, uint32_t *x, uint16_t *vals, uint8_t *lows,
                               uint8_t *cls, int64_t len, const Ctx *cx, int64_t first, int64_t *cnt) {
    const int lanes = 32;
    const uint16_t *sym = r->sym;
    int64_t *cr = cnt, *cc = cnt + lanes, ir = 0, ic = 0;
    if (cx) {
        ctx_start(cx, first, lanes, cr, cc);
        ir = lanes % cx->stride, ic = lanes / cx->stride % cx->period;
    }
    for (int64_t base = 0; base < len; base += lanes) {
        int nl = (int)min64(lanes, len - base);
        for (int l = 0; l < nl; l++) {
            uint32_t xl = x[l], idx = (cx ? cx->base[cc[l]] : 0) + (xl & 4095), e = tabw[idx], field = e >> 12 & 0xFF;
            xl = ((e & 4095) + 1) * (xl >> 12) + (e >> 20);
            uint32_t need = xl < STATE_LOW, word = stream[pos > last_word ? last_word : pos];
            xl = xl << (need << 4) | (word & (0u - need));
            pos += need;
            x[l] = xl;
            vals[base + l] = (uint16_t)(sym ? sym[field] : valw[idx]);
            cls[l] = (uint8_t)(sym ? sym[256 + (field & 63)] >> 4 : field);
        }
        for (int l = 0; r->k && l < nl; l++) {
            uint32_t xl = x[l], e = r->dec2w[((uint32_t)cls[l] << 12) + (xl & 4095)];
            xl = ((e & 4095) + 1) * (xl >> 12) + (e >> 20);
            uint32_t need = xl < STATE_LOW, word = stream[pos > last_word ? last_word : pos];
            xl = xl << (need << 4) | (word & (0u - need));
            pos += need;
            x[l] = xl;
            lows[base + l] = (uint8_t)(e >> 12);
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

/* The lanes for 32 lanes and p = 12 in AVX2 (FORMAT.md 9.4), on 32-bit entries, for NB blocks side by side (one block's
 * 32 lanes are 4 chains of gathers and multiplies, too few to keep the core busy: two blocks' steps overlap). A step of
 * a block: the four groups of 8 lanes decode their first symbol (one gather from tabw; the slot is kept, its value
 * looked up after the lanes), then with two stages (TWO) their low bits (one gather from tab2w at class * 4096 + slot:
 * f - 1 | low bits << 12 | (slot - c) << 20), each sub-step's refills in lane order; the step's 32 slots and low bits
 * are stored at once. Both blocks' first stages come before either's second (their chains overlap; SmolLM2 on the Intel
 * Xeon with UNFIRE_CPU_ISA=avx2: 315 -> 288 ms). Steps from t0 while every block has steps left (steps) and a step
 * cannot read past the stream's end; returns the step it stopped at. */
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
    for (int k = 0; (KIND == CTX_COLUMN || KIND == CTX_ROWS) && k < NB; k++)
        ctx_lane0(cx, L[k].first + 32 * t0, &r0[k], &c0[k]);
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
            int32_t r32[32], c32[32];
            ctx_lanes32(cx, L[k].first + 32 * t0, r32, c32);
            for (int g = 0; g < 4; g++) {
                cr[k][g] = _mm256_loadu_si256((const __m256i *)(r32 + 8 * g));
                cc[k][g] = _mm256_loadu_si256((const __m256i *)(c32 + 8 * g));
            }
        }
    }
    int64_t t = t0;
    for (; t < steps; t++) {
        if (!room_for_step(pos, NB, TWO, words))
            break;
        __m256i ee[NB][4];
        for (int k = 0; k < NB; k++) {
            __m256i *e = ee[k], slot[4];
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
        }
        for (int k = 0; TWO && k < NB; k++) {
            __m256i *e = ee[k];
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
                    vs[i] = escape_value(r, esc, esc_end);
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
                vals[k] = escape_value(r, esc, esc_end);
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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_LANES_AVX512 1
#define TARGET512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,bmi,bmi2,popcnt")))
/* The AVX-512 lanes (32 lanes, p = 12, the same 32-bit tables as the AVX2 lanes): a block's 32 lanes are two vectors of
 * 16. A sub-step of 16 lanes: the new states as in SUBSTEP_AVX2, the lanes needing a word in a mask register (one
 * compare), and their words put in place by one expand of the next 16 words (vpexpandd: the lanes that need one take
 * consecutive words in lane order, FORMAT.md 9.4), no shuffle table. Each lane's value is gathered in the step, beside
 * its table entry (off the chain of states), or with at most 256 symbols looked up in registers (SYM) from the symbol,
 * after the second stage's gathers are on their way. A step goes phase by phase across its blocks (up to four side by
 * side; a tensor's last two or three blocks as a pair): every block's first-stage gathers, then every block's first
 * sub-steps, then block by block the second stage and the output. Each block's step is one chain (gather, multiply,
 * compare, refill, twice), so a block's whole step written before the next block's left the core waiting on it; across
 * the blocks the waits overlap (one core of the project's Intel Xeon, UNFIRE_CPU_ISA unset, every SmolLM2 tensor
 * decoded in turn: 282 -> 203 ms, the median of 15; the pair alone ~5% of it; MiniLM and Whisper tiny.en, mostly one
 * stage, 2-4%). Where every block starts on a raw byte (BF16) the step writes the 32 weights' bf16 at once: with m + k
 * = 7 the raw bits are the signs (what the encoder picks for two stages: the step's 4 raw bytes are a mask), else each
 * lane's w-bit raw field is cut from the step's 4w raw bytes by one byte permute (vpermb: the field's two bytes) and a
 * shift; an escape's weight is written without its value and its position kept, the value or-ed in after the lanes
 * (escapes in weight order). Otherwise the step stores the values (and low bits), joined with the raw bits after the
 * lanes as behind the AVX2 lanes. Same bits as every other path. */
typedef struct {
    const uint32_t *tabw, *valw; /* the block's first-stage table and its slots' values (by context: all tables) */
    uint64_t pos;
    uint32_t *x;
    uint16_t *vals; /* values (escapes: ESCAPE), when not writing bf16 */
    uint8_t *lows;  /* low bits, when not writing bf16 (two stages) */
    uint16_t *out;  /* bf16 of the block's weights, when writing it */
    const uint8_t *raw; /* the raw bits of the block's first weight on, when writing bf16 */
    uint32_t *escaped; /* the positions in the block of the escaped weights written so far, in weight order */
    int64_t n_escaped, first;
} Lanes512;

/* One sub-step of 16 lanes in AVX-512 (see above); pos moves on by the words taken. */
#define SUBSTEP_AVX512(e, xs, stream, pos)                                                                        \
    do {                                                                                                         \
        __m512i q_ = _mm512_srli_epi32(xs, 12);                                                                  \
        __m512i y_ = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_and_si512(e, slot_mask), q_),                    \
                                      _mm512_add_epi32(q_, _mm512_srli_epi32(e, 20)));                           \
        __mmask16 need_ = _mm512_cmplt_epu32_mask(y_, state_low);                                                \
        __m512i w_ = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((stream) + (pos))));             \
        xs = _mm512_mask_or_epi32(y_, need_, _mm512_slli_epi32(y_, 16), _mm512_maskz_expand_epi32(need_, w_));   \
        pos += (uint64_t)__builtin_popcount((unsigned)need_);                                                    \
    } while (0)

/* The value of each lane's symbol s (< 64, SYM = 1; < 256, SYM = 4) from the value table in registers vt: a word
 * permute reads the low 6 bits of each word of s, a choice by bits 6 and 7 among four of them. */
TARGET512 static inline __attribute__((always_inline)) __m512i sym_value(__m512i s, const __m512i *vt, const int SYM) {
    __m512i r = _mm512_permutex2var_epi16(vt[0], s, vt[1]);
    if (SYM == 4) {
        __mmask16 b6 = _mm512_test_epi32_mask(s, _mm512_set1_epi32(64));
        __mmask16 b7 = _mm512_test_epi32_mask(s, _mm512_set1_epi32(128));
        __m512i r1 = _mm512_permutex2var_epi16(vt[2], s, vt[3]);
        __m512i r2 = _mm512_permutex2var_epi16(vt[4], s, vt[5]);
        __m512i r3 = _mm512_permutex2var_epi16(vt[6], s, vt[7]);
        r = _mm512_mask_blend_epi32(b7, _mm512_mask_blend_epi32(b6, r, r1), _mm512_mask_blend_epi32(b6, r2, r3));
    }
    return _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF));
}

/* The AVX-512 lanes for NB blocks side by side, one stage or two (TWO), tables by block or by context (KIND, as
 * lanes_avx2), writing bf16 (BF16: low = 7 - m, w = 8 - m - k raw bits a weight) or values. Steps from t0 while
 * every block has steps left (steps) and a step cannot read past the stream's end; returns the step it stopped at. */
TARGET512 static inline __attribute__((always_inline)) int64_t
lanes_avx512(const uint32_t *tab2w, const uint16_t *sym, const uint16_t *stream, uint64_t words, Lanes512 *L,
             int64_t t0, int64_t steps, const int NB, const int TWO, const Ctx *cx, const int KIND, const int BF16,
             const int SYM, int low, int w) {
    const __m512i slot_mask = _mm512_set1_epi32(4095), state_low = _mm512_set1_epi32((int)STATE_LOW);
    const __m512i class_mask = _mm512_set1_epi32(0xFF000), byte = _mm512_set1_epi32(255);
    const __m512i sign = _mm512_set1_epi32(0x8000), lane16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                                  11, 12, 13, 14, 15);
    const __m512i escape = _mm512_set1_epi32(ESCAPE);
    const __m128i lowcount = _mm_cvtsi32_si128(low);
    /* BF16 with w > 1: lane l of group g takes raw bytes 2wg + (wl >> 3) and the next (vpermb), shifted right by
     * wl mod 8, w bits; the sign is bit q = w - 1 (to bit 15), then q mantissa bits; the low bits go above them */
    const int q = w - 1;
    const __m128i qcount = _mm_cvtsi32_si128(q), signcount = _mm_cvtsi32_si128(15 - q);
    const __m512i fmask = _mm512_set1_epi32((1 << w) - 1), qmask = _mm512_set1_epi32((1 << q) - 1);
    const __mmask32 step_bytes = (__mmask32)((1ull << (4 * w)) - 1);
    __m512i pick[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, shift = pick[0];
    if (BF16 && w > 1) {
        int32_t p_[2][16], s_[16];
        for (int l = 0; l < 16; l++) {
            s_[l] = w * l & 7;
            for (int g = 0; g < 2; g++) {
                int b = 2 * w * g + (w * l >> 3);
                p_[g][l] = b | (b + 1) << 8;
            }
        }
        pick[0] = _mm512_loadu_si512((const void *)p_[0]), pick[1] = _mm512_loadu_si512((const void *)p_[1]);
        shift = _mm512_loadu_si512((const void *)s_);
    }
    /* SYM (1: at most 64 symbols, 4: 256): the entries hold the symbol where the AVX2 lanes' hold the class; its
     * value (and with two stages, SYM = 1, its class << 4) is looked up in registers: a permute of words picks among
     * 64 (two 32-word tables), SYM of them and a choice by bits 6 and 7 of the symbol among 256 */
    const __m512i word = _mm512_set1_epi32(0xFFFF);
    __m512i vt[8], cls_lo = word, cls_hi = word;
    for (int h = 0; h < 8; h++)
        vt[h] = h < 2 * SYM ? _mm512_loadu_si512((const void *)(sym + 32 * h)) : word;
    if (SYM && TWO)
        cls_lo = _mm512_loadu_si512((const void *)(sym + 256)), cls_hi = _mm512_loadu_si512((const void *)(sym + 288));
    __m512i xs[NB][2], cr[NB][2], cc[NB][2];
    __m512i ir = _mm512_setzero_si512(), ic = ir, dm1 = ir, pm1 = ir, dd = ir, pp = ir;
    uint64_t pos[NB];
    int64_t r0[NB], c0[NB]; /* CTX_COLUMN, CTX_ROWS: lane 0's r and c */
    if (KIND == CTX_ROWS)
        dm1 = _mm512_set1_epi32((int)cx->stride - 1);
    for (int k = 0; (KIND == CTX_COLUMN || KIND == CTX_ROWS) && k < NB; k++)
        ctx_lane0(cx, L[k].first + 32 * t0, &r0[k], &c0[k]);
    if (KIND == CTX_ANY) {
        ir = _mm512_set1_epi32((int)(32 % cx->stride)), ic = _mm512_set1_epi32((int)(32 / cx->stride % cx->period));
        dd = _mm512_set1_epi32((int)cx->stride), pp = _mm512_set1_epi32((int)cx->period);
        dm1 = _mm512_set1_epi32((int)cx->stride - 1), pm1 = _mm512_set1_epi32((int)cx->period - 1);
    }
    for (int k = 0; k < NB; k++) {
        pos[k] = L[k].pos;
        for (int g = 0; g < 2; g++)
            xs[k][g] = _mm512_loadu_si512((const void *)(L[k].x + 16 * g));
        if (KIND == CTX_ANY) {
            int32_t r32[32], c32[32];
            ctx_lanes32(cx, L[k].first + 32 * t0, r32, c32);
            for (int g = 0; g < 2; g++) {
                cr[k][g] = _mm512_loadu_si512((const void *)(r32 + 16 * g));
                cc[k][g] = _mm512_loadu_si512((const void *)(c32 + 16 * g));
            }
        }
    }
    int64_t t = t0;
    for (; t < steps; t++) {
        if (!room_for_step(pos, NB, TWO, words))
            break;
        __m512i ee[NB][2], vv[NB][2];
#pragma GCC unroll 4
        for (int k = 0; k < NB; k++) {
            __m512i *e = ee[k], *v = vv[k];
            for (int g = 0; g < 2; g++) { /* first symbols: the values (with a context: the lanes' tables) */
                __m512i slot = _mm512_and_si512(xs[k][g], slot_mask);
                if (KIND == CTX_COLUMN) /* lanes 16g ... 16g + 15: contexts c0 + 16g ... (base repeats past P) */
                    slot = _mm512_or_si512(slot, _mm512_loadu_si512((const void *)(cx->base + c0[k] + 16 * g)));
                if (KIND == CTX_ROWS) { /* row c0, or the next one for the lanes past its end */
                    int64_t c1 = c0[k] + 1 == cx->period ? 0 : c0[k] + 1;
                    __mmask16 next = _mm512_cmpgt_epi32_mask(
                        _mm512_add_epi32(lane16, _mm512_set1_epi32((int)(r0[k] + 16 * g))), dm1);
                    slot = _mm512_or_si512(slot, _mm512_mask_blend_epi32(next, _mm512_set1_epi32((int)cx->base[c0[k]]),
                                                                         _mm512_set1_epi32((int)cx->base[c1])));
                }
                if (KIND == CTX_ANY) {
                    slot = _mm512_or_si512(slot, _mm512_i32gather_epi32(cc[k][g], (const void *)cx->base, 4));
                    __m512i r_ = _mm512_add_epi32(cr[k][g], ir);
                    __mmask16 wrap_ = _mm512_cmpgt_epi32_mask(r_, dm1); /* r >= D */
                    cr[k][g] = _mm512_mask_sub_epi32(r_, wrap_, r_, dd);
                    __m512i c_ = _mm512_mask_add_epi32(_mm512_add_epi32(cc[k][g], ic), wrap_,
                                                       _mm512_add_epi32(cc[k][g], ic), _mm512_set1_epi32(1));
                    cc[k][g] = _mm512_mask_sub_epi32(c_, _mm512_cmpgt_epi32_mask(c_, pm1), c_, pp);
                }
                e[g] = _mm512_i32gather_epi32(slot, (const void *)L[k].tabw, 4);
                if (!SYM) /* (by symbol: looked up later, from the symbol kept in e) */
                    v[g] = _mm512_i32gather_epi32(slot, (const void *)L[k].valw, 4);
            }
            if (KIND == CTX_COLUMN) { /* the next step's contexts: 32 on (32 mod P < P: one subtraction) */
                c0[k] += 32 % cx->period;
                c0[k] -= c0[k] >= cx->period ? cx->period : 0;
            }
            if (KIND == CTX_ROWS && (r0[k] += 32) >= cx->stride) /* D >= 32: at most one row on */
                r0[k] -= cx->stride, c0[k] = c0[k] + 1 == cx->period ? 0 : c0[k] + 1;
        }
#pragma GCC unroll 4
        for (int k = 0; k < NB; k++) {
            __m512i *e = ee[k];
            for (int g = 0; g < 2; g++) { /* e: the class * 4096, or by symbol the symbol */
                __m512i next = SYM ? _mm512_srli_epi32(e[g], 12) : _mm512_and_si512(e[g], class_mask);
                SUBSTEP_AVX512(e[g], xs[k][g], stream, pos[k]);
                e[g] = next;
            }
        }
#pragma GCC unroll 4
        for (int k = 0; k < NB; k++) {
            __m512i *e = ee[k], *v = vv[k];
            __m512i u[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
            if (TWO) {
                for (int g = 0; g < 2; g++) { /* second symbols: the low bits */
                    __m512i base2 = e[g]; /* class * 4096, or by symbol class << 4 from the symbol's words */
                    if (SYM) { /* and the symbol's value (before e is the second stage's entry) */
                        base2 = _mm512_slli_epi32(
                            _mm512_and_si512(_mm512_permutex2var_epi16(cls_lo, e[g], cls_hi), word), 8);
                        v[g] = sym_value(e[g], vt, SYM);
                    }
                    e[g] = _mm512_i32gather_epi32(_mm512_or_si512(base2, _mm512_and_si512(xs[k][g], slot_mask)),
                                                  (const void *)tab2w, 4);
                }
                for (int g = 0; g < 2; g++) {
                    SUBSTEP_AVX512(e[g], xs[k][g], stream, pos[k]);
                    u[g] = _mm512_and_si512(_mm512_srli_epi32(e[g], 12), byte);
                }
            }
            for (int g = 0; SYM && !TWO && g < 2; g++)
                v[g] = sym_value(e[g], vt, SYM);
            if (BF16) { /* sign | value << low | low bits, the escapes' values left out (kept: their positions) */
                __mmask16 esc0 = _mm512_cmpeq_epi32_mask(v[0], escape), esc1 = _mm512_cmpeq_epi32_mask(v[1], escape);
                uint32_t s = 0;
                __m512i bytes = _mm512_setzero_si512();
                if (w == 1) /* the signs: a bit a weight */
                    memcpy(&s, L[k].raw + 4 * t, 4);
                else /* 4w bytes (a masked load: never past them) */
                    bytes = _mm512_castsi256_si512(_mm256_maskz_loadu_epi8(step_bytes, L[k].raw + 4 * w * t));
                for (int g = 0; g < 2; g++) {
                    __m512i o = _mm512_sll_epi32(_mm512_maskz_mov_epi32(g ? ~esc1 : ~esc0, v[g]), lowcount);
                    if (w == 1) {
                        o = _mm512_or_si512(o, u[g]);
                        o = _mm512_mask_or_epi32(o, (__mmask16)(s >> 16 * g), o, sign);
                    } else {
                        __m512i f = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi8(pick[g], bytes), shift),
                                                     fmask);
                        o = _mm512_or_si512(_mm512_or_si512(o, _mm512_sll_epi32(_mm512_andnot_si512(qmask, f), signcount)),
                                            _mm512_or_si512(_mm512_sll_epi32(u[g], qcount), _mm512_and_si512(f, qmask)));
                    }
                    _mm256_storeu_si256((__m256i *)(L[k].out + 32 * t + 16 * g), _mm512_cvtepi32_epi16(o));
                }
                for (uint32_t m = (uint32_t)esc0 | (uint32_t)esc1 << 16; m; m &= m - 1) /* rare */
                    L[k].escaped[L[k].n_escaped++] = (uint32_t)(32 * t + __builtin_ctz(m));
            } else {
                for (int g = 0; g < 2; g++) {
                    _mm256_storeu_si256((__m256i *)(L[k].vals + 32 * t + 16 * g), _mm512_cvtepi32_epi16(v[g]));
                    if (TWO)
                        _mm_storeu_si128((__m128i *)(L[k].lows + 32 * t + 16 * g), _mm512_cvtepi32_epi8(u[g]));
                }
            }
        }
    }
    for (int k = 0; k < NB; k++) {
        L[k].pos = pos[k];
        for (int g = 0; g < 2; g++)
            _mm512_storeu_si512((void *)(L[k].x + 16 * g), xs[k][g]);
    }
    return t;
}

/* lanes_avx512 for one block, two or four (NB), one stage or two (TWO), writing bf16 or values (BF16), values by
 * symbol or gathered (SYM): one function per table kind (by block, column, rows, any) */
#define LANES_AVX512(name, NB, TWO, BF16, SYM)                                                                  \
    LANES_AVX512_KIND(name, NB, TWO, BF16, SYM, CTX_NONE)                                                       \
    LANES_AVX512_KIND(name##_column, NB, TWO, BF16, SYM, CTX_COLUMN)                                            \
    LANES_AVX512_KIND(name##_rows, NB, TWO, BF16, SYM, CTX_ROWS)                                                \
    LANES_AVX512_KIND(name##_any, NB, TWO, BF16, SYM, CTX_ANY)
#define LANES_AVX512_KIND(name, NB, TWO, BF16, SYM, KIND)                                                       \
    TARGET512 static int64_t name(const uint32_t *tab2w, const uint16_t *sym, const uint16_t *stream,            \
                                  uint64_t words, Lanes512 *L, int64_t t0, int64_t steps, const Ctx *cx, int low, \
                                  int w) {                                                                      \
        return lanes_avx512(tab2w, sym, stream, words, L, t0, steps, NB, TWO, cx, KIND, BF16, SYM, low, w);      \
    }
#define LANES_AVX512_NB(name, TWO, BF16, SYM)                                                                   \
    LANES_AVX512(name, 1, TWO, BF16, SYM)                                                                       \
    LANES_AVX512(name##_pair, 2, TWO, BF16, SYM)                                                                \
    LANES_AVX512(name##_quad, 4, TWO, BF16, SYM)
LANES_AVX512_NB(l512_one, 0, 0, 0)
LANES_AVX512_NB(l512_two, 1, 0, 0)
LANES_AVX512_NB(l512_one_bf16, 0, 1, 0)
LANES_AVX512_NB(l512_two_bf16, 1, 1, 0)
LANES_AVX512_NB(l512_one_sym, 0, 0, 1)
LANES_AVX512_NB(l512_two_sym, 1, 0, 1)
LANES_AVX512_NB(l512_one_bf16_sym, 0, 1, 1)
LANES_AVX512_NB(l512_two_bf16_sym, 1, 1, 1)
LANES_AVX512_NB(l512_one_sym256, 0, 0, 4)
LANES_AVX512_NB(l512_one_bf16_sym256, 0, 1, 4)
#undef LANES_AVX512
#undef LANES_AVX512_KIND
#undef LANES_AVX512_NB

typedef int64_t (*Lanes512Fn)(const uint32_t *, const uint16_t *, const uint16_t *, uint64_t, Lanes512 *, int64_t,
                              int64_t, const Ctx *, int, int);
/* [values: gathered, by symbol (64), by symbol (256; one stage only)][BF16][two stages][one block, two, four][kind] */
#define LANES512_ROW(name) {name, name##_column, name##_rows, name##_any}
#define LANES512_NB(name) {LANES512_ROW(name), LANES512_ROW(name##_pair), LANES512_ROW(name##_quad)}
static const Lanes512Fn lanes512_fns[3][2][2][3][4] = {
    {{LANES512_NB(l512_one), LANES512_NB(l512_two)}, {LANES512_NB(l512_one_bf16), LANES512_NB(l512_two_bf16)}},
    {{LANES512_NB(l512_one_sym), LANES512_NB(l512_two_sym)},
     {LANES512_NB(l512_one_bf16_sym), LANES512_NB(l512_two_bf16_sym)}},
    {{LANES512_NB(l512_one_sym256), LANES512_NB(l512_two)},  /* (two stages never take 256 symbols) */
     {LANES512_NB(l512_one_bf16_sym256), LANES512_NB(l512_two_bf16)}}};
#undef LANES512_ROW
#undef LANES512_NB
#endif

/* bf16 of weights j, j + 8, ... of a block whose first weight start is a multiple of 8, 8 at a time: the 8 raw
 * fields of w = 8 - m - k bits (sign, then q = 7 - m - k mantissa bits) lie in w whole bytes, read with one
 * 64-bit load; values (escapes resolved in weight order) and, with k > 0, low bits. Stops where a load would pass
 * the raw array's end; returns the weights done. */
static inline __attribute__((always_inline)) int64_t join8(const Rans *r, uint16_t *o, uint16_t *vals,
                                                           const uint8_t *lows, int k, int64_t j, int64_t len,
                                                           int64_t start, uint64_t *esc_io, uint64_t esc_end) {
    const int w = 8 - r->m - k, q = 7 - r->m - k, low = 7 - r->m;
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
                v = escape_value(r, esc, esc_end);
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

/* Whether blocks go through the AVX2 or AVX-512 lanes (32 lanes, p = 12, the AVX2 build: the 32-bit tables were
 * built; with a context, D and P < 2^31 and at most 16 tables); which: r->l512. */
static inline __attribute__((always_inline)) int wide(const Rans *r) {
    return r->decw != NULL; /* unw_rans_decode builds the 32-bit tables exactly then (wide_tables) */
}

/* Block b's first-stage table (by block; 0 with a context, whose tables are looked up per weight). */
static inline __attribute__((always_inline)) int64_t block_table(const Rans *r, int64_t b) {
    return r->ctx.period ? 0 : (int64_t)min64(r->block_table[b], r->n_tables - 1);
}

/* The kind of context (CTX_*) the wide lanes take for r. */
static inline __attribute__((always_inline)) int ctx_kind(const Rans *r) {
    return !r->ctx.period ? CTX_NONE : r->ctx.stride == 1 ? CTX_COLUMN : r->ctx.stride >= 32 ? CTX_ROWS : CTX_ANY;
}

/* Decode block b (see the top of this file). x: its lanes' states and pos its word position after `done`
 * weights (0, or whole steps a pair of the AVX2 lanes decoded into vals, as slots, and lows; or of the AVX-512
 * lanes, as values and lows, or as bf16 in the output with the positions of n_escaped escaped weights in
 * escaped). */
static inline __attribute__((always_inline)) void decode_block(const Rans *r, int64_t b, uint16_t *vals,
                                                               uint8_t *lows, uint8_t *cls, int64_t *cnt, uint32_t *x,
                                                               int64_t done, uint64_t pos, uint32_t *escaped,
                                                               int64_t n_escaped) {
    Block *job = &r->blocks[b];
    const int lanes = r->lanes, low = 7 - r->m, w_raw = 8 - r->m - r->k;
    int64_t start = b * r->block_size, len = min64(r->block_size, r->n - start);
    job->crc_raw = crc_piece(r->raw, r->raw_len, b, r->n_blocks, &job->raw_bytes);
    job->crc_stream = crc_piece((const uint8_t *)r->stream, 2 * r->words, b, r->n_blocks, &job->stream_bytes);
    job->crc_esc = crc_piece(r->escapes, r->esc_len, b, r->n_blocks, &job->esc_bytes);
    const uint64_t *tab = r->dec ? r->dec + (block_table(r, b) << r->p) : NULL; /* (the portable lanes' tables) */
    const Ctx *cx = r->ctx.period ? &r->ctx : NULL;
    static const uint16_t no_word = 0;
    const uint16_t *stream = r->words ? r->stream : &no_word;
    const uint64_t last_word = r->words ? (uint64_t)r->words - 1 : 0;
    int64_t slots = 0; /* with the AVX2 lanes: vals[0 .. slots) holds slots (their values: value) */
    int64_t fused = 0; /* with the AVX-512 lanes writing bf16: the output's first `fused` weights are written */
    const uint32_t *value = NULL;
    uint16_t *restrict o = r->out + start;
#ifdef HAVE_LANES_AVX512
    if (r->l512) { /* the whole steps the pair left */
        int64_t table = block_table(r, b) << 12;
        Lanes512 L = {r->decw + table, r->valw ? r->valw + table : NULL, pos, x, vals, lows, o,
                      r->raw + start / 8 * w_raw, escaped, n_escaped, start};
        done = 32 * lanes512_fns[r->sym_level][r->bf16][r->k > 0][0][ctx_kind(r)](
            r->dec2w, r->sym, stream, (uint64_t)r->words, &L, done / 32, len / 32, &r->ctx, low, w_raw);
        pos = L.pos, n_escaped = L.n_escaped;
        fused = r->bf16 ? done : 0;
        __atomic_or_fetch(&lanes_taken, r->k ? 8 : 4, __ATOMIC_RELAXED);
    } else
#endif
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
    if (done < len && r->decw) { /* what the wide lanes left, on their tables */
        int64_t table = block_table(r, b) << 12;
        pos = decode_lanes_w(r, r->decw + table, r->valw ? r->valw + table : NULL, stream, pos, last_word, x, vals + done,
                             lows + done, cls, len - done, cx, start + done, cnt);
        done = len;
    }
    if (r->k && done < len) { /* two stages: two words per weight at most */
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
    int64_t j = fused;
    for (int64_t i = 0; fused && i < n_escaped; i++, esc++) /* the AVX-512 lanes' escaped weights: their values */
        o[escaped[i]] |= (uint16_t)(escape_value(r, esc, esc_end) << low);
    if (r->k) { /* two stages: bf16 = sign | value << (7 - m) | low << q | q raw bits */
        const int q = 7 - r->m - r->k;
#ifdef HAVE_LANES_AVX2
        if (slots && w_raw == 1 && start % 8 == 0) /* the slots' values, escapes and bf16 in one pass */
            j = join1_avx2(r, o, vals, value, lows, r->raw + start / 8, r->raw + r->raw_len, slots, low, &esc, esc_end);
        if (j < slots) /* the slots' values where join1_avx2 did not take them */
            values_avx2(vals + j, value, slots - j);
        if (!fused && use_wide && w_raw > 1 && start % 8 == 0) { /* escapes first, then 8 weights at a time */
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
                        v = escape_value(r, esc, esc_end);
                        esc++;
                    }
                    o[j + i] = (uint16_t)((uint32_t)(*s >> i & 1) << 15 | v << low | lows[j + i]);
                }
        for (; j < len; j++) { /* any m and k (and the last few weights of the case above) */
            uint32_t v = vals[j], raw = field(r->raw, r->raw_len, start + j, w_raw);
            if (v == ESCAPE) {
                v = escape_value(r, esc, esc_end);
                esc++;
            }
            o[j] = (uint16_t)((raw >> q) << 15 | v << low | (uint32_t)lows[j] << q | (raw & ((1u << q) - 1)));
        }
    }
#ifdef HAVE_LANES_AVX2
    if (slots && !r->k) /* the slots' values */
        values_avx2(vals, value, slots);
    if (fused)
        ; /* the AVX-512 lanes wrote bf16: the weights after them below */
    else if (use_wide && w_raw == 6 && start % 4 == 0 && !r->k) { /* escapes first, then 8 weights at a time */
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
                    v = escape_value(r, esc, esc_end);
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
            v = escape_value(r, esc, esc_end);
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
    const int group = r->l512 ? 4 : 2; /* the most blocks decoded side by side */
    uint16_t *vals = scratch_take(group * sizeof(uint16_t) * most);
    uint8_t *lows = scratch_take(r->k ? group * most : 1), *cls = malloc((size_t)r->lanes);
    uint32_t *x = malloc(group * sizeof(uint32_t) * (size_t)r->lanes);
    int64_t *cnt = malloc(2 * sizeof(int64_t) * (size_t)r->lanes);
    uint32_t *escaped = r->bf16 ? scratch_take(group * sizeof(uint32_t) * most) : cnt; /* (cnt: any non-NULL) */
    int64_t b;
    while (1) {
        int pair = 0;
#ifdef HAVE_LANES_AVX2
        pair = wide(r);
#endif
        int take = r->l512 ? 4 : 1 + pair;
        if ((b = __atomic_fetch_add(&r->next_block, take, __ATOMIC_RELAXED)) >= r->n_blocks)
            break;
        if (!(vals && lows && cls && x && cnt && escaped)) {
            for (int64_t c = b; c < b + take && c < r->n_blocks; c++)
                r->blocks[c].error = NO_MEMORY;
            continue;
        }
#ifdef HAVE_LANES_AVX512
        if (r->l512) { /* four blocks side by side (the tensor's last ones, fewer than four: two, then one alone) */
            int nb = (int)min64(4, r->n_blocks - b), g = 0;
            for (; nb >= 2; b += g, nb -= g) {
                g = nb >= 4 ? 4 : 2;
                Lanes512 L[4];
                int64_t steps = min64(r->block_size, r->n - (b + g - 1) * r->block_size) / 32;
                for (int k = 0; k < g; k++) {
                    int64_t s0 = (b + k) * r->block_size, t0 = block_table(r, b + k) << 12;
                    Lanes512 l = {r->decw + t0, r->valw ? r->valw + t0 : NULL, block_start(r, b + k, x + 32 * k),
                                  x + 32 * k, vals + k * most, r->k ? lows + k * most : lows, r->out + s0,
                                  r->raw + s0 / 8 * (8 - r->m - r->k), r->bf16 ? escaped + k * most : escaped, 0, s0};
                    L[k] = l;
                }
                int64_t done = 32 * lanes512_fns[r->sym_level][r->bf16][r->k > 0][g / 2][ctx_kind(r)](
                    r->dec2w, r->sym, r->stream, (uint64_t)r->words, L, 0, steps, &r->ctx, 7 - r->m, 8 - r->m - r->k);
                for (int k = 0; k < g; k++)
                    decode_block(r, b + k, L[k].vals, L[k].lows, cls, cnt, L[k].x, done, L[k].pos, L[k].escaped,
                                 L[k].n_escaped);
            }
            if (nb == 1) /* the tensor's last block, alone */
                decode_block(r, b, vals, lows, cls, cnt, x, 0, block_start(r, b, x), escaped, 0);
            continue;
        }
#endif
        uint64_t pos = block_start(r, b, x);
        if (!pair || b + 1 == r->n_blocks) {
            decode_block(r, b, vals, lows, cls, cnt, x, 0, pos, escaped, 0);
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
        decode_block(r, b, vals, lows, cls, cnt, x, done, L[0].pos, escaped, 0);
        decode_block(r, b + 1, vals + most, lows1, cls, cnt, x + 32, done, L[1].pos, escaped, 0);
#endif
    }
    scratch_give(vals);
    scratch_give(lows);
    if (r->bf16)
        scratch_give(escaped);
    free(cls);
    free(x);
    free(cnt);
    return NULL;
}

TWO_BUILDS(work, work_body) /* builds.h: any CPU, or AVX2 + BMI2 */

/* Use the AVX2 + BMI2 build if wide (and the CPU has it); returns 1 if it is in use. For the tests. */
int unw_rans_use(int wide) { return builds_use(wide); }

static void avx512_init(void) {
#if defined(HAVE_LANES_AVX512)
    __builtin_cpu_init();
    avx512_cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                 && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
                 && __builtin_cpu_supports("avx512vbmi");
#endif
}
static pthread_once_t avx512_once = PTHREAD_ONCE_INIT;

/* Whether the AVX-512 lanes decode (the CPU has them, UNFIRE_CPU_ISA allows them and the AVX2 build is in use). */
static int avx512_in_use(void) {
    pthread_once(&avx512_once, avx512_init);
    return avx512_cpu && avx512_cap && avx512_on && use_wide;
}

/* Let the AVX-512 lanes decode if on (where the CPU, the cap and the build allow; else the AVX2 lanes do); returns
 * 1 if they are in use. For the tests. */
int unw_rans_use512(int on) {
    avx512_on = on;
    return avx512_in_use();
}

/* Which lanes decoded blocks since the last call (AVX2: bit 0 one stage, bit 1 two stages; AVX-512: bits 2 and 3),
 * and forget. For the tests (that tensors take the wide lanes where the cap allows). */
int unw_rans_lanes_taken(void) { return __atomic_exchange_n(&lanes_taken, 0, __ATOMIC_RELAXED); }

/* Cap the paths at instruction set isa (builds.h's ISA_*: UNFIRE_CPU_ISA, set by decode_rans_c.py when it
 * loads the library): the AVX2 lanes (the AVX2 + BMI2 build) from avx2 on, the AVX-512 lanes from avx512 on, the CRC
 * as crc_isa. Returns the paths in use: bit 0 the AVX2 + BMI2 build, bits 2-3 the CRC level (as unw_isa of
 * decode.c), bit 4 the AVX-512 lanes. */
int unw_rans_isa(int isa) {
    avx512_cap = isa >= ISA_AVX512;
    return builds_isa(isa) | crc_isa(isa) << 2 | avx512_in_use() << 4;
}

/* The decoding table of each frequency table: entry k * M + slot = class << 48 | f[s] << 32 | (slot - c[s]) << 16
 * | value of the symbol s owning the slot (value: ESCAPE for s == A, or the symbol itself when alphabet is NULL;
 * class: its second-stage table, symbol_class[s] clamped below n_classes, or 0 without symbol_class). Rows summing
 * to more than M are cut at M; slots of rows summing to less are 0 (Python has refused both already). */
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
        for (; slot < m; slot++) /* a row summing to less than M (refused before; never read as garbage) */
            dec[t * m + slot] = 0;
    }
}

/* The 32-bit tables of the wide lanes (p = 12), straight from the frequencies: entry t * 4096 + slot = (f - 1) mod 4096
 * | field << 12 | (slot - c) << 20 for the symbol s owning the slot, field its class (symbol_class[s] clamped below
 * n_classes; 0 without symbol_class), or s itself if by_symbol; and in valw (if not NULL) its value (ESCAPE for
 * s == a, s itself when alphabet is NULL). Rows summing to more than 4096 are cut, slots of rows summing to less
 * are 0 (Python has refused both already). */
static void build_wide(uint32_t *decw, uint32_t *valw, const uint16_t *tables, const uint16_t *alphabet, int a, int k,
                       const uint8_t *symbol_class, int n_classes, int by_symbol) {
    const int64_t m = 4096;
    for (int t = 0; t < k; t++) {
        uint32_t *row = decw + t * m, *vrow = valw ? valw + t * m : NULL;
        int64_t slot = 0;
        for (int s = 0; s <= a && slot < m; s++) {
            uint32_t f = tables[(int64_t)t * (a + 1) + s], value = !alphabet ? (uint32_t)s : s < a ? alphabet[s] : ESCAPE;
            uint32_t field = by_symbol ? (uint32_t)s
                                       : symbol_class ? (uint32_t)(symbol_class[s] < n_classes ? symbol_class[s]
                                                                                               : n_classes - 1) : 0;
            uint32_t head = ((f - 1) & 0xFFF) | (field & 0xFF) << 12;
            int64_t from = slot, end = min64(m, slot + f);
            for (uint32_t i = 0; slot < end; i++, slot++)
                row[slot] = head | i << 20;
            for (int64_t j = from; vrow && j < end; j++)
                vrow[j] = value;
        }
        for (; slot < m; slot++) {
            row[slot] = 0;
            if (vrow)
                vrow[slot] = 0;
        }
    }
}

/* The checks of RansTensor.check_index (reference/codec/rans/format.py, FORMAT.md 9.6) on the small arrays, in C:
 * the same verdicts, microseconds instead of a few dozen NumPy calls per tensor. Returns 0, or which check failed
 * (decode_rans_c.py's INDEX_ERRORS, in check_index's order). The arrays have the lengths the header implies
 * (RansTensor.check_header ran first). unw_rans_decode runs it first. */
static int unw_rans_check(const uint16_t *alphabet, int a, int mantissa_bits, const uint16_t *tables, int n_tables,
                          int prob_bits, const uint8_t *block_table, int64_t n_block_table,
                          const uint8_t *context_table, int64_t period, int low_bits, int low_tables,
                          const uint16_t *low_freqs, const uint8_t *symbol_class, int64_t n_symbol_class,
                          const uint32_t *block_words, const uint32_t *block_escapes, const uint32_t *states,
                          int64_t n_blocks, int lanes, int64_t words, int64_t n_escapes, int64_t n,
                          int64_t block_size) {
    uint64_t seen[512]; /* a bit per value < 2^15 */
    memset(seen, 0, sizeof seen);
    for (int s = 0; s < a; s++) {
        uint32_t v = alphabet[s];
        if (v >> (8 + mantissa_bits) || seen[v >> 6] >> (v & 63) & 1)
            return 1;
        seen[v >> 6] |= 1ull << (v & 63);
    }
    if (n_blocks && !n_tables)
        return 2;
    for (int t = 0; t < n_tables; t++) {
        int64_t sum = 0;
        for (int s = 0; s <= a; s++)
            sum += tables[(int64_t)t * (a + 1) + s];
        if (sum != (int64_t)1 << prob_bits)
            return 3;
    }
    for (int64_t b = 0; b < n_block_table; b++)
        if (block_table[b] >= n_tables)
            return 4;
    for (int64_t c = 0; c < period; c++)
        if (context_table[c] >= n_tables)
            return 4;
    if (low_bits && n_blocks && !low_tables)
        return 5;
    for (int t = 0; t < low_tables; t++) {
        int64_t sum = 0;
        for (int u = 0; u < 1 << low_bits; u++)
            sum += low_freqs[((int64_t)t << low_bits) + u];
        if (sum != (int64_t)1 << prob_bits)
            return 6;
    }
    for (int64_t s = 0; s < n_symbol_class; s++)
        if (symbol_class[s] >= low_tables)
            return 7;
    const uint32_t *starts[2] = {block_words, block_escapes};
    int64_t ends[2] = {words, n_escapes};
    for (int key = 0; key < 2; key++) {
        const uint32_t *st = starts[key];
        if (st[0] != 0 || st[n_blocks] != ends[key])
            return 8 + key;
        for (int64_t b = 0; b < n_blocks; b++)
            if (st[b + 1] < st[b])
                return 8 + key;
    }
    for (int64_t b = 0; b < n_blocks; b++)
        if (block_escapes[b + 1] - block_escapes[b] > min64(block_size, n - b * block_size))
            return 10;
    for (int64_t i = 0; i < n_blocks * lanes; i++)
        if (states[i] < STATE_LOW)
            return 11;
    return 0;
}

/* Decode a rANS-form tensor whose header Python has checked (see the top of this file) into out (uint16 [n]).
 * crc_io[0..3]: the expected CRC-32 of raw, stream, escapes and the data; crc_io[6..14] those of the small arrays
 * (alphabet, tables, block_words, states, block_table, block_escapes, symbol_class, low_freqs, context_table).
 * Returns OK or an error code, with crc_io[4] the block (for BAD_CRC which array: 0-3 as above, 4 + j the j-th
 * small one; for BAD_INDEX which check, unw_rans_check's code) and crc_io[5] a detail. */
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
    /* First the small arrays (their lengths follow from the header, which Python has checked against them): their
     * CRC-32s, crc_io[6 ...] in decode_rans_c.py's SMALL_ARRAYS order, then unw_rans_check (one call from Python
     * where there were three steps: ~9 us a tensor) */
    int64_t nb = n > 0 ? (n + block_size - 1) / block_size : 0, a1 = (int64_t)alphabet_size + 1;
    const void *small[9] = {alphabet, tables, block_words, states, block_table, block_escapes, symbol_class, low_freqs,
                            context_table};
    int64_t small_bytes[9] = {2 * (int64_t)alphabet_size, 2 * n_tables * a1, 4 * (nb + 1), 4 * nb * lanes,
                              context_period ? 0 : nb, 4 * (nb + 1), low_bits ? a1 : 0,
                              (int64_t)2 * low_tables << low_bits, context_period};
    for (int j = 0; j < 9; j++)
        if (~crc_update(~0u, (const uint8_t *)small[j], (size_t)small_bytes[j]) != crc_io[6 + j]) {
            crc_io[4] = (uint32_t)(4 + j); /* (CRC_ORDER + SMALL_ARRAYS)[4 + j] */
            return BAD_CRC;
        }
    int index = unw_rans_check(alphabet, alphabet_size, mantissa_bits, tables, n_tables, prob_bits, block_table,
                               context_period ? 0 : nb, context_table, context_period, low_bits, low_tables,
                               low_freqs, symbol_class, low_bits ? a1 : 0, block_words, block_escapes, states, nb,
                               lanes, words, n_escapes, n, block_size);
    if (index) {
        crc_io[4] = (uint32_t)index;
        return BAD_INDEX;
    }
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
    /* by context: where each context's table starts (table << p; tables past the last read the last) */
    r.n_tables = n_tables > 0 ? n_tables : 1;
    uint32_t *ctx_base = context_period > 0 ? scratch_take((size_t)(context_period + 32) * sizeof(uint32_t)) : NULL;
    for (int64_t c = 0; ctx_base && c < context_period; c++)
        ctx_base[c] = (uint32_t)min64(context_table[c], r.n_tables - 1) << prob_bits;
    for (int64_t c = context_period; ctx_base && c < context_period + 32; c++) /* repeating: see Ctx */
        ctx_base[c] = ctx_base[c % context_period];
    r.ctx.base = ctx_base, r.ctx.stride = context_stride > 0 ? context_stride : 1, r.ctx.period = context_period;
    /* The tables (kept between calls: scratch.h). The wide lanes (AVX2 or AVX-512: 32 lanes, p = 12, the AVX2 build;
     * with a context, D and P < 2^31 and at most 16 tables) and the portable C after them read 32-bit tables (f - 1
     * and slot - c in 12 bits each, the class or low bits in 8); the portable lanes elsewhere the 64-bit ones. With
     * the AVX-512 lanes and at most 64 symbols (the escape's included), the entries hold the symbol in place of the
     * class, its value and class coming from two small tables (sym). Two stages: at least one (zero) second-stage
     * table, so that a class never points outside. */
    size_t n_dec = (size_t)r.n_tables << prob_bits, n_dec2 = (size_t)(low_tables > 0 ? low_tables : 1) << prob_bits;
    int wide_tables = prob_bits == 12 && lanes == 32 && use_wide
                      && (!context_period || (r.n_tables <= 16 && r.ctx.stride < INT32_MAX && context_period < INT32_MAX));
    int by_symbol = wide_tables && avx512_in_use() && alphabet_size + 1 <= (low_bits ? 64 : 256);
    uint64_t *dec = wide_tables ? NULL : scratch_take(n_dec * sizeof(uint64_t));
    uint64_t *dec2 = !wide_tables && low_bits ? scratch_take(n_dec2 * sizeof(uint64_t)) : NULL;
    uint32_t *decw = wide_tables ? scratch_take(n_dec * sizeof(uint32_t)) : NULL;
    uint32_t *dec2w = wide_tables && low_bits ? scratch_take(n_dec2 * sizeof(uint32_t)) : NULL;
    uint32_t *valw = wide_tables && !by_symbol ? scratch_take(n_dec * sizeof(uint32_t)) : NULL;
    Block *blocks = scratch_take((size_t)r.n_blocks * sizeof(Block));
    if (!blocks || (context_period > 0 && !ctx_base) || (wide_tables ? !decw || (low_bits && !dec2w) || (!by_symbol && !valw)
                                                                     : !dec || (low_bits && !dec2))) {
        scratch_give(ctx_base);
        scratch_give(dec);
        scratch_give(dec2);
        scratch_give(decw);
        scratch_give(dec2w);
        scratch_give(valw);
        scratch_give(blocks);
        return NO_MEMORY;
    }
    memset(blocks, 0, (size_t)r.n_blocks * sizeof(Block));
    uint16_t sym[320];
    if (by_symbol) {
        memset(sym, 0, sizeof sym);
        for (int s = 0; s <= alphabet_size; s++) {
            sym[s] = s < alphabet_size ? alphabet[s] : ESCAPE;
            if (low_bits) /* (then at most 64 symbols) */
                sym[256 + s] = (uint16_t)(min64(symbol_class[s], (low_tables > 0 ? low_tables : 1) - 1) << 4);
        }
    }
    if (wide_tables) {
        build_wide(decw, valw, tables, alphabet, alphabet_size, n_tables, low_bits ? symbol_class : NULL,
                   low_tables > 0 ? low_tables : 1, by_symbol);
        if (low_bits)
            build_wide(dec2w, NULL, low_freqs, NULL, (1 << low_bits) - 1, low_tables, NULL, 1, 1); /* field: u */
    } else {
        build_tables(dec, tables, alphabet, alphabet_size, n_tables, prob_bits, low_bits ? symbol_class : NULL,
                     low_tables > 0 ? low_tables : 1);
        if (low_bits)
            build_tables(dec2, low_freqs, NULL, (1 << low_bits) - 1, low_tables, prob_bits, NULL, 1);
    }
    if (n_tables <= 0) { /* no table (refused before): the one table read is zeros */
        if (dec)
            memset(dec, 0, n_dec * sizeof(uint64_t));
        if (decw)
            memset(decw, 0, n_dec * sizeof(uint32_t));
        if (valw)
            memset(valw, 0, n_dec * sizeof(uint32_t));
    }
    if (low_bits && low_tables <= 0) {
        if (dec2)
            memset(dec2, 0, n_dec2 * sizeof(uint64_t));
        if (dec2w)
            memset(dec2w, 0, n_dec2 * sizeof(uint32_t));
    }
    r.dec = dec, r.dec2 = dec2, r.decw = decw, r.dec2w = dec2w, r.valw = valw, r.blocks = blocks;
    /* the AVX-512 lanes where the AVX2 lanes would run; writing bf16 where every block starts on a raw byte and
     * the raw array holds the raw bits of every weight */
    r.l512 = avx512_in_use() && wide(&r);
    r.sym = r.l512 && by_symbol ? sym : NULL;
    r.sym_level = !r.sym ? 0 : alphabet_size + 1 <= 64 ? 1 : 2;
    r.bf16 = r.l512 && block_size % 8 == 0 && raw_len >= (n * (8 - mantissa_bits - low_bits) + 7) / 8;
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
    scratch_give(dec);
    scratch_give(dec2);
    scratch_give(decw);
    scratch_give(dec2w);
    scratch_give(valw);
    scratch_give(blocks);
    scratch_give(ctx_base);
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
