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
 * run_threads (same results). Workers sleep on a condition variable between calls; after fork() the
 * child starts a fresh pool (the parent's threads do not exist there). */
typedef struct {
    pthread_mutex_t busy, lock;
    pthread_cond_t go, done;
    int started, pending, stop;
    unsigned long generation;
    void *(*fn)(void *);
    char *arg;
    size_t size;
    int want;
} unw_pool;

static unw_pool the_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
                            PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL, 0, 0};
static int pool_index[MAX_THREADS];

static void *pool_worker(void *p) {
    const int me = *(int *)p;
    unsigned long seen = 0;
    pthread_mutex_lock(&the_pool.lock);
    for (;;) {
        while (the_pool.generation == seen)
            pthread_cond_wait(&the_pool.go, &the_pool.lock);
        seen = the_pool.generation;
        if (me >= the_pool.want)
            continue;
        void *(*fn)(void *) = the_pool.fn;
        char *arg = the_pool.arg + (size_t)me * the_pool.size;
        pthread_mutex_unlock(&the_pool.lock);
        fn(arg);
        pthread_mutex_lock(&the_pool.lock);
        if (--the_pool.pending == 0)
            pthread_cond_signal(&the_pool.done);
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
    pthread_mutex_lock(&the_pool.lock);
    if (the_pool.started == 0)
        pthread_atfork(NULL, NULL, pool_after_fork);
    while (the_pool.started < threads - 1) { /* worker i runs share i + 1 */
        pthread_t id;
        const int i = the_pool.started;
        pool_index[i] = i + 1;
        if (pthread_create(&id, NULL, pool_worker, &pool_index[i]) != 0)
            break;
        pthread_detach(id);
        the_pool.started++;
    }
    if (the_pool.started < threads - 1) {
        pthread_mutex_unlock(&the_pool.lock);
        pthread_mutex_unlock(&the_pool.busy);
        return run_threads(fn, arg, size, threads);
    }
    the_pool.fn = fn;
    the_pool.arg = (char *)arg;
    the_pool.size = size;
    the_pool.want = threads;
    the_pool.pending = threads - 1;
    the_pool.generation++;
    pthread_cond_broadcast(&the_pool.go);
    pthread_mutex_unlock(&the_pool.lock);
    fn(arg);
    pthread_mutex_lock(&the_pool.lock);
    while (the_pool.pending > 0)
        pthread_cond_wait(&the_pool.done, &the_pool.lock);
    pthread_mutex_unlock(&the_pool.lock);
    pthread_mutex_unlock(&the_pool.busy);
    return 0;
}
#endif

