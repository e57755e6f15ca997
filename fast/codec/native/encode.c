/* The Unweight encoder for the CPU, in C (FORMAT.md sections 2 and 3).
 *
 * fast/codec/encode_native.py builds this file with the system C compiler on first use, loads it
 * with ctypes and calls, per tensor:
 *
 *   unw_scan           pass 1: sm byte of every weight, exponent counts, each chunk's min and max exponent
 *   (palette: Python)
 *   unw_verbatim       which chunks hold an exponent outside the palette (from the min/max, or a scan)
 *   unw_gather_vexp    the verbatim chunks' exponents
 *   unw_code_lengths   package-merge, as reference/codec/huffman.py does it (same ties)
 *   unw_pack           pass 2: the codes of the coded chunks' exponents, MSB first, and group offsets
 *
 * Plain C99 (plus unsigned __int128 in unw_code_lengths, which GCC and Clang have), no other
 * dependency, one thread. Weights are bf16 bit patterns (uint16, C order) viewed as rows x cols;
 * chunk (r, j) holds columns [j * cs, min((j + 1) * cs, cols)) of row r and has id r * cpr + j,
 * cpr = ceil(cols / cs); chunks in id order are the weights in order.
 */
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "unw_pack reads four bf16 weights as one little-endian uint64"
#endif

#define EXPONENT(b) (((b) >> 7) & 0xFF)

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Pass 1. sm[i] = sign (bit 15 -> bit 7) | mantissa (bits 0..6); counts[e] += weights with exponent e;
 * chunk_min/chunk_max[k] = the smallest and largest exponent in chunk k. The sm and min/max loop
 * vectorises. The histogram uses four tables in turn: neighbouring weights often share an
 * exponent, and increments of one counter in a row would wait on each other. */
void unw_scan(const uint16_t *bits, int64_t rows, int64_t cols, int64_t cs, uint8_t *sm, int64_t *counts,
              uint8_t *chunk_min, uint8_t *chunk_max) {
    int64_t cpr = (cols + cs - 1) / cs, k = 0;
    uint64_t h[4][256] = {{0}};
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < cpr; j++, k++) {
            int64_t first = r * cols + j * cs, n = min64(cs, cols - j * cs), t;
            const uint16_t *p = bits + first;
            uint8_t *q = sm + first, lo = 255, hi = 0;
            for (t = 0; t < n; t++) {
                uint8_t e = (uint8_t)EXPONENT(p[t]);
                q[t] = (uint8_t)((p[t] & 0x7F) | ((p[t] >> 8) & 0x80));
                lo = e < lo ? e : lo;
                hi = e > hi ? e : hi;
            }
            chunk_min[k] = lo;
            chunk_max[k] = hi;
            for (t = 0; t + 4 <= n; t += 4) {
                h[0][EXPONENT(p[t])]++;
                h[1][EXPONENT(p[t + 1])]++;
                h[2][EXPONENT(p[t + 2])]++;
                h[3][EXPONENT(p[t + 3])]++;
            }
            for (; t < n; t++)
                h[0][EXPONENT(p[t])]++;
        }
    }
    for (int e = 0; e < 256; e++)
        counts[e] += (int64_t)(h[0][e] + h[1][e] + h[2][e] + h[3][e]);
}

/* flags[k] = 1 if chunk k holds an exponent outside the palette (a verbatim chunk), else 0;
 * vcounts[e] += the verbatim chunks' weights with exponent e. A chunk whose exponents lie within
 * [min, max] of a consecutive palette is coded; one with an exponent outside [min, max] is
 * verbatim; only for a palette with gaps are the others scanned. Returns the number of verbatim chunks. */
