/* The rANS decoder (fast/codec/native/rans_decode.c) on cases from tests/test_aarch64.py, under qemu-aarch64.
 *
 * Per case, records in (check_io.h): int64 [alphabet size, tables, n, block size, lanes, prob bits, mantissa bits,
 * escapes, threads, low bits, low tables, context stride, context period], then raw (uint8), alphabet, tables
 * (uint16), stream (uint16), block_words, states (uint32), block_table (uint8), escapes (uint8), block_escapes
 * (uint32), the expected CRCs (uint32 [13]: raw, stream, escapes, data, then the small arrays in decode_rans_c.py's
 * SMALL_ARRAYS order), symbol_class (uint8), low_freqs (uint16),
 * context_table (uint8). Python has run the checks it runs before the C decoder (decode_rans_c.py).
 * Out, under each cap (ISA_SCALAR; ISA_NEON): int32 [the error code, crc_io[4], crc_io[5]], the decoded bf16
 * (uint16 [n]).
 */
#include "../../fast/codec/native/rans_decode.c"

#include "check_io.h"

int main(int argc, char **argv) {
    rec_open(argc, argv);
    int64_t n;
    for (int64_t *par; (par = rec_next(&n));) {
        int64_t nraw, nesc, words;
        const uint8_t *raw = rec_need(&nraw);
        const uint16_t *alphabet = rec_need(&n), *tables = rec_need(&n), *stream = rec_need(&words);
        const uint32_t *block_words = rec_need(&n), *states = rec_need(&n);
        const uint8_t *block_table = rec_need(&n), *escapes = rec_need(&nesc);
        const uint32_t *block_escapes = rec_need(&n), *crc = rec_need(&n);
        const uint8_t *symbol_class = rec_need(&n);
        const uint16_t *low_freqs = rec_need(&n);
        const uint8_t *context_table = rec_need(&n);
        uint16_t *out = malloc(2 * (size_t)par[2] + 2);
        for (int isa = ISA_SCALAR; isa <= ISA_NEON; isa++) {
            uint32_t io[15];
            int32_t result[3];
            memcpy(io, crc, 16);
            io[4] = io[5] = 0;
            memcpy(io + 6, crc + 4, 36);
            unw_rans_isa(isa);
            result[0] = unw_rans_decode(raw, nraw, alphabet, (int)par[0], tables, (int)par[1], stream, words / 2,
                                        block_words, states, block_table, escapes, nesc, block_escapes, par[7],
                                        par[2], par[3], (int)par[4], (int)par[5], (int)par[6], (int)par[9],
                                        symbol_class, low_freqs, (int)par[10], context_table, par[11], par[12],
                                        (int)par[8], io, out);
            result[1] = (int32_t)io[4], result[2] = (int32_t)io[5];
            rec_put(result, sizeof result);
            rec_put(out, 2 * par[2]);
        }
    }
    return 0;
}
