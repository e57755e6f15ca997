/* Ranges of work in POSIX threads, shared by encode.c and decode.c (each includes this file). */
#ifndef UNW_THREADS_H
#define UNW_THREADS_H
#include <pthread.h>
#include <stddef.h>

#define MAX_THREADS 64

/* Runs fn(arg + t * size) for t < threads, on threads 1.. and the caller; 0, or -1 if a thread failed
 * to start (its share then runs on the caller: the result is the same, only slower). */
static int run_threads(void *(*fn)(void *), void *arg, size_t size, int threads) {
    pthread_t id[MAX_THREADS];
    int started = 1, failed = 0;
    for (; started < threads; started++)
        if (pthread_create(&id[started], NULL, fn, (char *)arg + started * size) != 0)
            break;
    fn(arg);
    for (int t = 1; t < started; t++)
        pthread_join(id[t], NULL);
    for (int t = started; t < threads; t++, failed = 1) /* could not start: do it here */
        fn((char *)arg + t * size);
    return failed ? -1 : 0;
}

/* A pool of threads that stay alive between calls, for work too short to pay for starting threads
 * (a decode step's products take tens of microseconds each). pool_run(fn, arg, size, threads) runs
 * like run_threads; if another caller holds the pool, or its threads cannot start, it falls back to
 * run_threads (same results). Between calls a worker spins a little (the next product usually comes
 * within microseconds), then sleeps on a condition variable; every started worker answers every call
 * (those beyond `threads` with nothing to do). After fork() the child starts a fresh pool. */
#define POOL_SPINS 256

typedef struct {
    pthread_mutex_t busy, lock;
    pthread_cond_t go, done;
    int started, pending, want;
    unsigned long generation;
    void *(*fn)(void *);
    char *arg;
    size_t size;
} unw_pool;

static unw_pool the_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                            PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL, 0};
typedef struct {
    int me;
    unsigned long seen; /* the generation when it started: it answers every later one */
} pool_start;
static pool_start pool_index[MAX_THREADS];

/* A hint to the core that this is a spin-wait loop (x86 PAUSE, ARM YIELD): less power, and the other
 * hardware thread of the core runs meanwhile. */
static inline void pool_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static void *pool_worker(void *p) {
    const int me = ((pool_start *)p)->me;
    unsigned long seen = ((pool_start *)p)->seen;
    for (;;) {
        unsigned long g;
        int spins = 0;
        while ((g = __atomic_load_n(&the_pool.generation, __ATOMIC_ACQUIRE)) == seen) {
            if (++spins < POOL_SPINS) {
                pool_pause();
                continue;
            }
            pthread_mutex_lock(&the_pool.lock);
            while (the_pool.generation == seen)
                pthread_cond_wait(&the_pool.go, &the_pool.lock);
            pthread_mutex_unlock(&the_pool.lock);
            spins = 0;
        }
        seen = g;
        if (me < the_pool.want) /* the fields of this call stay put until every worker answered */
            the_pool.fn(the_pool.arg + (size_t)me * the_pool.size);
        if (__atomic_sub_fetch(&the_pool.pending, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&the_pool.lock);
            pthread_cond_signal(&the_pool.done);
            pthread_mutex_unlock(&the_pool.lock);
        }
    }
    return NULL;
}

static void pool_after_fork(void) {
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    the_pool.busy = the_pool.lock = m;
    the_pool.go = the_pool.done = c;
    the_pool.started = the_pool.pending = 0;
}

__attribute__((unused)) static int pool_run(void *(*fn)(void *), void *arg, size_t size, int threads) {
    if (threads <= 1) {
        fn(arg);
        return 0;
    }
    if (pthread_mutex_trylock(&the_pool.busy) != 0)
        return run_threads(fn, arg, size, threads);
    if (the_pool.started == 0)
        pthread_atfork(NULL, NULL, pool_after_fork);
    while (the_pool.started < threads - 1) { /* worker i runs share i + 1 */
        pthread_t id;
        const int i = the_pool.started;
        pool_index[i] = (pool_start){i + 1, the_pool.generation}; /* set only here, under busy */
        if (pthread_create(&id, NULL, pool_worker, &pool_index[i]) != 0)
            break;
        pthread_detach(id);
        the_pool.started++;
    }
    if (the_pool.started < threads - 1) {
        pthread_mutex_unlock(&the_pool.busy);
        return run_threads(fn, arg, size, threads);
    }
    pthread_mutex_lock(&the_pool.lock);
    the_pool.fn = fn;
    the_pool.arg = (char *)arg;
    the_pool.size = size;
    the_pool.want = threads;
    __atomic_store_n(&the_pool.pending, the_pool.started, __ATOMIC_RELEASE);
    __atomic_store_n(&the_pool.generation, the_pool.generation + 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&the_pool.go);
    pthread_mutex_unlock(&the_pool.lock);
    fn(arg);
    for (int spins = 0; __atomic_load_n(&the_pool.pending, __ATOMIC_ACQUIRE) > 0 && spins < POOL_SPINS; spins++)
        pool_pause();
    pthread_mutex_lock(&the_pool.lock);
    while (__atomic_load_n(&the_pool.pending, __ATOMIC_ACQUIRE) > 0)
        pthread_cond_wait(&the_pool.done, &the_pool.lock);
    pthread_mutex_unlock(&the_pool.lock);
    pthread_mutex_unlock(&the_pool.busy);
    return 0;
}
#endif

