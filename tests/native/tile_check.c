/* The tile products (fast/codec/native/tile_matmul.c) on cases from tests/test_aarch64_tiles.py, under
 * qemu-aarch64: the NEON path and the scalar fmaf loop, on the plain and the compressed tiles, which the test
 * compares with the x86 products' bits (the portable order: one answer on every ISA that follows it).
 *
 * Per case, records in (check_io.h): int64 [M, N, K, threads], x (uint16 [M, Kp], zero padded to Kp, a
 * multiple of 32), the plain tiles (uint16 [P * T * 512]), then the compressed arrays sm (uint8 [P * T * 512]),
 * idx (uint8 [P * T * 256]), palette (uint8 [16]), pstart (int64 [P * T + 1]), pword (int16), pexp (uint8).
 * Out, for path 4 (neon) then path 2 (scalar), plain then compressed: int32 [tm_matmul's return code], then
 * y (uint16 [M, N]).
 */
#include "../../fast/codec/native/tile_matmul.c"

#include "check_io.h"

int main(int argc, char **argv) {
    rec_open(argc, argv);
    int64_t n;
    for (int64_t *par; (par = rec_next(&n));) {
        const int64_t M = par[0], N = par[1], K = par[2], Kp = (K + 31) / 32 * 32;
        const uint16_t *x = rec_need(&n), *plain = rec_need(&n);
        const uint8_t *sm = rec_need(&n), *idx = rec_need(&n), *pal = rec_need(&n);
        const int64_t *pstart = rec_need(&n);
        const uint16_t *pword = rec_need(&n);
        const uint8_t *pexp = rec_need(&n);
        uint16_t *y = malloc(2 * (size_t)(M * N) + 2);
        const int paths[2] = {PATH_NEON, PATH_SCALAR};
        for (int i = 0; i < 2; i++)
            for (int compressed = 0; compressed < 2; compressed++) {
                memset(y, 0xff, 2 * (size_t)(M * N)); /* NaN-poisoned: an output left unwritten shows */
                int32_t rc = tm_matmul(x, M, M, Kp, N, compressed ? NULL : plain, compressed ? sm : NULL, idx, pal,
                                       pstart, pword, pexp, y, paths[i], (int)par[3], Kp, K);
                rec_put(&rc, 4);
                rec_put(y, 2 * M * N);
            }
        free(y);
    }
    return 0;
}
