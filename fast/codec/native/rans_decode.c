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
 *      p = 12) eight lanes go at once: two gathers for the entries, one 16-byte load for the next
 *      8 words, spread over the lanes that need one by a permutation looked up from their mask;
 *   2. the escapes, in weight order: each escape symbol's value is the next escape field;
 *   3. bf16 = sign | value << (7 - m) | low mantissa bits, the raw field read with one 64-bit load
 *      (m = 2: four fields per 3 bytes; with AVX2, 8 weights per byte shuffle).
 * Two stages (k = low_bits > 0, FORMAT.md 9.4): each step decodes every lane's value, then every lane's k low
 * bits from the second-stage table its value's symbol names (bits 48-63 of the first-stage entry), in the
 * portable loop (decode_lanes2; no AVX2 lanes yet); bf16 = sign | value << (7 - m) | low << q | q raw bits.
 * On MiniLM's largest tensor (11.7 M weights, one AMD EPYC core): 3.2 ns per weight in the portable
 * build, 1.6 ns with AVX2.
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

typedef struct {
    const uint8_t *raw, *escapes, *block_table;
    const uint16_t *stream;
    const uint32_t *block_words, *block_escapes, *states;
    const uint64_t *dec; /* K tables of M entries: class << 48 | f << 32 | (slot - c) << 16 | value */
    const uint64_t *dec2; /* two stages: C tables of M entries: f << 32 | (slot - c) << 16 | low bits */
    int64_t raw_len, esc_len, words, n_escapes, n, block_size, n_blocks, next_block;
    int lanes, p, m, k, n_tables;
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
 * CLAMP: whether a read may pass the stream's end (else the caller has made sure it cannot). */
static inline __attribute__((always_inline)) uint64_t decode_lanes(const uint64_t *tab, const uint16_t *stream,
                                                                   uint64_t pos, uint64_t last_word, uint32_t *x,
                                                                   uint16_t *vals, int64_t len, int lanes,
                                                                   const int P, const int CLAMP) {
    const uint32_t mask = (1u << P) - 1;
    for (int64_t base = 0; base < len; base += lanes) { /* step t = base / lanes */
        int nl = (int)min64(lanes, len - base);
        for (int l = 0; l < nl; l++) {
            uint32_t xl = x[l];
            uint64_t e = tab[xl & mask];
            xl = (uint32_t)(e >> 32) * (xl >> P) + ((uint32_t)e >> 16);
            uint32_t need = xl < STATE_LOW, word = stream[CLAMP && pos > last_word ? last_word : pos];
            xl = xl << (need << 4) | (word & (0u - need)); /* arithmetic, not a select: compilers branch on it */
            pos += need;
            x[l] = xl;
            vals[base + l] = (uint16_t)e;
        }
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
                                                                    int lanes, const int P, const int CLAMP) {
    const uint32_t mask = (1u << P) - 1;
    for (int64_t base = 0; base < len; base += lanes) {
        int nl = (int)min64(lanes, len - base);
        for (int l = 0; l < nl; l++) {
            uint32_t xl = x[l];
            uint64_t e = tab[xl & mask];
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
    }
    return pos;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_LANES_AVX2 1
static int32_t word_of_lane[256][8]; /* for a mask of the lanes that need a word: which of the next 8 words each takes */
static pthread_once_t word_of_lane_once = PTHREAD_ONCE_INIT;

static void word_of_lane_init(void) {
    for (int m = 0; m < 256; m++)
        for (int l = 0; l < 8; l++)
            word_of_lane[m][l] = __builtin_popcount((unsigned)m & ((1u << l) - 1));
}

/* decode_lanes for 32 lanes and p = 12, eight lanes at a time in AVX2: the 8 table entries by two
 * gathers, the 8 refills by one 16-byte load of the next 8 words spread over the lanes that need one
 * (in lane order, word_of_lane). Whole steps only, and only while a step cannot read past the stream's
 * end (words); returns how many weights it decoded (the caller does the rest). */
__attribute__((target("avx2,bmi,bmi2,popcnt"))) static int64_t lanes32_avx2(const uint64_t *tab, const uint16_t *stream,
                                                                         uint64_t words, uint64_t *pos_io,
                                                                         uint32_t *x, uint16_t *vals, int64_t len) {
    pthread_once(&word_of_lane_once, word_of_lane_init);
    const __m256i slot_mask = _mm256_set1_epi32(4095), zero = _mm256_setzero_si256();
    __m256i xs[4];
    for (int g = 0; g < 4; g++)
        xs[g] = _mm256_loadu_si256((const __m256i *)(x + 8 * g));
    uint64_t pos = *pos_io;
    int64_t t = 0;
    for (; t < len / 32 && pos + 32 <= words; t++) /* a step reads at most 32 words */
        for (int g = 0; g < 4; g++) {
            __m256i slot = _mm256_and_si256(xs[g], slot_mask);
            __m256 a = _mm256_castsi256_ps(
                _mm256_i32gather_epi64((const long long *)tab, _mm256_castsi256_si128(slot), 8));
            __m256 b = _mm256_castsi256_ps(
                _mm256_i32gather_epi64((const long long *)tab, _mm256_extracti128_si256(slot, 1), 8));
            /* low and high halves of the 8 entries, back in lane order */
            __m256i lo = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0x88)), 0xD8);
            __m256i f = _mm256_permute4x64_epi64(_mm256_castps_si256(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8);
            __m256i y = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(xs[g], 12)), _mm256_srli_epi32(lo, 16));
            __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(y, 16), zero);
            int m = _mm256_movemask_ps(_mm256_castsi256_ps(need));
            __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(stream + pos)));
            words = _mm256_permutevar8x32_epi32(words, _mm256_loadu_si256((const __m256i *)word_of_lane[m]));
            xs[g] = _mm256_blendv_epi8(y, _mm256_or_si256(_mm256_slli_epi32(y, 16), words), need);
            pos += (uint64_t)__builtin_popcount((unsigned)m);
            __m256i v = _mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF));
            _mm_storeu_si128((__m128i *)(vals + 32 * t + 8 * g),
                             _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
        }
    for (int g = 0; g < 4; g++)
        _mm256_storeu_si256((__m256i *)(x + 8 * g), xs[g]);
    *pos_io = pos;
    return t * 32;
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
#endif