int64_t unw_verbatim(const uint16_t *bits, int64_t rows, int64_t cols, int64_t cs, const uint8_t *chunk_min,
                     const uint8_t *chunk_max, const uint8_t *palette, int p, uint8_t *flags, int64_t *vcounts) {
    int64_t cpr = (cols + cs - 1) / cs, verbatim = 0;
    uint8_t in_palette[256] = {0}, lo = 255, hi = 0;
    for (int i = 0; i < p; i++) {
        in_palette[palette[i]] = 1;
        lo = palette[i] < lo ? palette[i] : lo;
        hi = palette[i] > hi ? palette[i] : hi;
    }
    int gaps = p > 0 && hi - lo + 1 != p;
    for (int64_t r = 0, k = 0; r < rows; r++) {
        for (int64_t j = 0; j < cpr; j++, k++) {
            unsigned bad = p == 0 || chunk_min[k] < lo || chunk_max[k] > hi;
            if (!bad && !gaps) {
                flags[k] = 0;
                continue;
            }
            int64_t n = min64(cs, cols - j * cs);
            const uint16_t *q = bits + r * cols + j * cs;
            for (int64_t t = 0; t < n && !bad; t++)
                bad |= in_palette[EXPONENT(q[t])] == 0;
            flags[k] = (uint8_t)bad;
            if (bad) {
                verbatim++;
                for (int64_t t = 0; t < n; t++)
                    vcounts[EXPONENT(q[t])]++;
            }
        }
    }
    return verbatim;
}

/* vexp[v, :] = the exponents of verbatim chunk vchunks[v] (zero past a short chunk's end). */
void unw_gather_vexp(const uint16_t *bits, int64_t cols, int64_t cs, const int64_t *vchunks, int64_t n_verbatim,
                     uint8_t *vexp) {
    int64_t cpr = (cols + cs - 1) / cs;
    for (int64_t v = 0; v < n_verbatim; v++) {
        int64_t r = vchunks[v] / cpr, j = vchunks[v] % cpr, n = min64(cs, cols - j * cs);
        const uint16_t *q = bits + r * cols + j * cs;
        for (int64_t t = 0; t < cs; t++)
            vexp[v * cs + t] = t < n ? (uint8_t)EXPONENT(q[t]) : 0;
    }
}

/* Code lengths <= max_length for p <= 25 symbols with these counts, exactly as
 * reference.codec.huffman.code_lengths computes them (see its docstring): package-merge, an entry
 * being (value, the symbols it contains). Here the symbols are counted in one 128-bit integer, 5
 * bits per symbol (a symbol occurs at most once per level, so at most max_length <= 16 times).
 * Returns 0, or -1 for what the reference rejects or leaves to its trivial cases (the caller then
 * asks the reference). */
typedef struct {
    int64_t value;
    unsigned __int128 symbols;
} Entry;

