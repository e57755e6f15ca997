/* CRC-32 (IEEE 802.3, the value zlib.crc32 gives) for the C decoders (decode.c, rans_decode.c).
 *
 *   crc_setup()            once per process before the others (builds the tables, checks the CPU)
 *   crc_update(c, p, n)    continue the running state c (the inverted CRC: ~0 at the start) over n bytes
 *   crc_use(level)         use at most that path (below); returns the one in use
 *   crc_isa(isa)           the paths UNFIRE_CPU_ISA allows (builds.h's ISA_*): isa is the highest level
 *                          (0 tables; 1 PCLMULQDQ, every AVX2 CPU has it, or ARM's CRC32; 2 VPCLMULQDQ)
 *   crc_combine(a, b, n)   the CRC of A then B from crc(A), crc(B) and B's length n (as zlib's crc32_combine)
 *   crc_join(a, b, n, s)   the same, keeping x^(8n) in s for the next piece of the same length
 *
 * Four ways to the same value, the fastest the CPU has (checked at run time, so one build runs anywhere):
 *   - 512-bit carry-less multiplication (VPCLMULQDQ + AVX-512): four 64-byte lanes folded 256 bytes at a
 *     time, ~4x the 128-bit path's bytes per instruction;
 *   - 128-bit carry-less multiplication (PCLMULQDQ + SSE4.1): four 16-byte lanes folded 64 bytes at a time;
 *   - on aarch64, ARMv8's CRC32X/CRC32B instructions (the IEEE polynomial 0x04C11DB7 reflected, zlib's: not
 *     the CRC32C ones), 8 bytes an instruction, where the CPU has them (HWCAP_CRC32; every ARMv8.1 CPU);
 *   - portable slicing by 8 (eight 256-entry tables, 8 bytes per step).
 * The folding is Gopal et al., "Fast CRC computation for generic polynomials using PCLMULQDQ" (Intel,
 * 2009): a lane L followed, D bits later, by data M has the same remainder as M ^ (L.lo * K1) ^ (L.hi * K2)
 * with K1 = x^(D+32) mod P and K2 = x^(D-32) mod P (bit-reflected, shifted left by one). The constants
 * below are those for D = 2048, 512 and 128 bits; tests/test_decode_cpu.py compares every path with
 * zlib.crc32 over many lengths and alignments.
 */
#ifndef UNW_CRC32_H
#define UNW_CRC32_H
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_CLMUL_CODE 1
#endif

/* ARM's CRC32 instructions take 8 bytes as one little-endian word: little-endian aarch64 only */
#if defined(__aarch64__) && !defined(__AARCH64EB__) && (defined(__GNUC__) || defined(__clang__))
#include <arm_acle.h>
#define HAVE_ARM_CRC_CODE 1
#if !defined(__ARM_FEATURE_CRC32) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_CRC32
#define HWCAP_CRC32 (1 << 7)
#endif
#endif
#endif

static uint32_t crc_table[8][256];
/* 0: tables, 1: PCLMULQDQ or ARM's CRC32, 2: VPCLMULQDQ (in use; the best allowed; the CPU's best) */
static int crc_level, crc_level_cpu, crc_level_found;
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][n] = c;
    }
    for (int t = 1; t < 8; t++) /* table t: byte n followed by t zero bytes */
        for (uint32_t n = 0; n < 256; n++)
            crc_table[t][n] = crc_table[0][crc_table[t - 1][n] & 0xFF] ^ (crc_table[t - 1][n] >> 8);