static inline __attribute__((always_inline)) void decode_block(const Rans *r, int64_t b, uint16_t *vals,
                                                               uint8_t *lows, uint8_t *cls, uint32_t *x) {
    Block *job = &r->blocks[b];
    const int lanes = r->lanes, low = 7 - r->m, w_raw = 8 - r->m - r->k, w_esc = 8 + r->m;
    int64_t start = b * r->block_size, len = min64(r->block_size, r->n - start);
    job->crc_raw = crc_piece(r->raw, r->raw_len, b, r->n_blocks, &job->raw_bytes);
    job->crc_stream = crc_piece((const uint8_t *)r->stream, 2 * r->words, b, r->n_blocks, &job->stream_bytes);
    job->crc_esc = crc_piece(r->escapes, r->esc_len, b, r->n_blocks, &job->esc_bytes);
    const uint64_t *tab = r->dec + ((int64_t)min64(r->block_table[b], r->n_tables - 1) << r->p);
    static const uint16_t no_word = 0;
    const uint16_t *stream = r->words ? r->stream : &no_word;
    const uint64_t last_word = r->words ? (uint64_t)r->words - 1 : 0, pos0 = r->block_words[b];
    memcpy(x, r->states + b * lanes, sizeof(uint32_t) * (size_t)lanes);
    uint64_t pos = pos0;
    int64_t done = 0;
    if (r->k) { /* two stages: two words per weight at most */
        const uint64_t *tab2 = r->dec2;
        if (r->p == 12 && pos + 2 * (uint64_t)len <= (uint64_t)r->words)
            pos = decode_lanes2(tab, tab2, stream, pos, last_word, x, vals, lows, cls, len, lanes, 12, 0);
        else if (r->p == 12)
            pos = decode_lanes2(tab, tab2, stream, pos, last_word, x, vals, lows, cls, len, lanes, 12, 1);
        else
            pos = decode_lanes2(tab, tab2, stream, pos, last_word, x, vals, lows, cls, len, lanes, r->p, 1);
        done = len;
    }
#ifdef HAVE_LANES_AVX2
    if (use_wide && lanes == 32 && r->p == 12 && !r->k)
        done = lanes32_avx2(tab, stream, (uint64_t)r->words, &pos, x, vals, len);
#endif
    int safe = pos + (uint64_t)(len - done) <= (uint64_t)r->words; /* a word per weight at most: no read past the end */
    if (done == len)
        ;
    else if (r->p == 12 && safe)
        pos = decode_lanes(tab, stream, pos, last_word, x, vals + done, len - done, lanes, 12, 0);
    else if (r->p == 12)
        pos = decode_lanes(tab, stream, pos, last_word, x, vals + done, len - done, lanes, 12, 1);
    else
        pos = decode_lanes(tab, stream, pos, last_word, x, vals + done, len - done, lanes, r->p, 1);
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
    if (r->k) { /* two stages: bf16 = sign | value << (7 - m) | low << rest | rest bits */
        const int rest = 7 - r->m - r->k;
        for (; j < len; j++) {
            uint32_t v = vals[j], raw;
            if (w_raw == 1) { /* m + k = 7: the raw field is the sign, 8 to a byte */
                int64_t i = start + j;
                raw = (i >> 3) < r->raw_len ? (uint32_t)(r->raw[i >> 3] >> (i & 7)) & 1u : 0;
            } else
                raw = field(r->raw, r->raw_len, start + j, w_raw);
            if (v == ESCAPE) {
                v = esc < esc_end && esc < (uint64_t)r->n_escapes ? field(r->escapes, r->esc_len, (int64_t)esc, w_esc)
                                                                   : 0;
                esc++;
            }
            o[j] = (uint16_t)((raw >> rest) << 15 | v << low | (uint32_t)lows[j] << rest | (raw & ((1u << rest) - 1)));
        }
    }
#ifdef HAVE_LANES_AVX2
    if (use_wide && w_raw == 6 && start % 4 == 0 && !r->k) { /* escapes first, then 8 weights at a time */
        esc = escapes_avx2(r, vals, len, esc, esc_end);
        j = join6_avx2(o, vals, r->raw + start / 4 * 3, r->raw + r->raw_len, len);
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
    for (; j < len; j++) { /* any m (and the last few weights of the specialised case) */
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

/* A thread: take the next block until none is left. */
static inline __attribute__((always_inline)) void *work_body(void *arg) {
    Rans *r = arg;
    size_t most = (size_t)min64(r->block_size, r->n > 0 ? r->n : 1);
    uint16_t *vals = malloc(sizeof(uint16_t) * most);
    uint8_t *lows = malloc(r->k ? most : 1), *cls = malloc((size_t)r->lanes);
    uint32_t *x = malloc(sizeof(uint32_t) * (size_t)r->lanes);
    for (int64_t b; (b = __atomic_fetch_add(&r->next_block, 1, __ATOMIC_RELAXED)) < r->n_blocks;) {
        if (vals && lows && cls && x)
            decode_block(r, b, vals, lows, cls, x);
        else
            r->blocks[b].error = NO_MEMORY;
    }
    free(vals);
    free(lows);
    free(cls);
    free(x);
    return NULL;
}

TWO_BUILDS(work, work_body) /* builds.h: any CPU, or AVX2 + BMI2 */

/* Use the AVX2 + BMI2 build if wide (and the CPU has it); returns 1 if it is in use. For the tests. */
int unw_rans_use(int wide) { return builds_use(wide); }

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
                    const uint8_t *symbol_class, const uint16_t *low_freqs, int low_tables, int threads,
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
    uint64_t *dec2 = low_bits ? calloc((size_t)(low_tables > 0 ? low_tables : 1) << prob_bits, sizeof(uint64_t)) : NULL;
    Block *blocks = calloc((size_t)r.n_blocks, sizeof(Block));
    if (!dec || !blocks || (low_bits && !dec2)) {
        free(dec);
        free(dec2);
        free(blocks);
        return NO_MEMORY;
    }
    build_tables(dec, tables, alphabet, alphabet_size, n_tables, prob_bits, low_bits ? symbol_class : NULL,
                 low_tables > 0 ? low_tables : 1);
    if (low_bits)
        build_tables(dec2, low_freqs, NULL, (1 << low_bits) - 1, low_tables, prob_bits, NULL, 1);
    r.dec = dec, r.dec2 = dec2, r.blocks = blocks, r.n_tables = n_tables > 0 ? n_tables : 1;
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
    free(blocks);
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
