/* The Unweight encoder for the CPU, in C (FORMAT.md sections 2 and 3).
 *
 * fast/codec/encode_c.py builds this file with the system C compiler on first use, loads it
 * with ctypes and calls, per tensor:
 *
 *   unw_scan           pass 1: sm byte of every weight, exponent counts, each chunk's min and max exponent
 *   unw_palette        the most frequent exponents
 *   unw_verbatim       which chunks hold an exponent outside the palette (from the min/max, or a scan)
 *   unw_gather_vexp    the verbatim chunks and their exponents
 *   unw_code_lengths   package-merge, as reference/codec/huffman.py does it (same ties)
 *   unw_pack           pass 2: the codes of the coded chunks' exponents, MSB first, and group offsets
 *
 * Plain C99 with POSIX threads (plus unsigned __int128 in unw_code_lengths, which GCC and Clang
 * have), no other dependency. Weights are bf16 bit patterns (uint16, C order) viewed as rows x cols;
 * chunk (r, j) holds columns [j * cs, min((j + 1) * cs, cols)) of row r and has id r * cpr + j,
 * cpr = ceil(cols / cs); chunks in id order are the weights in order.
 *
 * Threads: the two passes split the chunks into `threads` ranges of whole groups (range t holds
 * groups [t * G / T, (t + 1) * G / T)). Each range of pass 1 counts exponents apart; pass 2 knows
 * from those counts (less the verbatim chunks') where each range's bits start, so the ranges are
 * packed at once into buffers of their own, then copied into place.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "threads.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "unw_pack reads four bf16 weights as one little-endian uint64"
#endif

#define EXPONENT(b) (((b) >> 7) & 0xFF)

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

typedef struct { /* a tensor's geometry, and the chunks [k0, k1) of one range */
    const uint16_t *bits;
    int64_t rows, cols, cs, cpr, k0, k1;
} Range;

static Range range_of(const uint16_t *bits, int64_t rows, int64_t cols, int64_t cs, int64_t cpg, int t, int threads) {
    int64_t cpr = (cols + cs - 1) / cs, n_chunks = rows * cpr, n_groups = (n_chunks + cpg - 1) / cpg;
    Range g = {bits, rows, cols, cs, cpr, 0, 0};
    g.k0 = min64(n_chunks, n_groups * t / threads * cpg);
    g.k1 = min64(n_chunks, n_groups * (t + 1) / threads * cpg);
    return g;
}

/* ---- pass 1 ---- */

typedef struct {
    Range g;
    uint8_t *sm, *chunk_min, *chunk_max;
    int64_t *counts; /* [256], this range's */
} ScanJob;

/* sm[i] = sign (bit 15 -> bit 7) | mantissa (bits 0..6); counts[e] += weights with exponent e;
 * chunk_min/chunk_max[k] = the smallest and largest exponent in chunk k. The sm and min/max loop
 * vectorises. The histogram uses four tables in turn: neighbouring weights often share an
 * exponent, and increments of one counter in a row would wait on each other. */
static void *scan_range(void *arg) {
    ScanJob *job = arg;
    Range g = job->g;
    uint64_t h[4][256] = {{0}};
    for (int64_t k = g.k0, r = k / g.cpr, j = k % g.cpr; k < g.k1; k++) {
        int64_t first = r * g.cols + j * g.cs, n = min64(g.cs, g.cols - j * g.cs), t;
        const uint16_t *p = g.bits + first;
        uint8_t *q = job->sm + first, lo = 255, hi = 0;
        for (t = 0; t < n; t++) {
            uint8_t e = (uint8_t)EXPONENT(p[t]);
            q[t] = (uint8_t)((p[t] & 0x7F) | ((p[t] >> 8) & 0x80));
            lo = e < lo ? e : lo;
            hi = e > hi ? e : hi;
        }
        job->chunk_min[k] = lo;
        job->chunk_max[k] = hi;
        for (t = 0; t + 4 <= n; t += 4) {
            h[0][EXPONENT(p[t])]++;
            h[1][EXPONENT(p[t + 1])]++;
            h[2][EXPONENT(p[t + 2])]++;
            h[3][EXPONENT(p[t + 3])]++;
        }
        for (; t < n; t++)
            h[0][EXPONENT(p[t])]++;
        if (++j == g.cpr) {
            j = 0;
            r++;
        }
    }
    for (int e = 0; e < 256; e++)
        job->counts[e] = (int64_t)(h[0][e] + h[1][e] + h[2][e] + h[3][e]);
    return NULL;
}

