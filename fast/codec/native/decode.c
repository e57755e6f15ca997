/* The Unweight decoder for the CPU, in C (FORMAT.md sections 3.4-3.6): Huffman form -> bf16.
 *
 * fast/codec/decode_c.py builds this file with the system C compiler on first use (as the
 * encoder, native/encode.c), loads it with ctypes and calls:
 *
 *   unw_crc32          CRC-32 (IEEE, the value zlib.crc32 gives) of a buffer, in threads (crc32.h)
 *   unw_crc_use        which CRC-32 path to use at most (for the tests)
 *   unw_decode_use     whether to use the AVX2 + BMI2 build of the decoding loop (for the tests)
 *   unw_multi_table    the multi-symbol decoding table, from the one-symbol table (FORMAT.md 3.3)
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
 *     is, gives up to 4 whole codes that fit in those L bits at once: their exponents (4 bytes,
 *     written in one store) and their total length. With L = 12 and ~2.7-bit codes that is ~4
 *     weights per lookup. The last few weights of a group go one code at a time, so a group never
 *     reads a code past its own count;
 *   - an invalid window is an entry of 1 symbol and 0 bits with a flag: the loop always advances
 *     and stays stuck at that window (see decode_4_groups for how it is caught);
 *   - four groups are decoded at once (independent chains the CPU overlaps), in AVX2 + BMI2 code
 *     where the CPU has it (chosen at run time).
 * The CRCs of the output and of sm are computed per block while the data is in cache, and joined
 * (crc32_combine, as zlib does) in block order.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "builds.h"
#include "crc32.h"
#include "threads.h"

#define INVALID 0x80    /* multi_meta flag: the window starts with no valid code */
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

/* Use at most CRC path `level` (0 tables, 1 PCLMULQDQ, 2 VPCLMULQDQ; -1 the CPU's best); the one in use. */
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

/* single[w] = exponent | length << 8 for every L-bit window w (length 0: no code starts there).
 * multi_exp[w] = the exponents of the (up to 4) whole codes that lie inside w, one per byte;
 * multi_meta[w] = their total length | count << 8, or INVALID | 1 << 8 if w starts with no code (the
 * length sits in bits 0-4, so `x << (meta & 63)` is a shift by the length alone). */
void unw_multi_table(const uint16_t *single, int L, uint32_t *multi_exp, uint16_t *multi_meta) {
    uint32_t mask = (1u << L) - 1;
    for (uint32_t w = 0; w <= mask; w++) {
        uint32_t exps = 0, used = 0, k = 0;
        while (k < 4) {
            uint16_t e = single[(w << used) & mask]; /* the bits after `used`, zeros shifted in */
            uint32_t len = e >> 8;
            if (len == 0 || used + len > (uint32_t)L) /* invalid, or not wholly inside w */
                break;
            exps |= (uint32_t)(e & 0xFF) << (8 * k);
            used += len;
            k++;
        }
        multi_exp[w] = exps;
        multi_meta[w] = k ? (uint16_t)(used | k << 8) : (uint16_t)(INVALID | 1 << 8);
    }
}

/* ---- decoding ---- */

enum { OK, BAD_OFFSETS, BAD_VCHUNKS, BAD_VEXP_PADDING, BAD_VERBATIM_RULE, BAD_TAIL, BAD_CODE, BAD_GROUP_END,
       BAD_CRC, NO_MEMORY };

typedef struct {
    const uint32_t *stream, *offsets, *vchunks;
    int64_t words, stream_bits, n_verbatim;
    const uint8_t *vexp, *sm;
    const uint16_t *single, *multi_meta;
    const uint32_t *multi_exp;
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
    const uint16_t *meta = x->multi_meta, *single = x->single;
    const uint32_t *mexp = x->multi_exp;
    uint64_t pos = *pos_io;
    unsigned bad = 0;
    while (i + 4 <= count) { /* up to R lookups of up to 4 codes each per refill, while 4 codes are left */
        uint64_t win = window64(s, words, pos) | 1; /* bit 0, never read (R * L < 64), marks the bits used */
        for (int r = 0; r < R && i + 4 <= count; r++) {
            uint64_t w = win >> (64 - L);
            unsigned m = meta[w];
            memcpy(dst + i, &mexp[w], 4);
            i += m >> 8;
            win <<= m & 63;
            bad |= m;
        }
        pos += (uint64_t)__builtin_ctzll(win); /* the mark moved up by the bits used */
    }
    for (; i < count; i++) { /* the last (at most 3) codes one at a time */
        unsigned e = single[window64(s, words, pos) >> (64 - L)];
        dst[i] = (uint8_t)e;
        pos += e >> 8;
        bad |= (e >> 8) == 0 ? INVALID : 0;
    }
    *pos_io = pos;
    return bad & INVALID;
}

