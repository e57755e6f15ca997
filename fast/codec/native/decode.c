/* The Unweight decoder for the CPU, in C (FORMAT.md sections 3.4-3.6): Huffman form -> bf16.
 *
 * fast/codec/decode_c.py builds this file with the system C compiler on first use (as the
 * encoder, native/encode.c), loads it with ctypes and calls:
 *
 *   unw_crc32          CRC-32 (IEEE, the value zlib.crc32 gives) of a buffer, in threads (crc32.h)
 *   unw_crc_use        which CRC-32 path to use at most (for the tests)
 *   unw_decode_use     whether to use the AVX2 + BMI2 build of the decoding loop (for the tests)
 *   unw_assemble_use   whether to use the AVX-512BW assembly of bf16 in that build (for the tests)
 *   unw_isa            the instruction sets UNFIRE_CPU_ISA allows (builds.h's ISA_*), set when the library
 *                      is loaded: the AVX2 + BMI2 build from avx2 on, the AVX-512BW assembly and the
 *                      VPCLMULQDQ CRC from avx512 on, PCLMULQDQ (or ARM's CRC32) from avx2 (neon) on
 *   unw_tables         the one-symbol decoding table of FORMAT.md 3.3 and the multi-symbol table,
 *                      from the code lengths and the palette
 *   unw_decode         every check of FORMAT.md 3.6 that reads array contents, and the decode
 *
 * Python checks the header (ranges, array dtypes and lengths) first; unw_decode checks the rest:
 * the CRC-32 of every array and of the decoded data, offsets (0 ... B, non-decreasing), verbatim
 * ids (increasing, in range), vexp padding, the verbatim rule, the stream's tail bits, every table
 * hit, and that every group ends exactly at the next group's offset. (An invalid hit stalls its
 * group; the group's last codes, checked one by one, or its end, or the data's CRC then fail: see
 * decode_4_groups.) No value read from the arrays is used as an address before it is clamped or
 * checked, so damaged input cannot read out of bounds and every loop is bounded by the tensor's
 * geometry.
 *
 * How it decodes. The groups are cut into blocks (one block with one thread; blocks of ~64K weights
 * with more, so that a thread slowed by other work on the machine takes fewer of them), and each thread
 * takes the next block until none is left. Per four groups: count their coded weights (their chunks
 * less the verbatim ones), decode that many exponents into a scratch buffer, one group after the
 * other, then assemble bf16 = sign | exponent << 7 | mantissa run by run (a run: the coded chunks
 * between two verbatim ones, one stretch of the flat output). Decoding a group is a chain: each
 * code's length says where the next starts. To keep that chain short:
 *   - the 64-bit window is built once per refill from three stream words (MSB first within each
 *     32-bit word, so the words are swapped as they are read) and serves 64 / L table lookups;
 *   - the multi-symbol table, indexed by the next L bits as the one-symbol table of FORMAT.md 3.3
 *     is, gives up to 5 whole codes that fit in those L bits at once, in one 64-bit entry: their
 *     total length (the low bits: the window is shifted by the entry itself), their exponents (5
 *     bytes, written in one 8-byte store whose last 3 bytes the next store overwrites) and their
 *     count. With L = 12 and ~2.7-bit codes that is ~4.1 weights per lookup (~3.7 with up to 4 codes:
 *     MiniLM, 2026-12-06). The last few weights of a group go one code at a time, so a group never
 *     reads a code past its own count nor stores past its end;
 *   - an invalid window is an entry of 1 symbol and 0 bits with a flag: the loop always advances
 *     and stays stuck at that window (see decode_4_groups for how it is caught);
 *   - four groups are decoded at once (independent chains the CPU overlaps), in AVX2 + BMI2 code
 *     where the CPU has it (chosen at run time), in rounds counted ahead (no end check per round);
 *     in that build the rounds are x86-64 assembly that keeps all four chains in registers (the
 *     compiler's code kept some on the stack: a store and a load in every chain), ~7% faster, and
 *     loads an entry's bytes rather than shifting it (the shift ports were the busiest); the last
 *     codes of the four groups stay interleaved (finish_4_copied);
 *   - a group's coded weights and the runs of the assembly come from its verbatim chunks alone (a
 *     few), not from a walk over its chunks;
 *   - bf16 is assembled with AVX-512BW where the CPU has it (32 weights an instruction sequence), and
 *     with VPCLMULQDQ too the output's CRC is folded from the registers as it is assembled, the output
 *     written past the cache (assemble_crc_512).
 * The CRCs of the output (where not fused as above) and of sm are computed per block while the data is in
 * cache, and joined (crc32_combine, as zlib does) in block order.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "builds.h"
#include "crc32.h"
#include "threads.h"

#define CRC_BATCH 8192  /* weights of output between two CRC updates (stays in cache) */

typedef struct {
    const uint8_t *p;
    int64_t n;
    uint32_t crc;
} CrcJob;

static void *crc_piece(void *arg) {
    CrcJob *job = arg;
    job->crc = ~crc_update(~0u, job->p, (size_t)job->n);
    return NULL;
}

/* Use at most CRC path `level` (0 tables, 1 PCLMULQDQ or ARM's CRC32, 2 VPCLMULQDQ; -1 the best allowed); the
 * one in use. */
int unw_crc_use(int level) { return crc_use(level); }

/* zlib.crc32(p[0:n]), computed in `threads` pieces and joined. */
uint32_t unw_crc32(const uint8_t *p, int64_t n, int threads) {
    CrcJob jobs[MAX_THREADS];
    crc_setup();
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    for (int t = 0; t < threads; t++) {
        int64_t a = n * t / threads, b = n * (t + 1) / threads;
        jobs[t].p = p + a;
        jobs[t].n = b - a;
    }
    run_threads(crc_piece, jobs, sizeof(CrcJob), threads);
    uint32_t crc = jobs[0].crc;
    for (int t = 1; t < threads; t++)
        crc = crc_combine(crc, jobs[t].crc, jobs[t].n);
    return crc;
}

/* ---- the tables ---- */