/* Pass 1 over `threads` ranges; counts is [threads][256], one histogram per range. */
int unw_scan(const uint16_t *bits, int64_t rows, int64_t cols, int64_t cs, int64_t cpg, int threads, uint8_t *sm,
             int64_t *counts, uint8_t *chunk_min, uint8_t *chunk_max) {
    ScanJob jobs[MAX_THREADS];
    if (threads < 1 || threads > MAX_THREADS)
        return -1;
    for (int t = 0; t < threads; t++) {
        ScanJob job = {range_of(bits, rows, cols, cs, cpg, t, threads), sm, chunk_min, chunk_max, counts + 256 * t};
        jobs[t] = job;
    }
    run_threads(scan_range, jobs, sizeof(ScanJob), threads);
    return 0;
}

/* ---- palette ---- */

/* palette[0 .. returned) = the at most palette_size exponents with the largest counts (summed over
 * the threads ranges of counts), largest first, ties by smaller exponent (FORMAT.md section 2). */
int unw_palette(const int64_t *counts, int threads, int palette_size, uint8_t *palette) {
    int64_t total[256] = {0};
    int p = 0;
    for (int t = 0; t < threads; t++)
        for (int e = 0; e < 256; e++)
            total[e] += counts[256 * t + e];
    for (int e = 0; e < 256; e++) { /* insertion sort of the used exponents: count down, exponent up */
        if (total[e] == 0)
            continue;
        int i = p < palette_size ? p++ : palette_size;
        for (; i > 0 && total[palette[i - 1]] < total[e]; i--)
            if (i < palette_size)
                palette[i] = palette[i - 1];
        if (i < palette_size)
            palette[i] = (uint8_t)e;
    }
    return p;
}

/* ---- verbatim chunks ---- */

/* flags[k] = 1 if chunk k holds an exponent outside the palette (a verbatim chunk), else 0;
 * vcounts[t][e] += the verbatim chunks' weights with exponent e, by range as in unw_scan. A chunk
 * whose exponents lie within [min, max] of a consecutive palette is coded; one with an exponent
 * outside [min, max] is verbatim; only for a palette with gaps are the others scanned. Returns the
 * number of verbatim chunks. */
int64_t unw_verbatim(const uint16_t *bits, int64_t rows, int64_t cols, int64_t cs, int64_t cpg, int threads,
                     const uint8_t *chunk_min, const uint8_t *chunk_max, const uint8_t *palette, int p, uint8_t *flags,
                     int64_t *vcounts) {
    int64_t verbatim = 0;
    uint8_t in_palette[256] = {0}, lo = 255, hi = 0;
    for (int i = 0; i < p; i++) {
        in_palette[palette[i]] = 1;
        lo = palette[i] < lo ? palette[i] : lo;
        hi = palette[i] > hi ? palette[i] : hi;
    }
    int gaps = p > 0 && hi - lo + 1 != p;
    for (int t = 0; t < threads; t++) {
        Range g = range_of(bits, rows, cols, cs, cpg, t, threads);
        for (int64_t k = g.k0, r = k / g.cpr, j = k % g.cpr; k < g.k1; k++) {
            unsigned bad = p == 0 || chunk_min[k] < lo || chunk_max[k] > hi;
            if (bad || gaps) {
                int64_t n = min64(cs, cols - j * cs);
                const uint16_t *q = bits + r * cols + j * cs;
                for (int64_t i = 0; i < n && !bad; i++)
                    bad |= in_palette[EXPONENT(q[i])] == 0;
                if (bad) {
                    verbatim++;
                    for (int64_t i = 0; i < n; i++)
                        vcounts[256 * t + EXPONENT(q[i])]++;
                }
            }
            flags[k] = (uint8_t)bad;
            if (++j == g.cpr) {
                j = 0;
                r++;
            }
        }
    }
    return verbatim;
}

/* vchunks = the ids of the chunks with flags[k] = 1, in order; vexp[v, :] = their exponents (zero
 * past a short chunk's end). */
