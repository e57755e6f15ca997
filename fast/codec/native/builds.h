/* Two builds of a decoder's hot loop, chosen at run time; shared by decode.c and rans_decode.c.
 *
 *   TWO_BUILDS(work, work_body)   defines `static void *work(void *)`, which runs work_body (an
 *                                 always_inline function) compiled for any CPU, or compiled for
 *                                 AVX2 + BMI2 (shifts by a register without the cl register, 256-bit
 *                                 vector code) when the CPU has both
 *   TWO_BUILDS_FLAG(work, body)   the same, with body(arg, wide): wide is 1 in the AVX2 + BMI2 build (a
 *                                 constant there, so body can hold code only that build may run)
 *   builds_setup()                once before work runs (checks the CPU)
 *   builds_use(wide)              use the AVX2 + BMI2 build if wide and the CPU has it (and the cap
 *                                 allows it); returns 1 if it is in use (the tests run both builds)
 *   builds_isa(isa)               the cap UNFIRE_CPU_ISA sets (ISA_* below): the AVX2 + BMI2 build only
 *                                 from ISA_AVX2 on; returns 1 if that build is allowed (and in use)
 *
 * One shared object thus runs on any x86-64 CPU and at full speed on recent ones; elsewhere (other
 * architectures, other compilers) there is one build.
 */
#ifndef UNW_BUILDS_H
#define UNW_BUILDS_H
#include <pthread.h>

/* UNFIRE_CPU_ISA as fast/build_c.py passes it (isa_level): the set's place in its architecture's chain
 * (fast/cpu_isa.py), each set including the ones before it. */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_NEON = 1, ISA_AVX512 = 2, ISA_AMX = 3 };

static int wide_found, wide_cpu, use_wide; /* the CPU has AVX2 + BMI2; that and the cap allows it; in use */
static pthread_once_t wide_once = PTHREAD_ONCE_INIT;

static void wide_init(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    wide_found = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
#endif
    use_wide = wide_cpu = wide_found;
}

static void builds_setup(void) { pthread_once(&wide_once, wide_init); }

static inline int builds_use(int wide) {
    builds_setup();
    use_wide = wide && wide_cpu;
    return use_wide;
}

static inline int builds_isa(int isa) {
    builds_setup();
    use_wide = wide_cpu = wide_found && isa >= ISA_AVX2;
    return use_wide;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TWO_BUILDS(fn, body)                                                                     \
    static void *fn##_plain(void *arg) { return body(arg); }                                     \
    __attribute__((target("avx2,bmi,bmi2"))) static void *fn##_wide(void *arg) { return body(arg); } \
    static void *fn(void *arg) { return use_wide ? fn##_wide(arg) : fn##_plain(arg); }
#define TWO_BUILDS_FLAG(fn, body)                                                                     \
    static void *fn##_plain(void *arg) { return body(arg, 0); }                                      \
    __attribute__((target("avx2,bmi,bmi2"))) static void *fn##_wide(void *arg) { return body(arg, 1); } \
    static void *fn(void *arg) { return use_wide ? fn##_wide(arg) : fn##_plain(arg); }
#else
#define TWO_BUILDS(fn, body) \
    static void *fn(void *arg) { return body(arg); }
#define TWO_BUILDS_FLAG(fn, body) \
    static void *fn(void *arg) { return body(arg, 0); }
#endif
#endif
