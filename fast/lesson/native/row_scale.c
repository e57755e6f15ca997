/* Per-row fp8 scales of a bf16 matrix: the C lesson kernel of fast/KERNELS.md.
 *
 * The specification is reference/lesson/row_scale.py: for each row, amax = the largest (bits & 0x7fff)
 * (NaN wins, an empty row gives 0) and the fp8 scale exponent of amax (the smallest e in [-126, 120] with
 * amax <= 448 * 2^e; -126 for zero, subnormal, infinite or NaN). Everything is integer work on bit
 * patterns, so every path below gives the same bits.
 *
 *   lesson_row_scale_isa(level)   cap the paths at UNFIRE_CPU_ISA's level (fast/build_c.py passes it: 0 scalar,
 *                                 1 avx2 or neon, 2 avx512, 3 amx); returns the path now in use (PATH_*)
 *   lesson_row_scale(...)         the kernel; path -1: the one in use, else a PATH_* (the tests run each)
 *
 * One shared object runs on every CPU of its architecture: the vector loops are compiled with a target
 * attribute each (no -mavx2 on the command line) and chosen at run time by what the CPU has
 * (__builtin_cpu_supports) and what the cap allows.
 */
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LESSON_X86 1
#elif defined(__aarch64__)
#include <arm_neon.h>
#define LESSON_NEON 1
#endif

enum { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_NEON = 1, PATH_AVX512 = 2 };

static int path_in_use = PATH_SCALAR;

/* The largest (x[i] & 0x7fff) of one row: the plain loop, the anchor every vector loop must equal. */
static uint16_t amax_scalar(const uint16_t *x, int64_t n) {
    uint16_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t a = x[i] & 0x7fff;
        m = a > m ? a : m;
    }
    return m;
}

#ifdef LESSON_X86
/* 16 lanes at a time; the tail (n % 16) by the plain loop. */
__attribute__((target("avx2"))) static uint16_t amax_avx2(const uint16_t *x, int64_t n) {
    const __m256i clear = _mm256_set1_epi16(0x7fff);
    __m256i m = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(x + i)), clear));
    __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    /* the largest of 8 unsigned 16-bit lanes: minpos finds the smallest, so take it of the complement */
    uint16_t best = (uint16_t)~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(h, _mm_set1_epi16(-1))));
    uint16_t tail = amax_scalar(x + i, n - i);
    return best > tail ? best : tail;
}

/* 32 lanes at a time (AVX-512BW: 16-bit lanes); the tail by a masked load, which reads no byte past the row. */
__attribute__((target("avx512f,avx512bw"))) static uint16_t amax_avx512(const uint16_t *x, int64_t n) {
    const __m512i clear = _mm512_set1_epi16(0x7fff);
    __m512i m = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512((const void *)(x + i)), clear));
    if (i < n) {
        __mmask32 k = (__mmask32)((1ull << (n - i)) - 1);
        m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_maskz_loadu_epi16(k, x + i), clear));
    }
    uint16_t lanes[32];
    _mm512_storeu_si512((void *)lanes, m);
    return amax_scalar(lanes, 32); /* lanes hold no sign bit: the plain loop's maximum of them */
}
#endif

#ifdef LESSON_NEON
/* 8 lanes at a time (Advanced SIMD, every aarch64 CPU); the tail by the plain loop. */
static uint16_t amax_neon(const uint16_t *x, int64_t n) {
    const uint16x8_t clear = vdupq_n_u16(0x7fff);
    uint16x8_t m = vdupq_n_u16(0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        m = vmaxq_u16(m, vandq_u16(vld1q_u16(x + i), clear));
    uint16_t best = vmaxvq_u16(m), tail = amax_scalar(x + i, n - i);
    return best > tail ? best : tail;
}
#endif

/* The fp8 scale exponent of a bf16 amax (sign clear): bf16 = (1 + m/128) * 2^(E-127) for 0 < E < 255, and
 * (1 + m/128) <= 1.75 = 448 / 2^8 exactly when m <= 96. */
static int8_t scale_exponent(uint16_t amax) {
    int e_field = amax >> 7, m = amax & 0x7f;
    if (e_field == 0 || e_field == 255) /* zero, subnormal (below 448 * 2^-126), infinity, NaN */
        return -126;
    int e = e_field - 135 + (m > 96);
    return (int8_t)(e < -126 ? -126 : e > 120 ? 120 : e);
}

int lesson_row_scale_isa(int level) {
    path_in_use = PATH_SCALAR;
#ifdef LESSON_X86
    __builtin_cpu_init();
    if (level >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        path_in_use = PATH_AVX512;
    else if (level >= 1 && __builtin_cpu_supports("avx2"))
        path_in_use = PATH_AVX2;
#elif defined(LESSON_NEON)
    if (level >= 1)
        path_in_use = PATH_NEON;
#endif
    return path_in_use;
}

/* x: rows of cols bf16 bits, row r at x + r * stride (stride >= cols, in elements). Writes amax[rows] and
 * exponent[rows]. path: -1 the one in use, else PATH_*; a path this build or CPU lacks runs the plain loop.
 * Returns the path that ran. */
int lesson_row_scale(const uint16_t *x, int64_t rows, int64_t cols, int64_t stride, uint16_t *amax,
                     int8_t *exponent, int path) {
    if (path < 0)
        path = path_in_use;
#ifdef LESSON_X86
    if (path == PATH_AVX512 && !(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")))
        path = PATH_SCALAR;
    if (path == PATH_AVX2 && !__builtin_cpu_supports("avx2"))
        path = PATH_SCALAR;
#elif defined(LESSON_NEON)
    if (path > PATH_NEON)
        path = PATH_NEON;
#else
    path = PATH_SCALAR;
#endif
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * stride;
        uint16_t m;
#ifdef LESSON_X86
        m = path == PATH_AVX512 ? amax_avx512(row, cols) : path == PATH_AVX2 ? amax_avx2(row, cols)
                                                                               : amax_scalar(row, cols);
#elif defined(LESSON_NEON)
        m = path == PATH_NEON ? amax_neon(row, cols) : amax_scalar(row, cols);
#else
        m = amax_scalar(row, cols);
#endif
        amax[r] = m;
        exponent[r] = scale_exponent(m);
    }
    return path;
}