/* One entry of the multi-symbol table (uint64), by bytes: byte 0 the total length of the up to 5 whole
 * codes that lie inside the L-bit window (`x << t` by a register: x86 shifts take the count's low 6 bits;
 * 0 if the window starts with no code), bytes 1-5 their exponents (stored in one 8-byte store: `t >> 8`,
 * or the 8 bytes from byte 1 loaded and stored), byte 6 INVALID (bit 48) if the window starts with no
 * code, byte 7 their count (`t >> 56`). An invalid window is 1 code of 0 bits. The assembly of the rounds
 * loads bytes 0 and 7 and the 8 bytes from byte 1 separately: three loads, where shifting one load three
 * times kept the two shift ports busiest (MiniLM, 2026-12-06: 11.1 -> 10.7 ms a pass). */
#define M_CODES 5 /* codes an entry holds at most */
#define M_STORE 8 /* bytes one lookup stores */
#define M_INVALID (1ull << 48)
static inline __attribute__((always_inline)) unsigned m_len(uint64_t t) { return (unsigned)t & 63; }
static inline __attribute__((always_inline)) uint64_t m_exps(uint64_t t) { return t >> 8; }
static inline __attribute__((always_inline)) uint64_t m_count(uint64_t t) { return t >> 56; }

/* The used symbols of a code, by length (shortest first): their lengths, codes and exponents. */
typedef struct {
    int n;
    uint32_t len[256], code[256];
    uint64_t exp[256];
} Code;

/* Every window that starts with the codes of `prefix` (`used` bits, k codes, their exponents `exps`), each
 * written once: a window that goes on with a code that fits in the bits left is filled by the call for
 * that code (the entry of a window is its longest run of whole codes, up to 5); canonical codes, in their
 * order (by length, then symbol), take consecutive windows from the first, so those are [0, covered), and
 * the windows after get the entry of these k codes (k = 0: the invalid entry). */
static void fill_multi(uint64_t *multi, const Code *c, uint32_t L, uint32_t prefix, uint32_t used, uint32_t k,
                       uint64_t exps) {
    uint32_t left = L - used, covered = 0;
    uint64_t *at = multi + ((uint64_t)prefix << left);
    if (k == M_CODES - 1) { /* the last code: its windows, a run each, get the entry of all M_CODES codes */
        for (int j = 0; j < c->n && c->len[j] <= left; j++) {
            uint64_t entry = (used + c->len[j]) | (exps | c->exp[j] << (8 * k)) << 8 | (uint64_t)M_CODES << 56;
            uint32_t from = c->code[j] << (left - c->len[j]);
            covered = (c->code[j] + 1) << (left - c->len[j]);
            for (uint32_t i = from; i < covered; i++)
                at[i] = entry;
        }
    } else
        for (int j = 0; j < c->n && c->len[j] <= left; j++) {
            fill_multi(multi, c, L, prefix << c->len[j] | c->code[j], used + c->len[j], k + 1,
                       exps | c->exp[j] << (8 * k));
            covered = (c->code[j] + 1) << (left - c->len[j]);
        }
    uint64_t entry = k ? used | exps << 8 | (uint64_t)k << 56 : M_INVALID | 1ull << 56;
    for (uint32_t i = covered, n = 1u << left; i < n; i++)
        at[i] = entry;
}

/* The decoding tables of a code, from its lengths (checked by the caller: FORMAT.md 3.3) and palette:
 * single[w] = exponent | length << 8 for every L-bit window w (the canonical code's symbol whose code
 * starts w; length 0: no code starts there), and multi[w] as above. */
void unw_tables(const uint8_t *lengths, const uint8_t *palette, int p, int L, uint16_t *single, uint64_t *multi) {
    uint32_t count[33] = {0}, next[33];
    Code c;
    memset(single, 0, sizeof(uint16_t) << L);
    p = p < 256 ? p : 256;
    for (int s = 0; s < p; s++)
        count[lengths[s] <= 32 ? lengths[s] : 0]++;
    count[0] = 0;
    for (uint32_t len = 1, k = 0; len <= (uint32_t)L; len++) { /* canonical codes, as DEFLATE's */
        k = (k + count[len - 1]) << 1;
        next[len] = k;
    }
    c.n = 0;
    for (uint32_t len = 1; len <= (uint32_t)L; len++) /* by length, then symbol: canonical order */
        for (int s = 0; s < p; s++)
            if (lengths[s] == len) {
                uint32_t code = next[len]++, first = code << (L - len), n = 1u << (L - len);
                for (uint32_t w = first; w < first + n && w < (1u << L); w++) /* every window this code starts */
                    single[w] = (uint16_t)(palette[s] | len << 8);
                c.len[c.n] = len, c.code[c.n] = code, c.exp[c.n] = palette[s], c.n++;
            }
    fill_multi(multi, &c, (uint32_t)L, 0, 0, 0, 0);
}

/* ---- decoding ---- */

enum { OK, BAD_OFFSETS, BAD_VCHUNKS, BAD_VEXP_PADDING, BAD_VERBATIM_RULE, BAD_TAIL, BAD_CODE, BAD_GROUP_END,
       BAD_CRC, NO_MEMORY };

typedef struct {
    const uint32_t *stream, *offsets, *vchunks;
    int64_t words, stream_bits, n_verbatim;
    const uint8_t *vexp, *sm;
    const uint16_t *single;
    const uint64_t *multi;
    uint8_t in_palette[256];
    int L;
    int64_t rows, cols, cs, cpg, cpr, n_chunks, n_groups;
    uint16_t *out;
    int64_t n_blocks, next_block; /* the work: blocks of groups, taken in order by whichever thread is free */
    struct Job *blocks;
} Tensor;

typedef struct Job { /* one block's results */
    uint32_t crc_out, crc_sm;  /* of the block's flat weights */
    uint32_t crc_stream;       /* of the block's share of the stream's bytes */
    int64_t stream_bytes;
    int64_t first, last;       /* the block's flat weights [first, last) */
    int error;
    int64_t where, detail;
} Job;

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The 64 bits of the stream from bit pos (words read MSB first; no branch: past the end reads the last words). */
static inline __attribute__((always_inline)) uint64_t window64(const uint32_t *s, int64_t words, uint64_t pos) {
    uint64_t last = (uint64_t)words - 1, i = pos >> 5, sh = pos & 31;
    i = i < last ? i : last - 1;                 /* a corrupt group ran past the end: read the last words */
    uint64_t third = s[i + 2 < last ? i + 2 : last]; /* the last word is 0 (else BAD_TAIL is raised) */
    return ((((uint64_t)s[i] << 32) | s[i + 1]) << sh) | ((third >> 1) >> (31 - sh));
}