void unw_gather_vexp(const uint16_t *bits, int64_t rows, int64_t cols, int64_t cs, const uint8_t *flags,
                     int64_t *vchunks, uint8_t *vexp) {
    int64_t cpr = (cols + cs - 1) / cs, v = 0;
    for (int64_t r = 0, k = 0; r < rows; r++) {
        for (int64_t j = 0; j < cpr; j++, k++) {
            if (!flags[k])
                continue;
            int64_t n = min64(cs, cols - j * cs);
            const uint16_t *q = bits + r * cols + j * cs;
            for (int64_t t = 0; t < cs; t++)
                vexp[v * cs + t] = t < n ? (uint8_t)EXPONENT(q[t]) : 0;
            vchunks[v++] = k;
        }
    }
}

/* ---- code lengths ---- */

/* Code lengths <= max_length for p <= 25 symbols with these counts, exactly as
 * reference.codec.huffman.code_lengths computes them (see its docstring): package-merge, an entry
 * being (value, the symbols it contains). Here the symbols are counted in one 128-bit integer, 5
 * bits per symbol (a symbol occurs at most once per level, so at most max_length <= 16 times).
 * Returns 0, or -1 for what the reference rejects or leaves to its trivial cases (the caller then
 * asks Python). */
typedef struct {
    int64_t value;
    unsigned __int128 symbols;
} Entry;

static int package_merge(const int64_t *counts, int p, int max_length, uint8_t *lengths) {
    Entry singles[25], current[50], packages[25], merged[50];
    int n = 0, m, i, a, b;
    if (p > 25 || max_length < 1 || max_length > 16)
        return -1;
    for (i = 0; i < p; i++) {
        if (counts[i] < 0)
            return -1;
        lengths[i] = 0;
        if (counts[i] > 0) { /* insertion sort by (count, symbol) */
            Entry e = {counts[i], (unsigned __int128)1 << (5 * i)};
            for (a = n; a > 0 && singles[a - 1].value > e.value; a--)
                singles[a] = singles[a - 1];
            singles[a] = e;
            n++;
        }
    }
    if (n <= 2 || n > (1 << max_length))
        return -1;
    memcpy(current, singles, sizeof(Entry) * n);
    m = n;
    for (int level = 0; level < max_length - 1; level++) {
        int np = m / 2;
        for (i = 0; i < np; i++) {
            packages[i].value = current[2 * i].value + current[2 * i + 1].value;
            packages[i].symbols = current[2 * i].symbols + current[2 * i + 1].symbols;
        }
        for (a = 0, b = 0, m = 0; a < n || b < np; m++) /* on equal value the single goes first */
            merged[m] = (b == np || (a < n && singles[a].value <= packages[b].value)) ? singles[a++] : packages[b++];
        memcpy(current, merged, sizeof(Entry) * m);
    }
    unsigned __int128 total = 0;
    for (i = 0; i < 2 * n - 2; i++)
        total += current[i].symbols;
    for (i = 0; i < p; i++)
        lengths[i] = (uint8_t)((total >> (5 * i)) & 31);
    return 0;
}

/* The code lengths of the palette's symbols from their counts over the coded chunks (unw_scan's
 * counts less unw_verbatim's, summed over the ranges); returns the stream's length in bits, or -1
 * where package_merge declines. */
int64_t unw_code_lengths(const int64_t *counts, const int64_t *vcounts, int threads, const uint8_t *palette, int p,
                         int max_length, uint8_t *lengths) {
    int64_t coded[256] = {0}, bits = 0;
    for (int i = 0; i < p; i++)
        for (int t = 0; t < threads; t++)
            coded[i] += counts[256 * t + palette[i]] - vcounts[256 * t + palette[i]];
    if (package_merge(coded, p, max_length, lengths) != 0)
        return -1;
    for (int i = 0; i < p; i++)
        bits += coded[i] * lengths[i];
    return bits;
}

/* ---- pass 2 ---- */