int unw_code_lengths(const int64_t *counts, int p, int max_length, uint8_t *lengths) {
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

/* Pass 2. Appends, for every coded chunk in id order and every weight in column order, the
 * canonical code of its exponent (FORMAT.md 3.3: palette[i] has length lengths[i] <= max_length).
 * offsets[g] = the bit where group g (chunks [g * cpg, (g + 1) * cpg)) starts; offsets[n_groups] =
 * the total. stream receives the bits MSB first in 32-bit words; it must hold total / 32 + 6
 * words. Returns the total number of bits.
 *
 * The bits are first written as a big-endian byte stream, the classic way: `acc` holds `used` bits
 * at its top (used < 8 after a flush) and the next code, left-aligned, goes in below them (code >>
 * used); after every 4 codes of <= 12 bits (or 3 of <= 16) the 8 bytes of acc are stored
 * big-endian at `out`, which then moves on by the whole bytes written. Finally each 32-bit word is
 * byte-swapped: a big-endian word read as little-endian is the format's MSB-first word.
 *
 * When the palette is consecutive exponents [lo, lo + p), p <= 16, and codes are <= 12 bits, four weights at
 * a time take two lookups instead of four: one 8-byte load holds them,
 * ((w >> 7) & 0x00FF00FF00FF00FF) - lo * 0x0001000100010001 puts their palette offsets in four
 * 16-bit lanes (a coded chunk holds no exponent below lo: no borrow between lanes), and
 * lanes | lanes >> 12 puts s0 | s1 << 4 in byte 0 and s2 | s3 << 4 in byte 4; pair_code[s0 | s1 << 4]
 * is the two codes concatenated and left-aligned, pair_len their total length. */
static inline void store_be64(uint8_t *p, uint64_t v) {
    for (int b = 0; b < 8; b++)
        p[b] = (uint8_t)(v >> (56 - 8 * b)); /* compilers make this one byte swap and one store */
}

int64_t unw_pack(const uint16_t *bits, int64_t rows, int64_t cols, int64_t cs, int64_t cpg, const uint8_t *flags,
                 const uint8_t *palette, int p, const uint8_t *lengths, uint32_t *stream, int64_t *offsets) {
    int64_t cpr = (cols + cs - 1) / cs, n_chunks = rows * cpr, k = 0, in_group = 0;
    uint64_t code[256] = {0}, pair_code[256] = {0};
    uint8_t len[256] = {0}, pair_len[256] = {0}, lo = 255, hi = 0;
    int max_length = 0, bl_count[17] = {0}, next_code[17] = {0}, c = 0;
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
            code[palette[i]] = (uint64_t)next_code[lengths[i]]++ << (64 - lengths[i]);
            len[palette[i]] = lengths[i];
        }
    }
    int pairs = p > 0 && p <= 16 && hi - lo + 1 == p && max_length <= 12; /* offsets fit a nibble */
    if (pairs) {
        for (int i = 0; i < 256; i++) {
            int s0 = lo + (i & 15), s1 = lo + (i >> 4);
            if (s0 <= hi && s1 <= hi) {
                pair_code[i] = code[s0] | (code[s1] >> len[s0]);
                pair_len[i] = (uint8_t)(len[s0] + len[s1]);
            }
        }
    }
    int per_flush = max_length <= 12 ? 4 : 3;
    uint64_t lanes_lo = (uint64_t)lo * 0x0001000100010001ull;
    uint8_t *start = (uint8_t *)stream, *out = start;
    uint64_t acc = 0;
    int used = 0;
#define FLUSH()                 \
    do {                        \
        store_be64(out, acc);   \
        out += used >> 3;       \
        acc <<= used & ~7;      \
        used &= 7;              \
    } while (0)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < cpr; j++, k++) {
            if (in_group == 0)
                offsets[k / cpg] = (int64_t)(out - start) * 8 + used;
            if (++in_group == cpg)
                in_group = 0;
            if (flags[k])
                continue;
            const uint16_t *q = bits + r * cols + j * cs;
            int64_t n = min64(cs, cols - j * cs), t = 0;
            if (pairs) {
                for (; t + 4 <= n; t += 4, q += 4) {
                    uint64_t w;
                    memcpy(&w, q, 8);
                    uint64_t lanes = ((w >> 7) & 0x00FF00FF00FF00FFull) - lanes_lo;
                    uint64_t x = lanes | (lanes >> 12);
                    unsigned i01 = (unsigned)(x & 0xFF), i23 = (unsigned)((x >> 32) & 0xFF);
                    int mid = used + pair_len[i01];
                    acc |= (pair_code[i01] >> used) | (pair_code[i23] >> mid);
                    used = mid + pair_len[i23];
                    FLUSH();
                }
            }
            while (t < n) { /* one code at a time, per_flush of them per flush */
                int64_t stop = min64(t + per_flush, n);
                for (; t < stop; t++, q++) {
                    unsigned e = EXPONENT(*q);
                    acc |= code[e] >> used;
                    used += len[e];
                }
                FLUSH();
            }
        }
    }
    int64_t total = (int64_t)(out - start) * 8 + used;
    store_be64(out, acc); /* the last bits, then zeros */
    store_be64(out + 8, 0);
    int64_t words = (total + 31) / 32 + 1;
    for (int64_t w = 0; w < words; w++) { /* big-endian bytes -> MSB-first 32-bit words */
        uint32_t v = stream[w];
        stream[w] = (v >> 24) | ((v >> 8) & 0xFF00) | ((v << 8) & 0xFF0000) | (v << 24);
    }
    offsets[(n_chunks + cpg - 1) / cpg] = total;
    return total;
}