/* Decode exponents i ... count - 1 of one group into dst, from bit *pos; returns the INVALID flag or 0. */
static inline __attribute__((always_inline)) unsigned decode_group(const Tensor *x, const uint32_t *s, int64_t words,
                                                                   uint64_t *pos_io, int64_t i, int64_t count,
                                                                   uint8_t *dst, const int L, const int R) {
    const uint16_t *single = x->single;
    const uint64_t *multi = x->multi;
    uint64_t pos = *pos_io, bad = 0;
    while (i + M_STORE <= count) { /* up to R lookups of up to 5 codes each per refill, while a store fits */
        uint64_t win = window64(s, words, pos) | 1; /* bit 0, never read (R * L < 64), marks the bits used */
        for (int r = 0; r < R && i + M_STORE <= count; r++) {
            uint64_t t = multi[win >> (64 - L)];
            uint64_t e = m_exps(t);
            memcpy(dst + i, &e, M_STORE);
            i += (int64_t)m_count(t);
            win <<= m_len(t);
            bad |= t;
        }
        pos += (uint64_t)__builtin_ctzll(win); /* the mark moved up by the bits used */
    }
    for (; i < count; i++) { /* the last (at most 7) codes one at a time */
        unsigned e = single[window64(s, words, pos) >> (64 - L)];
        dst[i] = (uint8_t)e;
        pos += e >> 8;
        bad |= (e >> 8) == 0 ? M_INVALID : 0;
    }
    *pos_io = pos;
    return (bad & M_INVALID) != 0;
}