/* The bits are first written as a big-endian byte stream, the classic way: `acc` holds `used` bits
 * at its top (used < 8 after a flush) and the next code, left-aligned, goes in below them (code >>
 * used); after every 4 codes of <= 12 bits (or 3 of <= 16) the 8 bytes of acc are stored
 * big-endian at `out`, which then moves on by the whole bytes written. Finally each 32-bit word is
 * byte-swapped: a big-endian word read as little-endian is the format's MSB-first word.
 *
 * When the palette is consecutive exponents [lo, lo + p), p <= 16, and codes are <= 12 bits, four
 * weights at a time take two lookups instead of four: one 8-byte load holds them,
 * ((w >> 7) & 0x00FF00FF00FF00FF) - lo * 0x0001000100010001 puts their palette offsets in four
 * 16-bit lanes (a coded chunk holds no exponent below lo: no borrow between lanes), and
 * lanes | lanes >> 12 puts s0 | s1 << 4 in byte 0 and s2 | s3 << 4 in byte 4; pair_code[s0 | s1 << 4]
 * is the two codes concatenated and left-aligned, pair_len their total length. */
typedef struct {
    uint64_t code[256], pair_code[256]; /* by exponent / by pair of palette offsets; left-aligned */
    uint8_t len[256], pair_len[256];
    int pairs, per_flush;
    uint64_t lanes_lo;
} Codes;

typedef struct {
    Range g;
    const Codes *codes;
    const uint8_t *flags;
    int64_t cpg, first_bit; /* where this range's bits start in the stream */
    uint32_t *words;        /* word 0 = stream word first_bit / 32 */
    int64_t *offsets;
} PackJob;

static inline void store_be64(uint8_t *p, uint64_t v) {
    for (int b = 0; b < 8; b++)
        p[b] = (uint8_t)(v >> (56 - 8 * b)); /* compilers make this one byte swap and one store */
}

static void *pack_range(void *arg) {
    PackJob *job = arg;
    Range g = job->g;
    const Codes *cd = job->codes;
    uint8_t *start = (uint8_t *)job->words, *out = start + ((job->first_bit & 31) >> 3);
    int64_t word0_bit = job->first_bit & ~(int64_t)31;
    uint64_t acc = 0;
    int used = (int)(job->first_bit & 7);
    job->words[0] = 0; /* its first bits belong to the range before (0 here: they are ORed in) */
#define FLUSH()                 \
    do {                        \
        store_be64(out, acc);   \
        out += used >> 3;       \
        acc <<= used & ~7;      \
        used &= 7;              \
    } while (0)
    int64_t group = g.k0 / job->cpg, in_group = g.k0 % job->cpg; /* (k0 is a group's first chunk) */
    for (int64_t k = g.k0, r = k / g.cpr, j = k % g.cpr; k < g.k1; k++) {
        if (in_group == 0)
            job->offsets[group++] = word0_bit + (int64_t)(out - start) * 8 + used;
        if (++in_group == job->cpg)
            in_group = 0;
        if (!job->flags[k]) {
            const uint16_t *q = g.bits + r * g.cols + j * g.cs;
            int64_t n = min64(g.cs, g.cols - j * g.cs), t = 0;
            if (cd->pairs) {
                for (; t + 4 <= n; t += 4, q += 4) {
                    uint64_t w;
                    memcpy(&w, q, 8);
                    uint64_t lanes = ((w >> 7) & 0x00FF00FF00FF00FFull) - cd->lanes_lo;
                    uint64_t x = lanes | (lanes >> 12);
                    unsigned i01 = (unsigned)(x & 0xFF), i23 = (unsigned)((x >> 32) & 0xFF);
                    int mid = used + cd->pair_len[i01];
                    acc |= (cd->pair_code[i01] >> used) | (cd->pair_code[i23] >> mid);
                    used = mid + cd->pair_len[i23];
                    FLUSH();
                }
            }
            while (t < n) { /* one code at a time, per_flush of them per flush */
                int64_t stop = min64(t + cd->per_flush, n);
                for (; t < stop; t++, q++) {
                    unsigned e = EXPONENT(*q);
                    acc |= cd->code[e] >> used;
                    used += cd->len[e];
                }
                FLUSH();
            }
        }
        if (++j == g.cpr) {
            j = 0;
            r++;
        }
    }
    store_be64(out, acc); /* the last bits, then zeros */
    store_be64(out + 8, 0);
    int64_t words = ((out - start) * 8 + used + 31) / 32;
    for (int64_t w = 0; w < words; w++) { /* big-endian bytes -> MSB-first 32-bit words */
        uint32_t v = job->words[w];
        job->words[w] = (v >> 24) | ((v >> 8) & 0xFF00) | ((v << 8) & 0xFF0000) | (v << 24);
    }
    return NULL;
}

