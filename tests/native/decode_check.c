/* The Huffman decoder (fast/codec/native/decode.c) on cases from tests/test_aarch64.py, under qemu-aarch64.
 *
 * Per case, records in (check_io.h): int64 [rows, cols, chunk size, chunks per group, max code length, stream
 * bits, threads], the palette and code lengths (uint8), stream, offsets, vchunks (uint32), vexp, sm (uint8), the
 * expected CRCs (uint32 [6]: sm, stream, offsets, vchunks, vexp, data), and bytes to CRC.
 * Out, under each cap (ISA_SCALAR: the tables; ISA_NEON: ARM's CRC32 where the CPU has it): int32 [the error
 * code, the CRC level in use, crc_io[6], crc_io[7]], the decoded bf16 (uint16 [rows * cols]), int32 [CRC-32 of
 * the bytes in one piece and in three].
 */
#include "../../fast/codec/native/decode.c"

#include "check_io.h"

int main(int argc, char **argv) {
    rec_open(argc, argv);
    int64_t n;
    for (int64_t *par; (par = rec_next(&n));) {
        int64_t np, nl, words, nv, nvexp, nsm, ncrc, nbytes;
        const uint8_t *palette = rec_need(&np), *lengths = rec_need(&nl);
        const uint32_t *stream = rec_need(&words), *offsets = rec_need(&n), *vchunks = rec_need(&nv);
        const uint8_t *vexp = rec_need(&nvexp), *sm = rec_need(&nsm);
        const uint32_t *crc = rec_need(&ncrc);
        const uint8_t *bytes = rec_need(&nbytes);
        const int64_t rows = par[0], cols = par[1], cs = par[2], cpg = par[3], L = par[4], bits = par[5];
        uint16_t *single = malloc(sizeof(uint16_t) << L), *out = malloc(2 * (size_t)(rows * cols) + 2);
        uint64_t *multi = malloc(sizeof(uint64_t) << L);
        unw_tables(lengths, palette, (int)np, (int)L, single, multi);
        for (int isa = ISA_SCALAR; isa <= ISA_NEON; isa++) {
            int32_t result[4];
            uint32_t io[8];
            memcpy(io, crc, 24);
            io[6] = io[7] = 0;
            result[1] = unw_isa(isa) >> 2;
            result[0] = unw_decode(stream, words / 4, bits, offsets, vchunks, nv / 4, vexp, sm, palette, (int)np,
                                   single, multi, (int)L, rows, cols, cs, cpg, (int)par[6], 300, io, out);
            result[2] = (int32_t)io[6], result[3] = (int32_t)io[7];
            rec_put(result, sizeof result);
            rec_put(out, 2 * rows * cols);
            uint32_t crcs[2] = {unw_crc32(bytes, nbytes, 1), unw_crc32(bytes, nbytes, 3)};
            rec_put(crcs, sizeof crcs);
        }
    }
    return 0;
}