/* One lookup of group q's chain: up to 5 exponents stored at once, the window shifted past their bits. */
#define STEP(q)                                     \
    {                                               \
        uint64_t t = multi[win##q >> (64 - L)];     \
        uint64_t e = m_exps(t);                     \
        memcpy(o##q, &e, M_STORE);                  \
        o##q += m_count(t);                         \
        win##q <<= m_len(t);                        \
    }

/* The rounds of lookups that all four groups can take for sure: each round takes at most 5 * R codes
 * of a group, and a group takes rounds while its output pointer is at most its end less SAFE_END(R) (the
 * round's last 8-byte store then ends at the group's end at most). So the inner loops need no end check
 * per round (and no registers for the four ends). */
#define SAFE_END(R) (M_CODES * (R) + M_STORE - M_CODES)
static inline __attribute__((always_inline)) int64_t safe_rounds(uint8_t *const *o, uint8_t *const *end, int R) {
    int64_t slack = end[0] - o[0];
    for (int q = 1; q < 4; q++)
        slack = end[q] - o[q] < slack ? end[q] - o[q] : slack;
    return slack < 0 ? 0 : slack / (M_CODES * R) + 1;
}

/* Four groups at once (their chains of lookups are independent, so the CPU overlaps them), as far as
 * all four have SAFE_END(R) codes left; each then finishes alone in decode_group. Each group's state is its
 * window, bit position and output pointer (few enough to stay in registers). The lookups here are not
 * checked one by one (that flag cost ~8%): an invalid window consumes no bits, so the group stays stuck
 * there; decode_group, which checks every hit, then meets it again, or the group ends before its next
 * offset (BAD_GROUP_END); in the last case left (stuck exactly at that offset), the data's CRC-32 differs. */
static inline __attribute__((always_inline)) void decode_4_groups(const Tensor *x, const uint32_t *s, int64_t words,
                                                                  uint64_t *pos, const int64_t *count,
                                                                  uint8_t *const *dst, unsigned *bad, const int L,
                                                                  const int R) {
    const uint64_t *multi = x->multi;
    uint64_t p0 = pos[0], p1 = pos[1], p2 = pos[2], p3 = pos[3];
    uint8_t *o0 = dst[0], *o1 = dst[1], *o2 = dst[2], *o3 = dst[3];
    uint8_t *end[4];
    for (int q = 0; q < 4; q++)
        end[q] = dst[q] + count[q] - SAFE_END(R);
    for (int64_t n; (n = safe_rounds((uint8_t *[4]){o0, o1, o2, o3}, end, R)) > 0;)
        for (; n > 0; n--) {
            /* bit 0 of each window, never read (R * L < 64), is a mark: it moves up by the bits used */
            uint64_t win0 = window64(s, words, p0) | 1, win1 = window64(s, words, p1) | 1;
            uint64_t win2 = window64(s, words, p2) | 1, win3 = window64(s, words, p3) | 1;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                STEP(0) STEP(1) STEP(2) STEP(3)
            }
            p0 += (uint64_t)__builtin_ctzll(win0), p1 += (uint64_t)__builtin_ctzll(win1);
            p2 += (uint64_t)__builtin_ctzll(win2), p3 += (uint64_t)__builtin_ctzll(win3);
        }
    bad[0] = decode_group(x, s, words, &p0, o0 - dst[0], count[0], dst[0], L, R);
    bad[1] = decode_group(x, s, words, &p1, o1 - dst[1], count[1], dst[1], L, R);
    bad[2] = decode_group(x, s, words, &p2, o2 - dst[2], count[2], dst[2], L, R);
    bad[3] = decode_group(x, s, words, &p3, o3 - dst[3], count[3], dst[3], L, R);
    pos[0] = p0, pos[1] = p1, pos[2] = p2, pos[3] = p3;
}

/* The same four-group loop over a copy of the four groups' stream bits in byte order (each word
 * byte-swapped, 8 zero bytes after): a window is then one unaligned 8-byte load, a byte swap and a
 * shift (not three word loads, two clamps and three shifts), at least 57 bits valid, so R * L <= 56.
 * pos[] stay stream bit positions; `base` is the bit where the copy starts and `last` the last byte
 * a window may start at (a damaged group that runs past the copy reads its zero padding, then
 * fails as below). */
static inline __attribute__((always_inline)) uint64_t window_bytes(const uint8_t *buf, uint64_t last, uint64_t rel) {
    uint64_t i = rel >> 3, v;
    i = i < last ? i : last;
    memcpy(&v, buf + i, 8);
    return __builtin_bswap64(v) << (rel & 7);
}

/* The rounds in x86-64 assembly, for the AVX2 + BMI2 build (L = 12, R = 4): the compiler's own code kept
 * windows and bit positions on the stack, which put a store and a load into each chain of lookups; here
 * every group's window, bit position (as an absolute bit address: the copy's byte address * 8 + the bit)
 * and output pointer stay in registers (15 in all, in a function of its own: asm_rounds). A refill: the
 * byte at bit p, clamped to `last` (as window_bytes; no group starts before the copy: decode_block takes
 * this path only if the four groups' offsets rise), 8 bytes byte-swapped and shifted by p & 7. A lookup
 * at x = win >> 52: its length byte (multi[x] byte 0) shifts the window and is added to p (so the refill
 * waits for no count of the bits used: 10.7 -> 10.2 ms a MiniLM pass, 2026-12-06); its 8 bytes from byte
 * 1 are stored (up to 5 exponents, then bytes the next store overwrites); o += its count (byte 7). */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_ASM_ROUNDS 1
#define ASM_REFILL(w, p)                                                             \
    "movq %[" #p "], %[t]\n\tshrq $3, %[t]\n\tcmpq %[last], %[t]\n\tcmovaq %[last], %[t]\n\t" \
    "movq (%[t]), %[" #w "]\n\tbswapq %[" #w "]\n\tmovl %k[" #p "], %k[t]\n\tandl $7, %k[t]\n\t"    \
    "shlxq %[t], %[" #w "], %[" #w "]\n\t"
#define ASM_STEP(w, o, p)                                                                           \
    "movq %[" #w "], %[x]\n\tshrq $52, %[x]\n\tmovzbl (%[m], %[x], 8), %k[t]\n\t"                      \
    "shlxq %[t], %[" #w "], %[" #w "]\n\taddq %[t], %[" #p "]\n\t"                                    \
    "movq 1(%[m], %[x], 8), %[t]\n\tmovq %[t], (%[" #o "])\n\t"                                        \
    "movzbl 7(%[m], %[x], 8), %k[x]\n\taddq %[x], %[" #o "]\n\t"
#define ASM_ROUND ASM_STEP(w0, o0, a0) ASM_STEP(w1, o1, a1) ASM_STEP(w2, o2, a2) ASM_STEP(w3, o3, a3)

/* decode_4_copied's rounds in the assembly above, in a function of its own: not inlined into the decoder,
 * whose AVX-512 code keeps rbp as a frame pointer, so that the 15 registers the rounds use are free. */
static __attribute__((noinline)) void asm_rounds(uint64_t *a, uint8_t **o, uint8_t *const *end, const uint64_t *multi,
                                                 const uint8_t *last_byte) {
    uint64_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    uint8_t *o0 = o[0], *o1 = o[1], *o2 = o[2], *o3 = o[3];
    for (int64_t n; (n = safe_rounds((uint8_t *[4]){o0, o1, o2, o3}, end, 4)) > 0;) {
        uint64_t w0, w1, w2, w3, t, x;
        __asm__ volatile("1:\n\t" ASM_REFILL(w0, a0) ASM_REFILL(w1, a1) ASM_REFILL(w2, a2) ASM_REFILL(w3, a3)
                         ASM_ROUND ASM_ROUND ASM_ROUND ASM_ROUND
                         "decq %[n]\n\tjnz 1b\n\t"
                         : [w0] "=&r"(w0), [w1] "=&r"(w1), [w2] "=&r"(w2), [w3] "=&r"(w3), [o0] "+r"(o0),
                           [o1] "+r"(o1), [o2] "+r"(o2), [o3] "+r"(o3), [a0] "+r"(a0), [a1] "+r"(a1),
                           [a2] "+r"(a2), [a3] "+r"(a3), [t] "=&r"(t), [x] "=&r"(x), [n] "+m"(n)
                         : [m] "r"(multi), [last] "m"(last_byte)
                         : "memory", "cc");
    }
    a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3, o[0] = o0, o[1] = o1, o[2] = o2, o[3] = o3;
}
#endif

static inline __attribute__((always_inline)) void decode_4_copied(const Tensor *x, const uint8_t *buf, uint64_t last,
                                                                  uint64_t base, uint64_t *pos, const int64_t *count,
                                                                  uint8_t *const *dst, uint8_t **out, const int L,
                                                                  const int R, const int wide) {
    const uint64_t *multi = x->multi;
    uint64_t p0 = pos[0] - base, p1 = pos[1] - base, p2 = pos[2] - base, p3 = pos[3] - base;
    uint8_t *o0 = dst[0], *o1 = dst[1], *o2 = dst[2], *o3 = dst[3];
    uint8_t *end[4];
    for (int q = 0; q < 4; q++)
        end[q] = dst[q] + count[q] - SAFE_END(R);
#ifdef HAVE_ASM_ROUNDS
    if (wide && L == 12 && R == 4) {
        uint64_t at = (uint64_t)(uintptr_t)buf << 3, a0 = at + p0, a1 = at + p1, a2 = at + p2, a3 = at + p3;
        const uint8_t *last_byte = buf + last;
        uint64_t a[4] = {a0, a1, a2, a3};
        uint8_t *o[4] = {o0, o1, o2, o3};
        asm_rounds(a, o, end, multi, last_byte);
        a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], o0 = o[0], o1 = o[1], o2 = o[2], o3 = o[3];
        p0 = a0 - at, p1 = a1 - at, p2 = a2 - at, p3 = a3 - at;
    } else
#endif
    for (int64_t n; (n = safe_rounds((uint8_t *[4]){o0, o1, o2, o3}, end, R)) > 0;)
        for (; n > 0; n--) {
            uint64_t win0 = window_bytes(buf, last, p0) | 1, win1 = window_bytes(buf, last, p1) | 1;
            uint64_t win2 = window_bytes(buf, last, p2) | 1, win3 = window_bytes(buf, last, p3) | 1;
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                STEP(0) STEP(1) STEP(2) STEP(3)
            }
            p0 += (uint64_t)__builtin_ctzll(win0), p1 += (uint64_t)__builtin_ctzll(win1);
            p2 += (uint64_t)__builtin_ctzll(win2), p3 += (uint64_t)__builtin_ctzll(win3);
        }
    pos[0] = p0 + base, pos[1] = p1 + base, pos[2] = p2 + base, pos[3] = p3 + base;
    out[0] = o0, out[1] = o1, out[2] = o2, out[3] = o3;
}
#undef STEP