#ifdef HAVE_CLMUL_CODE
    __builtin_cpu_init();
    if (__builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"))
        crc_level = 1;
    if (crc_level && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq"))
        crc_level = 2;
#endif
#ifdef HAVE_ARM_CRC_CODE
#ifdef __ARM_FEATURE_CRC32
    crc_level = 1; /* the compiler's target has it (ARMv8.1 and later, Apple's chips) */
#elif defined(__linux__)
    crc_level = (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; /* optional in ARMv8.0: asked of the kernel */
#endif
#endif
    crc_level_found = crc_level_cpu = crc_level;
}

static void crc_setup(void) { pthread_once(&crc_once, crc_init); }

/* Use at most this level (for the tests: every path must give zlib's value); returns the level in use. */
static inline int crc_use(int level) {
    crc_setup();
    crc_level = level < 0 || level > crc_level_cpu ? crc_level_cpu : level;
    return crc_level;
}

/* The paths an instruction-set cap allows (isa: builds.h's ISA_*, from UNFIRE_CPU_ISA): up to level isa, so
 * tables alone for scalar, PCLMULQDQ for avx2, VPCLMULQDQ from avx512, ARM's CRC32 for neon. Returns the best. */
static inline int crc_isa(int isa) {
    crc_setup();
    crc_level_cpu = crc_level = isa < 0 ? 0 : isa < crc_level_found ? isa : crc_level_found;
    return crc_level_cpu;
}

/* Slicing by 8 (little-endian loads). */
static uint32_t crc_soft(uint32_t c, const uint8_t *p, size_t n) {
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint32_t lo = (uint32_t)w ^ c, hi = (uint32_t)(w >> 32);
        c = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^ crc_table[5][(lo >> 16) & 0xFF] ^
            crc_table[4][lo >> 24] ^ crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
            crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

#ifdef HAVE_CLMUL_CODE
#define CLMUL_TARGET __attribute__((target("pclmul,sse4.1")))
#define VCLMUL_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1")))
#define LOAD128(p) _mm_loadu_si128((const __m128i *)(p))
#define K128 _mm_set_epi64x(0x00ccaa009e, 0x01751997d0) /* D = 128: x^96, x^160 */
#define K512 _mm_set_epi64x(0x01c6e41596, 0x0154442bd4) /* D = 512: x^480, x^544 */

/* x folded forward by D bits (k: that D's constants) onto the data y. */
static inline CLMUL_TARGET __m128i fold128(__m128i x, __m128i k, __m128i y) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11)), y);
}

/* One 128-bit lane x, then the n bytes at p (n a multiple of 16): the CRC state (Barrett reduction). */
static inline CLMUL_TARGET uint32_t clmul_finish(__m128i x, const uint8_t *p, size_t n) {
    const __m128i k5k0 = _mm_set_epi64x(0, 0x0163cd6124);
    const __m128i poly = _mm_set_epi64x(0x01f7011641, 0x01db710641);
    const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
    for (; n >= 16; p += 16, n -= 16)
        x = fold128(x, K128, LOAD128(p));
    __m128i y = _mm_clmulepi64_si128(x, K128, 0x10); /* 128 -> 64 bits */
    x = _mm_xor_si128(_mm_srli_si128(x, 8), y);
    y = _mm_srli_si128(x, 4);
    x = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x, mask32), k5k0, 0x00), y);
    y = _mm_clmulepi64_si128(_mm_and_si128(x, mask32), poly, 0x10); /* Barrett reduction to 32 bits */
    y = _mm_clmulepi64_si128(_mm_and_si128(y, mask32), poly, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(x, y), 1);
}

/* 128-bit lanes: n >= 64 and a multiple of 16. */
static CLMUL_TARGET uint32_t crc_clmul(uint32_t c, const uint8_t *p, size_t n) {
    __m128i x1 = _mm_xor_si128(LOAD128(p), _mm_cvtsi32_si128((int)c)), x2 = LOAD128(p + 16);
    __m128i x3 = LOAD128(p + 32), x4 = LOAD128(p + 48);
    for (p += 64, n -= 64; n >= 64; p += 64, n -= 64) { /* four lanes, each folded forward by 512 bits */
        x1 = fold128(x1, K512, LOAD128(p));
        x2 = fold128(x2, K512, LOAD128(p + 16));
        x3 = fold128(x3, K512, LOAD128(p + 32));
        x4 = fold128(x4, K512, LOAD128(p + 48));
    }
    x2 = fold128(x1, K128, x2); /* the four lanes into one */
    x3 = fold128(x2, K128, x3);
    x4 = fold128(x3, K128, x4);
    return clmul_finish(x4, p, n);
}