/* Four groups at once (their chains of lookups are independent, so the CPU overlaps them), as far as
 * all four have R * 4 codes left; each then finishes alone in decode_group. Each group's state is its
 * window, bit position and output pointer (few enough to stay in registers). The lookups here are not
 * checked one by one (that flag cost ~8%): an invalid window consumes no bits, so the group stays stuck
 * there; decode_group, which checks every hit, then meets it again, or the group ends before its next
 * offset (BAD_GROUP_END); in the last case left (stuck exactly at that offset), the data's CRC-32 differs. */
static inline __attribute__((always_inline)) void decode_4_groups(const Tensor *x, const uint32_t *s, int64_t words,
                                                                  uint64_t *pos, const int64_t *count,
                                                                  uint8_t *const *dst, unsigned *bad, const int L,
                                                                  const int R) {
    const uint16_t *meta = x->multi_meta;
    const uint32_t *mexp = x->multi_exp;
    uint64_t p0 = pos[0], p1 = pos[1], p2 = pos[2], p3 = pos[3];
    uint8_t *o0 = dst[0], *o1 = dst[1], *o2 = dst[2], *o3 = dst[3];
    uint8_t *const e0 = dst[0] + count[0] - 4 * R, *const e1 = dst[1] + count[1] - 4 * R;
    uint8_t *const e2 = dst[2] + count[2] - 4 * R, *const e3 = dst[3] + count[3] - 4 * R;
#define STEP(q)                                   \
    {                                             \
        uint64_t w = win##q >> (64 - L);          \
        uint32_t m = meta[w];                     \
        uint32_t e = mexp[w];                     \
        memcpy(o##q, &e, 4);                      \
        o##q += m >> 8;                           \
        win##q <<= m & 63;                        \
    }
    while (o0 <= e0 && o1 <= e1 && o2 <= e2 && o3 <= e3) {
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
#undef STEP
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

static inline __attribute__((always_inline)) void decode_4_copied(const Tensor *x, const uint8_t *buf, uint64_t last,
                                                                  uint64_t base, uint64_t *pos, const int64_t *count,
                                                                  uint8_t *const *dst, uint8_t **out, const int L,
                                                                  const int R) {
    const uint16_t *meta = x->multi_meta;
    const uint32_t *mexp = x->multi_exp;
    uint64_t p0 = pos[0] - base, p1 = pos[1] - base, p2 = pos[2] - base, p3 = pos[3] - base;
    uint8_t *o0 = dst[0], *o1 = dst[1], *o2 = dst[2], *o3 = dst[3];
    uint8_t *const e0 = dst[0] + count[0] - 4 * R, *const e1 = dst[1] + count[1] - 4 * R;
    uint8_t *const e2 = dst[2] + count[2] - 4 * R, *const e3 = dst[3] + count[3] - 4 * R;
#define STEP(q)                                   \
    {                                             \
        uint64_t w = win##q >> (64 - L);          \
        uint32_t m = meta[w];                     \
        uint32_t e = mexp[w];                     \
        memcpy(o##q, &e, 4);                      \
        o##q += m >> 8;                           \
        win##q <<= m & 63;                        \
    }
    while (o0 <= e0 && o1 <= e1 && o2 <= e2 && o3 <= e3) {
        uint64_t win0 = window_bytes(buf, last, p0) | 1, win1 = window_bytes(buf, last, p1) | 1;
        uint64_t win2 = window_bytes(buf, last, p2) | 1, win3 = window_bytes(buf, last, p3) | 1;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            STEP(0) STEP(1) STEP(2) STEP(3)
        }
        p0 += (uint64_t)__builtin_ctzll(win0), p1 += (uint64_t)__builtin_ctzll(win1);
        p2 += (uint64_t)__builtin_ctzll(win2), p3 += (uint64_t)__builtin_ctzll(win3);
    }
#undef STEP
    pos[0] = p0 + base, pos[1] = p1 + base, pos[2] = p2 + base, pos[3] = p3 + base;
    out[0] = o0, out[1] = o1, out[2] = o2, out[3] = o3;
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

/* Decode block b: groups [g0, g1) of an even split of the tensor's groups into n_blocks. */
static inline __attribute__((always_inline)) void decode_block(const Tensor *x, int64_t b, uint8_t *scratch,
                                                               uint8_t *copy, int64_t copy_bytes) {
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
        int64_t ng = min64(4, g1 - g), count[4] = {0, 0, 0, 0}, vv = v;
        uint64_t pos[4] = {0, 0, 0, 0};
        unsigned bad[4] = {0, 0, 0, 0};
        uint8_t *dst[4];
        for (int q = 0; q < ng; q++) { /* each group's coded weights; their exponents go one after another */
            int64_t gk0 = (g + q) * x->cpg, gk1 = min64(gk0 + x->cpg, x->n_chunks), j = gk0 % x->cpr;
            for (int64_t k = gk0; k < gk1; k++) {
                if (vv < x->n_verbatim && x->vchunks[vv] == (uint64_t)k)
                    vv++;
                else
                    count[q] += min64(x->cs, x->cols - j * x->cs);
                if (++j == x->cpr)
                    j = 0;
            }
            pos[q] = x->offsets[g + q];
            dst[q] = q ? dst[q - 1] + count[q - 1] : scratch;
        }
        int64_t cw0 = pos[0] >> 5, cw1 = min64(((int64_t)x->offsets[g + ng] >> 5) + 3, words);
        if (ng == 4 && x->L == 12 && cw0 < cw1 && 4 * (cw1 - cw0) + 8 <= copy_bytes) {
            uint8_t *at[4];
            copy_swapped(copy, s, cw0, cw1);
            decode_4_copied(x, copy, (uint64_t)(4 * (cw1 - cw0)), (uint64_t)cw0 << 5, pos, count, dst, at, 12, 4);
            for (int q = 0; q < 4; q++)
                bad[q] = decode_group(x, s, words, &pos[q], at[q] - dst[q], count[q], dst[q], 12, 5);
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
        /* Assemble. The groups' chunks tile [start, ...) of the flat output in order, so every run of
         * coded chunks between two verbatim ones is one stretch of output, sm and exponents. */
        int64_t gk0 = g * x->cpg, gk1 = min64((g + ng) * x->cpg, x->n_chunks), j = gk0 % x->cpr;
        int64_t start = (gk0 / x->cpr) * x->cols + j * x->cs, run = start;
        const uint8_t *coded = scratch;
        for (int64_t k = gk0; k < gk1; k++) {
            int64_t n = min64(x->cs, x->cols - j * x->cs);
            if (v < x->n_verbatim && x->vchunks[v] == (uint64_t)k) {
                assemble(x->out + run, x->sm + run, coded, start - run);
                coded += start - run;
                check_verbatim(x, job, v, n);
                assemble(x->out + start, x->sm + start, x->vexp + v * x->cs, n);
                v++;
                run = start + n;
            }
            start += n;
            if (++j == x->cpr)
                j = 0;
        }
        assemble(x->out + run, x->sm + run, coded, start - run);
        if (start - crc_done >= CRC_BATCH || g + ng >= g1) { /* CRC what was just written, while it is in cache */
            crc_out = crc_update(crc_out, (const uint8_t *)(x->out + crc_done), (size_t)(2 * (start - crc_done)));
            crc_sm = crc_update(crc_sm, x->sm + crc_done, (size_t)(start - crc_done));
            crc_done = start;
        }
    }
    job->crc_out = ~crc_out;
    job->crc_sm = ~crc_sm;
}

/* A thread: take the next block until none is left. */
static inline __attribute__((always_inline)) void *work_body(void *arg) {
    Tensor *x = arg;
    uint8_t *scratch = malloc((size_t)(4 * x->cpg * x->cs + 64));
    /* room for four valid groups' stream words (at most L bits per weight) and the three words after */
    int64_t copy_bytes = (4 * x->cpg * x->cs * x->L + 7) / 8 + 32;
    uint8_t *copy = malloc((size_t)copy_bytes);
    for (int64_t b; (b = __atomic_fetch_add(&x->next_block, 1, __ATOMIC_RELAXED)) < x->n_blocks;) {
        if (scratch && copy)
            decode_block(x, b, scratch, copy, copy_bytes);
        else
            fail(&x->blocks[b], NO_MEMORY, 0, 0);
    }
    free(scratch);
    free(copy);
    return NULL;
}

TWO_BUILDS(work, work_body) /* builds.h: any CPU, or AVX2 + BMI2 */

/* Use the AVX2 + BMI2 build if wide (and the CPU has it); returns 1 if it is in use. For the tests. */
int unw_decode_use(int wide) { return builds_use(wide); }

/* Check and decode a Huffman-form tensor into out (uint16 [rows * cols]). The header was checked by
 * the caller (array lengths as FORMAT.md 3.2 implies, code lengths valid, single = the decoding
 * table of exponents, multi_* from unw_multi_table). With threads > 1 the work is cut into blocks of
 * about block_weights weights (whole groups), which the threads take in turn. crc_io[0..5]: the expected CRC-32 of sm, stream,
 * offsets, vchunks, vexp and the data. Returns OK or an error code, with crc_io[6], crc_io[7] saying
 * where (a group and a bit position, a verbatim entry, which array). */
int unw_decode(const uint32_t *stream, int64_t words, int64_t stream_bits, const uint32_t *offsets,
               const uint32_t *vchunks, int64_t n_verbatim, const uint8_t *vexp, const uint8_t *sm,
               const uint8_t *palette, int p, const uint16_t *single, const uint32_t *multi_exp,
               const uint16_t *multi_meta, int L, int64_t rows, int64_t cols, int64_t cs, int64_t cpg, int threads,
               int64_t block_weights, uint32_t *crc_io, uint16_t *out) {
    Tensor x;
    crc_setup();
    builds_setup();
    memset(&x, 0, sizeof x);
    x.stream = stream, x.offsets = offsets, x.vchunks = vchunks, x.words = words, x.stream_bits = stream_bits;
    x.n_verbatim = n_verbatim, x.vexp = vexp, x.sm = sm, x.single = single, x.multi_meta = multi_meta;
    x.multi_exp = multi_exp, x.L = L, x.rows = rows, x.cols = cols, x.cs = cs, x.cpg = cpg;
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