/* The four groups' last codes after decode_4_copied's rounds (each group's output pointer at[q], bit
 * position pos[q]), still interleaved so that their chains overlap (one group after the other, each code
 * waits for the one before: ~11% of the decode, MiniLM, 2026-12-06, most of it where a group with a verbatim
 * chunk, 64 weights shorter, ended the rounds with the other three 64 codes from their ends). A step looks
 * up every group's next window; a group whose end is too near does it too, but stores to a sink and does not
 * move. First lookups of up to 5 codes while an 8-byte store fits, then one code at a time. Every hit is
 * checked (an invalid window: bad[q]); each step moves at least one group, so at most count[q] steps. */
static inline __attribute__((always_inline)) void finish_4_copied(const Tensor *x, const uint8_t *buf,
                                                                  uint64_t last, uint64_t base, uint64_t *pos,
                                                                  const int64_t *count, uint8_t *const *dst,
                                                                  uint8_t **at, unsigned *bad) {
    const uint64_t *multi = x->multi;
    const uint16_t *single = x->single;
    uint8_t sink[8];
    uint64_t p[4], flags[4] = {0, 0, 0, 0};
    uint8_t *o[4], *end[4];
    for (int q = 0; q < 4; q++)
        p[q] = pos[q] - base, o[q] = at[q], end[q] = dst[q] + count[q];
    for (int any = 1; any;) { /* up to 4 lookups of up to 5 codes per refill (48 bits of the 57) */
        uint64_t w[4];
        any = 0;
        for (int q = 0; q < 4; q++)
            w[q] = window_bytes(buf, last, p[q]) | 1; /* bit 0 marks the bits used, as in decode_group */
        for (int r = 0; r < 4; r++)
            for (int q = 0; q < 4; q++) {
                uint64_t t = multi[w[q] >> 52], e = m_exps(t);
                int go = end[q] - o[q] >= M_STORE;
                memcpy(go ? o[q] : sink, &e, M_STORE);
                o[q] += go ? m_count(t) : 0;
                w[q] <<= go ? m_len(t) : 0;
                flags[q] |= go ? t : 0;
                any |= go;
            }
        for (int q = 0; q < 4; q++)
            p[q] += (uint64_t)__builtin_ctzll(w[q]);
    }
    for (int any = 1; any;) { /* the last (at most 7) codes of each group one at a time */
        any = 0;
        for (int q = 0; q < 4; q++) {
            unsigned e = single[window_bytes(buf, last, p[q]) >> 52];
            int go = o[q] < end[q];
            *(go ? o[q] : sink) = (uint8_t)e;
            o[q] += go;
            p[q] += go ? e >> 8 : 0;
            flags[q] |= go && (e >> 8) == 0 ? M_INVALID : 0;
            any |= go;
        }
    }
    for (int q = 0; q < 4; q++)
        pos[q] = p[q] + base, bad[q] = (flags[q] & M_INVALID) != 0;
}

/* Copy the stream words [w0, w1) byte-swapped into buf, then 8 zero bytes. */
static inline __attribute__((always_inline)) void copy_swapped(uint8_t *restrict buf, const uint32_t *restrict s,
                                                               int64_t w0, int64_t w1) {
    for (int64_t k = w0; k < w1; k++) {
        uint32_t v = __builtin_bswap32(s[k]);
        memcpy(buf + 4 * (k - w0), &v, 4);
    }
    memset(buf + 4 * (w1 - w0), 0, 8);
}

/* bf16 = sign | exponent << 7 | mantissa, for n weights (vectorised by the compiler). */
static inline __attribute__((always_inline)) void assemble(uint16_t *restrict o, const uint8_t *restrict q,
                                                           const uint8_t *restrict e, int64_t n) {
    for (int64_t t = 0; t < n; t++)
        o[t] = (uint16_t)(((q[t] & 0x80) << 8) | (e[t] << 7) | (q[t] & 0x7F));
}

/* The same with AVX-512BW, 32 weights a step (the compiler's AVX2 code takes ~3 times the instructions):
 * sign and mantissa from the zero-extended sm (its low 7 bits, and bit 7 shifted to 15, in one ternary
 * logic step), or the exponent shifted by 7. For the AVX2 + BMI2 build, where the CPU has AVX-512BW. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_ASSEMBLE_512 1
static int assemble_512_found, assemble_512_cpu, assemble_512_use; /* the CPU has it; the cap allows it; in use */
static pthread_once_t assemble_512_once = PTHREAD_ONCE_INIT;

static void assemble_512_init(void) {
    __builtin_cpu_init();
    assemble_512_found = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    assemble_512_cpu = assemble_512_use = assemble_512_found;
}

/* The 32 bf16 words of 32 weights (keep: 0x807F in every word). */
static inline __attribute__((always_inline, target("avx2,avx512f,avx512bw"))) __m512i
words_512(const uint8_t *q, const uint8_t *e, __m512i keep) {
    __m512i sm = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)q));
    __m512i ex = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)e));
    __m512i sign_mantissa = _mm512_ternarylogic_epi32(sm, _mm512_slli_epi16(sm, 8), keep, 0xA8); /* (a | b) & c */
    return _mm512_or_si512(sign_mantissa, _mm512_slli_epi16(ex, 7));
}

__attribute__((target("avx2,avx512f,avx512bw"))) static void assemble_512(uint16_t *restrict o,
                                                                         const uint8_t *restrict q,
                                                                         const uint8_t *restrict e, int64_t n) {
    const __m512i keep = _mm512_set1_epi16(0x807F);
    int64_t t = 0;
    for (; t + 32 <= n; t += 32)
        _mm512_storeu_si512(o + t, words_512(q + t, e + t, keep));
    assemble(o + t, q + t, e + t, n - t);
}

/* assemble_512 that also continues the CRC state c of the output over the n weights written, folding
 * (as crc_vclmul, the same constants) the 256 bytes of each 128 weights while they are in registers, and
 * writing them past the cache (non-temporal stores: nothing in the decoder reads the output again, and
 * the cache keeps the tables). The head up to a 64-byte boundary and the tail go as assemble + crc_update. */
__attribute__((target("avx2,avx512f,avx512bw,vpclmulqdq,pclmul,sse4.1"))) static uint32_t
assemble_crc_512(uint16_t *restrict o, const uint8_t *restrict q, const uint8_t *restrict e, int64_t n, uint32_t c) {
    int64_t head = (int64_t)(((64 - ((uintptr_t)o & 63)) & 63) >> 1);
    head = head < n ? head : n;
    assemble(o, q, e, head);
    c = crc_update(c, (const uint8_t *)o, (size_t)(2 * head));
    o += head, q += head, e += head, n -= head;
    int64_t blocks = n / 128;
    if (blocks > 0) {
        const __m512i keep = _mm512_set1_epi16(0x807F);
        const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x01322d1430, 0x011542778a)); /* crc_vclmul's */
        const __m512i k512 = _mm512_broadcast_i32x4(K512);
        __m512i x[4];