/* Pass 2. Appends, for every coded chunk in id order and every weight in column order, the
 * canonical code of its exponent (FORMAT.md 3.3: palette[i] has length lengths[i] <= 16).
 * coded[t][e] = the weights with exponent e in range t's coded chunks (unw_scan's counts less
 * unw_verbatim's). offsets[g] = the bit where group g (chunks [g * cpg, (g + 1) * cpg)) starts;
 * offsets[n_groups] = the total. stream receives the bits MSB first in 32-bit words; it must hold
 * total / 32 + 6 words. Returns the total number of bits, or -1 if memory ran out. */
int64_t unw_pack(const uint16_t *bits, int64_t rows, int64_t cols, int64_t cs, int64_t cpg, int threads,
                 const uint8_t *flags, const uint8_t *palette, int p, const uint8_t *lengths, const int64_t *coded,
                 uint32_t *stream, int64_t *offsets) {
    static const Codes zero;
    Codes cd = zero;
    PackJob jobs[MAX_THREADS];
    uint8_t lo = 255, hi = 0;
    int max_length = 0, bl_count[17] = {0}, next_code[17] = {0}, c = 0;
    if (threads < 1 || threads > MAX_THREADS)
        return -1;
    for (int i = 0; i < p; i++) { /* canonical codes (FORMAT.md 3.3), left-aligned, by exponent */
        bl_count[lengths[i]]++;
        max_length = lengths[i] > max_length ? lengths[i] : max_length;
        lo = palette[i] < lo ? palette[i] : lo;
        hi = palette[i] > hi ? palette[i] : hi;
    }
    bl_count[0] = 0;
    for (int l = 1; l <= 16; l++)
        next_code[l] = c = (c + bl_count[l - 1]) << 1;
    for (int i = 0; i < p; i++) {
        if (lengths[i]) {
            cd.code[palette[i]] = (uint64_t)next_code[lengths[i]]++ << (64 - lengths[i]);
            cd.len[palette[i]] = lengths[i];
        }
    }
    cd.pairs = p > 0 && p <= 16 && hi - lo + 1 == p && max_length <= 12; /* offsets fit a nibble */
    for (int i = 0; cd.pairs && i < 256; i++) {
        int s0 = lo + (i & 15), s1 = lo + (i >> 4);
        if (s0 <= hi && s1 <= hi) {
            cd.pair_code[i] = cd.code[s0] | (cd.code[s1] >> cd.len[s0]);
            cd.pair_len[i] = (uint8_t)(cd.len[s0] + cd.len[s1]);
        }
    }
    cd.per_flush = max_length <= 12 ? 4 : 3;
    cd.lanes_lo = (uint64_t)lo * 0x0001000100010001ull;

    int64_t first_bit = 0, failed = 0;
    for (int t = 0; t < threads; t++) { /* where each range starts, and a buffer for it */
        int64_t range_bits = 0;
        for (int e = 0; e < 256; e++)
            range_bits += coded[256 * t + e] * cd.len[e];
        PackJob job = {range_of(bits, rows, cols, cs, cpg, t, threads), &cd, flags, cpg, first_bit, stream, offsets};
        if (threads > 1) {
            job.words = malloc(sizeof(uint32_t) * (size_t)(range_bits / 32 + 8));
            failed |= job.words == NULL;
        }
        jobs[t] = job;
        first_bit += range_bits;
    }
    if (!failed)
        run_threads(pack_range, jobs, sizeof(PackJob), threads);
    if (threads > 1) { /* copy each range into place; a range's first word may share bits with the last one's */
        int64_t words = first_bit / 32 + 2;
        memset(stream, 0, sizeof(uint32_t) * (size_t)words);
        for (int t = 0; t < threads && !failed; t++) {
            int64_t w0 = jobs[t].first_bit / 32;
            int64_t end = t + 1 < threads ? jobs[t + 1].first_bit : first_bit;
            int64_t n = (end + 31) / 32 - w0;
            for (int64_t w = 0; w < n; w++)
                stream[w0 + w] |= jobs[t].words[w];
        }
        for (int t = 0; t < threads; t++)
            free(jobs[t].words);
    }
    if (failed)
        return -1;
    int64_t n_chunks = rows * ((cols + cs - 1) / cs);
    offsets[(n_chunks + cpg - 1) / cpg] = first_bit;
    return first_bit;
}
