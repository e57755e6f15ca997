/* Scratch buffers kept between calls, for the decoders' per-call tables and per-thread buffers.
 *
 *   p = scratch_take(bytes)   a buffer of at least bytes (contents undefined), or NULL when out of memory
 *   scratch_give(p)           hand it back (NULL is ignored): kept for a later call, or freed
 *
 * Why: a decoder call needs a few buffers of 0.1-2 MB (decoding tables, a block's values). malloc serves those
 * with fresh mmap'd pages, and the kernel zeroes and maps every page on first touch, for each of SmolLM2's 211
 * tensors (a one-thread pass over its container, Intel Xeon: ~445 ms with fresh buffers, ~425 kept). Kept
 * buffers are touched once.
 * SCRATCH_SLOTS buffers at most are kept (lock-free: a slot is taken by an atomic exchange, so a fork() in the
 * middle of a call cannot leave a lock held); a call takes the first kept buffer large enough, freeing the smaller
 * ones it meets (so the kept buffers grow to the size the calls need), else allocates.
 */
#ifndef UNW_SCRATCH_H
#define UNW_SCRATCH_H
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define SCRATCH_SLOTS 16
#define SCRATCH_KEEP (4u << 20) /* larger buffers are freed, not kept (at most 64 MB kept in all) */
#define SCRATCH_HEAD 64          /* the head in front of a buffer (64: keeps the buffer 64-byte aligned) */

typedef struct {
    size_t bytes; /* the buffer's size */
    void *block;  /* what malloc gave (the head and the buffer lie inside it) */
} ScratchHead;

static ScratchHead *scratch_slot[SCRATCH_SLOTS];

static void scratch_free(ScratchHead *h) {
    if (h)
        free(h->block);
}

static void *scratch_take(size_t bytes) {
    for (int i = 0; i < SCRATCH_SLOTS; i++) {
        ScratchHead *h = __atomic_exchange_n(&scratch_slot[i], NULL, __ATOMIC_ACQUIRE);
        if (h && h->bytes >= bytes)
            return (char *)h + SCRATCH_HEAD;
        scratch_free(h); /* too small: the kept buffers grow to what the calls need */
    }
    char *block = malloc(bytes + 2 * SCRATCH_HEAD);
    if (!block)
        return NULL;
    /* the buffer at the first 64-byte boundary at least SCRATCH_HEAD past the start, its head just before it */
    char *buffer = (char *)(((uintptr_t)block + 2 * SCRATCH_HEAD - 1) & ~(uintptr_t)(SCRATCH_HEAD - 1));
    ScratchHead *h = (ScratchHead *)(buffer - SCRATCH_HEAD);
    h->bytes = bytes, h->block = block;
    return buffer;
}

static void scratch_give(void *buffer) {
    if (!buffer)
        return;
    ScratchHead *h = (ScratchHead *)((char *)buffer - SCRATCH_HEAD);
    for (int i = 0; h->bytes <= SCRATCH_KEEP && i < SCRATCH_SLOTS; i++) {
        ScratchHead *none = NULL;
        if (__atomic_compare_exchange_n(&scratch_slot[i], &none, h, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED))
            return;
    }
    scratch_free(h);
}
#endif