#define WORDS(t) words_512(q + (t), e + (t), keep)
#define FOLD512(a, k, b) \
    _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a, k, 0x00), _mm512_clmulepi64_epi128(a, k, 0x11), b, 0x96)
        for (int l = 0; l < 4; l++) {
            x[l] = WORDS(32 * l);
            _mm512_stream_si512((void *)(o + 32 * l), x[l]);
        }
        x[0] = _mm512_xor_si512(x[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
        for (int64_t b = 1; b < blocks; b++) {
            const int64_t t = 128 * b;
            for (int l = 0; l < 4; l++) {
                __m512i y = WORDS(t + 32 * l);
                _mm512_stream_si512((void *)(o + t + 32 * l), y);
                x[l] = FOLD512(x[l], k2048, y);
            }
        }
        x[1] = FOLD512(x[0], k512, x[1]); /* four 512-bit lanes into one, then its four 128-bit lanes */
        x[2] = FOLD512(x[1], k512, x[2]);
        x[3] = FOLD512(x[2], k512, x[3]);
#undef FOLD512
#undef WORDS
        __m128i y = fold128(_mm512_extracti32x4_epi32(x[3], 0), K128, _mm512_extracti32x4_epi32(x[3], 1));
        y = fold128(y, K128, _mm512_extracti32x4_epi32(x[3], 2));
        y = fold128(y, K128, _mm512_extracti32x4_epi32(x[3], 3));
        c = clmul_finish(y, NULL, 0);
        _mm_sfence();
        o += 128 * blocks, q += 128 * blocks, e += 128 * blocks, n -= 128 * blocks;
    }
    assemble_512(o, q, e, n);
    return crc_update(c, (const uint8_t *)o, (size_t)(2 * n));
}
#endif

/* assemble, in the AVX-512BW code where the build is wide and the CPU has it; with `crc` (the output's
 * CRC fused in: the build is wide, the CPU has VPCLMULQDQ too), continue *crc over what was written. */
static inline __attribute__((always_inline)) void assemble_run(uint16_t *restrict o, const uint8_t *restrict q,
                                                               const uint8_t *restrict e, int64_t n, const int wide,
                                                               uint32_t *crc) {
#ifdef HAVE_ASSEMBLE_512
    if (wide && crc) {
        *crc = assemble_crc_512(o, q, e, n, *crc);
        return;
    }
    if (wide && assemble_512_use) {
        assemble_512(o, q, e, n);
        return;
    }
#endif
    (void)crc;
    assemble(o, q, e, n);
}

/* Use the AVX-512BW assembly if on (and the CPU has it; in the AVX2 + BMI2 build only); returns 1 if it is
 * in use. For the tests. */
int unw_assemble_use(int on) {
#ifdef HAVE_ASSEMBLE_512
    pthread_once(&assemble_512_once, assemble_512_init);
    assemble_512_use = on && assemble_512_cpu;
    return assemble_512_use;
#else
    (void)on;
    return 0;
#endif
}

static void fail(Job *job, int error, int64_t where, int64_t detail) {
    if (!job->error) {
        job->error = error;
        job->where = where;
        job->detail = detail;
    }
}

/* Thread 0's share of the checks: offsets, vchunks, the tail bits. */
static void check_index(const Tensor *x, Job *job) {
    if (x->offsets[0] != 0 || (int64_t)x->offsets[x->n_groups] != x->stream_bits)
        fail(job, BAD_OFFSETS, 0, 0);
    for (int64_t g = 0; g < x->n_groups; g++)
        if (x->offsets[g + 1] < x->offsets[g])
            fail(job, BAD_OFFSETS, g, 0);
    for (int64_t v = 0; v < x->n_verbatim; v++)
        if ((int64_t)x->vchunks[v] >= x->n_chunks || (v && x->vchunks[v] <= x->vchunks[v - 1]))
            fail(job, BAD_VCHUNKS, v, 0);
    int64_t tail = x->stream_bits & 31;
    if ((tail && (x->stream[x->stream_bits >> 5] & ((1u << (32 - tail)) - 1))) || x->stream[x->words - 1])
        fail(job, BAD_TAIL, 0, 0);
}

/* Is the verbatim chunk v (of n weights) valid: zero padding, at least one exponent outside the palette? */
static void check_verbatim(const Tensor *x, Job *job, int64_t v, int64_t n) {
    const uint8_t *e = x->vexp + v * x->cs;
    int outside = 0;
    for (int64_t t = 0; t < n; t++)
        outside |= !x->in_palette[e[t]];
    for (int64_t t = n; t < x->cs; t++)
        if (e[t])
            fail(job, BAD_VEXP_PADDING, v, 0);
    if (!outside)
        fail(job, BAD_VERBATIM_RULE, v, 0);
}

/* Where chunk k starts in the flat output (k <= n_chunks: the end for n_chunks), and its weights. */
static inline int64_t chunk_start(const Tensor *x, int64_t k) { return (k / x->cpr) * x->cols + (k % x->cpr) * x->cs; }
static inline int64_t chunk_width(const Tensor *x, int64_t k) { return min64(x->cs, x->cols - (k % x->cpr) * x->cs); }

