/* Records in and out of the kernel drivers of tests/test_aarch64.py (run under qemu-aarch64).
 *
 * A file is a run of records, each a little-endian uint64 byte count, then that many bytes. The Python test
 * writes the inputs of its cases (made on the x86 side by the Python encoders), a driver reads them in a fixed
 * order, runs the kernel and writes its outputs as records, which the test compares byte for byte.
 *
 *   rec_open(argc, argv)   argv[1] the input file, argv[2] the output file (exits 2 on a bad call)
 *   rec_next(&n)           the next record (malloc'd, 64 zero bytes past its end, 64-byte aligned), its length
 *                          in n; NULL at the end of the input
 *   rec_need(&n)           the same, exiting 3 if the input ended early
 *   rec_put(p, n)          write one record
 */
#ifndef UNW_CHECK_IO_H
#define UNW_CHECK_IO_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static FILE *rec_in, *rec_out;

static void rec_open(int argc, char **argv) {
    if (argc != 3 || !(rec_in = fopen(argv[1], "rb")) || !(rec_out = fopen(argv[2], "wb"))) {
        fprintf(stderr, "usage: %s INPUT OUTPUT (records: see tests/native/check_io.h)\n", argv[0]);
        exit(2);
    }
}

static void *rec_next(int64_t *n) {
    uint64_t len;
    if (fread(&len, 8, 1, rec_in) != 1)
        return NULL;
    uint8_t *p = malloc(len + 128); /* never freed (a short-lived check); 64 bytes of zeros past the end */
    if (p)
        p += (64 - ((uintptr_t)p & 63)) & 63;
    if (!p || fread(p, 1, len, rec_in) != len) {
        fprintf(stderr, "a record of %llu bytes is cut short (or no memory)\n", (unsigned long long)len);
        exit(3);
    }
    memset(p + len, 0, 64);
    *n = (int64_t)len;
    return p;
}

static void *rec_need(int64_t *n) {
    void *p = rec_next(n);
    if (!p) {
        fprintf(stderr, "the input ended inside a case\n");
        exit(3);
    }
    return p;
}

static void rec_put(const void *p, int64_t n) {
    uint64_t len = (uint64_t)n;
    if (fwrite(&len, 8, 1, rec_out) != 1 || fwrite(p, 1, (size_t)n, rec_out) != (size_t)n) {
        fprintf(stderr, "could not write the output\n");
        exit(4);
    }
}
#endif
