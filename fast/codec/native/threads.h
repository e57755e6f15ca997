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
#endif