/* Decode block b: groups [g0, g1) of an even split of the tensor's groups into n_blocks. */
static inline __attribute__((always_inline)) void decode_block(const Tensor *x, int64_t b, uint8_t *scratch,
                                                               int64_t *vlist, uint8_t *copy, int64_t copy_bytes,
                                                               const int wide) {
    Job *job = &x->blocks[b];
    int64_t g0 = x->n_groups * b / x->n_blocks, g1 = x->n_groups * (b + 1) / x->n_blocks;
    uint32_t pad[2] = {0, 0};
    const uint32_t *s = x->stream;
    int64_t words = x->words;
    if (words < 2) { /* window64 reads two words */
        pad[0] = words ? s[0] : 0;
        s = pad;
        words = 2;
    }
    if (b == 0)
        check_index(x, job);
    int64_t w0 = x->words * b / x->n_blocks, w1 = x->words * (b + 1) / x->n_blocks;
    job->stream_bytes = 4 * (w1 - w0);
    job->crc_stream = ~crc_update(~0u, (const uint8_t *)(x->stream + w0), (size_t)job->stream_bytes);
    int64_t k0 = min64(g0 * x->cpg, x->n_chunks), k1 = min64(g1 * x->cpg, x->n_chunks);
    job->first = k0 < x->n_chunks ? (k0 / x->cpr) * x->cols + (k0 % x->cpr) * x->cs : x->rows * x->cols;
    job->last = k1 < x->n_chunks ? (k1 / x->cpr) * x->cols + (k1 % x->cpr) * x->cs : x->rows * x->cols;
    uint32_t crc_out = ~0u, crc_sm = ~0u;
    int64_t crc_done = job->first;
    uint32_t *fused = NULL; /* the output's CRC fused into its assembly (assemble_crc_512), else per batch */
#ifdef HAVE_ASSEMBLE_512
    if (wide && assemble_512_use && crc_level == 2 && ((uintptr_t)x->out & 1) == 0)
        fused = &crc_out;
#endif
    int64_t lo = 0, hi = x->n_verbatim; /* v = the first verbatim chunk >= k0 (a binary search) */
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if ((int64_t)x->vchunks[mid] < k0)
            lo = mid + 1;
        else
            hi = mid;
    }
    int64_t v = lo;
    for (int64_t g = g0; g < g1 && !job->error; g += 4) {
        int64_t ng = min64(4, g1 - g), count[4] = {0, 0, 0, 0}, nv = 0;
        uint64_t pos[4] = {0, 0, 0, 0};
        unsigned bad[4] = {0, 0, 0, 0};
        uint8_t *dst[4];
        /* The four groups' verbatim chunks: the entries from v on that lie in their chunks, in rising order
         * (a damaged list stops there: check_index fails the tensor; every count stays in [0, the groups' size]) */
        int64_t gk0 = g * x->cpg, gk1 = min64((g + ng) * x->cpg, x->n_chunks);
        for (int64_t vv = v; vv < x->n_verbatim && nv < 4 * x->cpg; vv++, nv++) {
            int64_t k = (int64_t)x->vchunks[vv];
            if (k < gk0 || k >= gk1 || (nv && k <= vlist[nv - 1]))
                break;
            vlist[nv] = k;
        }
        for (int q = 0, i = 0; q < ng; q++) { /* each group's coded weights; their exponents go one after another */
            int64_t qk0 = (g + q) * x->cpg, qk1 = min64(qk0 + x->cpg, x->n_chunks);
            count[q] = chunk_start(x, qk1) - chunk_start(x, qk0);
            for (; i < nv && vlist[i] < qk1; i++)
                count[q] -= chunk_width(x, vlist[i]);
            pos[q] = x->offsets[g + q];
            dst[q] = q ? dst[q - 1] + count[q - 1] : scratch;
        }
        int64_t cw0 = pos[0] >> 5, cw1 = min64(((int64_t)x->offsets[g + ng] >> 5) + 3, words);
        /* the copy holds the four groups' bits if their offsets rise (else check_index fails the tensor): no
         * group then starts before it (decode_4_copied's assembly clamps reads past its end, not before) */
        int rising = ng == 4 && pos[0] <= pos[1] && pos[1] <= pos[2] && pos[2] <= pos[3] &&
                     pos[3] <= (uint64_t)x->offsets[g + 4];
        if (rising && x->L == 12 && cw0 < cw1 && 4 * (cw1 - cw0) + 8 <= copy_bytes) {
            uint8_t *at[4];
            const uint64_t last = (uint64_t)(4 * (cw1 - cw0)), base = (uint64_t)cw0 << 5;
            copy_swapped(copy, s, cw0, cw1);
            decode_4_copied(x, copy, last, base, pos, count, dst, at, 12, 4, wide);
            finish_4_copied(x, copy, last, base, pos, count, dst, at, bad);
        } else if (ng == 4 && x->L == 12)
            decode_4_groups(x, s, words, pos, count, dst, bad, 12, 5);
        else if (ng == 4)
            decode_4_groups(x, s, words, pos, count, dst, bad, x->L, x->L > 7 ? 63 / x->L : 8);
        else
            for (int q = 0; q < ng; q++)
                bad[q] = decode_group(x, s, words, &pos[q], 0, count[q], dst[q], x->L, x->L > 7 ? 63 / x->L : 8);
        for (int q = 0; q < ng; q++) {
            if (bad[q])
                fail(job, BAD_CODE, g + q, 0);
            else if (pos[q] != x->offsets[g + q + 1])
                fail(job, BAD_GROUP_END, g + q, (int64_t)pos[q]);
        }
        /* Assemble. The groups' chunks tile [start, end) of the flat output in order, so every run of
         * coded chunks between two verbatim ones is one stretch of output, sm and exponents. */
        int64_t start = chunk_start(x, gk0), end = chunk_start(x, gk1), run = start;
        const uint8_t *coded = scratch;
        for (int64_t i = 0; i < nv; i++, v++) {
            int64_t at = chunk_start(x, vlist[i]), n = chunk_width(x, vlist[i]);
            assemble_run(x->out + run, x->sm + run, coded, at - run, wide, fused);
            coded += at - run;
            check_verbatim(x, job, v, n);
            assemble_run(x->out + at, x->sm + at, x->vexp + v * x->cs, n, wide, fused);
            run = at + n;
        }
        assemble_run(x->out + run, x->sm + run, coded, end - run, wide, fused);
        start = end;
        if (start - crc_done >= CRC_BATCH || g + ng >= g1) { /* CRC what was just written, while it is in cache */
            if (!fused)
                crc_out = crc_update(crc_out, (const uint8_t *)(x->out + crc_done), (size_t)(2 * (start - crc_done)));
            crc_sm = crc_update(crc_sm, x->sm + crc_done, (size_t)(start - crc_done));
            crc_done = start;
        }
    }
    job->crc_out = ~crc_out;
    job->crc_sm = ~crc_sm;
}