/* 512-bit lanes: n >= 256 and a multiple of 16. */
static VCLMUL_TARGET uint32_t crc_vclmul(uint32_t c, const uint8_t *p, size_t n) {
    const __m512i k2048 = _mm512_broadcast_i32x4(_mm_set_epi64x(0x01322d1430, 0x011542778a)); /* x^2016, x^2080 */
    const __m512i k512 = _mm512_broadcast_i32x4(K512);
#define FOLD512(x, k, y) \
    _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00), _mm512_clmulepi64_epi128(x, k, 0x11), y, 0x96)
    __m512i x0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
    __m512i x1 = _mm512_loadu_si512(p + 64), x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
    for (p += 256, n -= 256; n >= 256; p += 256, n -= 256) {
        x0 = FOLD512(x0, k2048, _mm512_loadu_si512(p));
        x1 = FOLD512(x1, k2048, _mm512_loadu_si512(p + 64));
        x2 = FOLD512(x2, k2048, _mm512_loadu_si512(p + 128));
        x3 = FOLD512(x3, k2048, _mm512_loadu_si512(p + 192));
    }
    x1 = FOLD512(x0, k512, x1); /* four 512-bit lanes into one */
    x2 = FOLD512(x1, k512, x2);
    x3 = FOLD512(x2, k512, x3);
    for (; n >= 64; p += 64, n -= 64)
        x3 = FOLD512(x3, k512, _mm512_loadu_si512(p));
#undef FOLD512
    __m128i x = fold128(_mm512_extracti32x4_epi32(x3, 0), K128, _mm512_extracti32x4_epi32(x3, 1));
    x = fold128(x, K128, _mm512_extracti32x4_epi32(x3, 2)); /* its four 128-bit lanes into one */
    x = fold128(x, K128, _mm512_extracti32x4_epi32(x3, 3));
    return clmul_finish(x, p, n);
}
#endif

#ifdef HAVE_ARM_CRC_CODE
#ifdef __ARM_FEATURE_CRC32
#define ARM_CRC_TARGET
#elif defined(__clang__)
#define ARM_CRC_TARGET __attribute__((target("crc")))
#else
#define ARM_CRC_TARGET __attribute__((target("+crc")))
#endif

/* ARMv8's CRC32 instructions: one chain of 8-byte steps (4 per loop), then bytes. */
static ARM_CRC_TARGET uint32_t crc_arm(uint32_t c, const uint8_t *p, size_t n) {
    uint64_t w[4];
    for (; n >= 32; p += 32, n -= 32) {
        memcpy(w, p, 32);
        c = __crc32d(__crc32d(__crc32d(__crc32d(c, w[0]), w[1]), w[2]), w[3]);
    }
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(w, p, 8);
        c = __crc32d(c, w[0]);
    }
    while (n--)
        c = __crc32b(c, *p++);
    return c;
}
#endif

static uint32_t crc_update(uint32_t c, const uint8_t *p, size_t n) {
#ifdef HAVE_ARM_CRC_CODE
    if (crc_level)
        return crc_arm(c, p, n);
#endif
#ifdef HAVE_CLMUL_CODE
    if (crc_level && n >= 64) {
        size_t m = n & ~(size_t)15;
        c = crc_level == 2 && m >= 256 ? crc_vclmul(c, p, m) : crc_clmul(c, p, m);
        p += m;
        n -= m;
    }
#endif
    return crc_soft(c, p, n);
}

/* CRC-32 algebra modulo the polynomial, as zlib's crc32_combine: a * b, and x^(8 * n). */
static uint32_t mult_mod_p(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (; m; m >>= 1) {
        if (a & m)
            p ^= b;
        b = b & 1 ? (b >> 1) ^ 0xEDB88320u : b >> 1;
    }
    return p;
}

static uint32_t x8n_mod_p(int64_t n) {
    uint32_t p = 1u << 31, x2k = 1u << 23; /* x^0 and x^8 (one byte), bit-reflected: x^k is bit 31 - k */
    for (; n; n >>= 1) {
        if (n & 1)
            p = mult_mod_p(x2k, p);
        x2k = mult_mod_p(x2k, x2k);
    }
    return p;
}

static inline uint32_t crc_combine(uint32_t crc_a, uint32_t crc_b, int64_t len_b) {
    return mult_mod_p(x8n_mod_p(len_b), crc_a) ^ crc_b;
}

/* crc_combine for many pieces of mostly equal length: x^(8 * len) is kept for the last length seen. */
typedef struct {
    int64_t len;
    uint32_t shift;
} CrcShift;

static uint32_t crc_join(uint32_t crc_a, uint32_t crc_b, int64_t len_b, CrcShift *last) {
    if (last->len != len_b) {
        last->len = len_b;
        last->shift = x8n_mod_p(len_b);
    }
    return mult_mod_p(last->shift, crc_a) ^ crc_b;
}
#endif