/* A thread: take the next block until none is left. */
static inline __attribute__((always_inline)) void *work_body(void *arg, const int wide) {
    Tensor *x = arg;
    uint8_t *scratch = malloc((size_t)(4 * x->cpg * x->cs + 64));
    int64_t *vlist = malloc((size_t)(4 * x->cpg) * sizeof(int64_t)); /* four groups' verbatim chunks */
    /* room for four valid groups' stream words (at most L bits per weight) and the three words after */
    int64_t copy_bytes = (4 * x->cpg * x->cs * x->L + 7) / 8 + 32;
    uint8_t *copy = malloc((size_t)copy_bytes);
    for (int64_t b; (b = __atomic_fetch_add(&x->next_block, 1, __ATOMIC_RELAXED)) < x->n_blocks;) {
        if (scratch && vlist && copy)
            decode_block(x, b, scratch, vlist, copy, copy_bytes, wide);
        else
            fail(&x->blocks[b], NO_MEMORY, 0, 0);
    }
    free(scratch);
    free(vlist);
    free(copy);
    return NULL;
}

TWO_BUILDS_FLAG(work, work_body) /* builds.h: any CPU, or AVX2 + BMI2 (told so: wide = 1) */

/* Use the AVX2 + BMI2 build if wide (and the CPU has it); returns 1 if it is in use. For the tests. */
int unw_decode_use(int wide) { return builds_use(wide); }

/* Cap every path at instruction set isa (builds.h's ISA_*: UNFIRE_CPU_ISA, set by decode_c.py when it loads
 * the library), each then in use where the CPU has it (the _use calls above choose below the cap). Returns
 * the paths in use: bit 0 the AVX2 + BMI2 build, bit 1 the AVX-512BW assembly, bits 2-3 the CRC level. */
int unw_isa(int isa) {
    int wide = builds_isa(isa), assembly = 0, crc = crc_isa(isa);
#ifdef HAVE_ASSEMBLE_512
    pthread_once(&assemble_512_once, assemble_512_init);
    assemble_512_cpu = assemble_512_use = assemble_512_found && isa >= ISA_AVX512;
    assembly = assemble_512_use;
#endif
    return wide | assembly << 1 | crc << 2;
}

/* Check and decode a Huffman-form tensor into out (uint16 [rows * cols]). The header was checked by
 * the caller (array lengths as FORMAT.md 3.2 implies, code lengths valid, single = the decoding
 * table of exponents and multi the multi-symbol one, both from unw_tables). With threads > 1 the work
 * is cut into blocks of about block_weights weights (whole groups), which the threads take in turn.
 * crc_io[0..5]: the expected CRC-32 of sm, stream, offsets, vchunks, vexp and the data. Returns OK or an
 * error code, with crc_io[6], crc_io[7] saying
 * where (a group and a bit position, a verbatim entry, which array). */
int unw_decode(const uint32_t *stream, int64_t words, int64_t stream_bits, const uint32_t *offsets,
               const uint32_t *vchunks, int64_t n_verbatim, const uint8_t *vexp, const uint8_t *sm,
               const uint8_t *palette, int p, const uint16_t *single, const uint64_t *multi, int L, int64_t rows,
               int64_t cols, int64_t cs, int64_t cpg, int threads,
               int64_t block_weights, uint32_t *crc_io, uint16_t *out) {
    Tensor x;
    crc_setup();
    builds_setup();
#ifdef HAVE_ASSEMBLE_512
    pthread_once(&assemble_512_once, assemble_512_init);
#endif
    memset(&x, 0, sizeof x);
    x.stream = stream, x.offsets = offsets, x.vchunks = vchunks, x.words = words, x.stream_bits = stream_bits;
    x.n_verbatim = n_verbatim, x.vexp = vexp, x.sm = sm, x.single = single, x.multi = multi;
    x.L = L, x.rows = rows, x.cols = cols, x.cs = cs, x.cpg = cpg;
    x.cpr = (cols + cs - 1) / cs, x.n_chunks = rows * x.cpr, x.n_groups = (x.n_chunks + cpg - 1) / cpg, x.out = out;
    for (int i = 0; i < p; i++)
        x.in_palette[palette[i]] = 1;
    threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    x.n_blocks = 1; /* one thread: one block; more: blocks of ~block_weights, so a slowed thread takes fewer */
    if (threads > 1) {
        int64_t per_block = block_weights / (cpg * cs) > 1 ? block_weights / (cpg * cs) : 1;
        x.n_blocks = (x.n_groups + per_block - 1) / per_block;
        x.n_blocks = x.n_blocks < threads ? min64(threads, x.n_groups) : x.n_blocks;
        x.n_blocks = x.n_blocks < 1 ? 1 : x.n_blocks;
    }
    Job one, *blocks = x.n_blocks == 1 ? &one : calloc((size_t)x.n_blocks, sizeof(Job));
    if (!blocks)
        return NO_MEMORY;
    memset(&one, 0, sizeof one);
    x.blocks = blocks;
    run_threads(work, &x, 0, (int)min64(threads, x.n_blocks));
    int error = OK;
    for (int64_t b = 0; b < x.n_blocks && !error; b++)
        if ((error = blocks[b].error)) {
            crc_io[6] = (uint32_t)blocks[b].where;
            crc_io[7] = (uint32_t)blocks[b].detail;
        }
    uint32_t crc_out = blocks[0].crc_out, crc_sm = blocks[0].crc_sm, crc_stream = blocks[0].crc_stream;
    CrcShift out_shift = {-1, 0}, sm_shift = {-1, 0}, stream_shift = {-1, 0};
    for (int64_t b = 1; b < x.n_blocks && !error; b++) {
        crc_out = crc_join(crc_out, blocks[b].crc_out, 2 * (blocks[b].last - blocks[b].first), &out_shift);
        crc_sm = crc_join(crc_sm, blocks[b].crc_sm, blocks[b].last - blocks[b].first, &sm_shift);
        crc_stream = crc_join(crc_stream, blocks[b].crc_stream, blocks[b].stream_bytes, &stream_shift);
    }
    if (blocks != &one)
        free(blocks);
    if (error)
        return error;
    uint32_t got[6] = {crc_sm, crc_stream,
                       unw_crc32((const uint8_t *)offsets, 4 * (x.n_groups + 1), 1),
                       unw_crc32((const uint8_t *)vchunks, 4 * n_verbatim, 1), unw_crc32(vexp, n_verbatim * cs, 1),
                       crc_out};
    for (int a = 0; a < 6; a++)
        if (got[a] != crc_io[a]) {
            crc_io[6] = (uint32_t)a;
            crc_io[7] = got[a];
            return BAD_CRC;
        }
    return OK;
}
