/* The decode attention (fast/kv/native/decode_attention.c) on cases from tests/test_aarch64.py, under qemu-aarch64:
 * its plain C loops (the only ones off x86), which the test compares bit for bit with the same loops on x86
 * (UNFIRE_NATIVE_SIMD=0): no contraction into FMAs at -std=c99, the same exp_f32, the same order of every sum.
 *
 * Per case, records in (check_io.h): int64 [rows n, heads, kv heads, head size d, block size, blocks, table width,
 * max length], float32 [scale], q (uint16 [n, heads, d]), the k and v caches (uint16 [blocks, block size, kv, d]),
 * the block tables (int32 [sequences, table width]), seq_lens (int32), chunks and rows (int64 [n]), row lengths
 * (int32 [n], or no bytes: decode rows).
 * Out: int32 [the return code], out (uint16 [n, heads, d]).
 */
#include "../../fast/kv/native/decode_attention.c"

#include "check_io.h"

int main(int argc, char **argv) {
    rec_open(argc, argv);
    int64_t m, nq, nrl;
    for (int64_t *par; (par = rec_next(&m));) {
        const float *scale = rec_need(&m);
        const uint16_t *q = rec_need(&nq), *k = rec_need(&m), *v = rec_need(&m);
        const int32_t *tables = rec_need(&m), *seq_lens = rec_need(&m);
        const int64_t *chunks = rec_need(&m), *rows = rec_need(&m);
        const int32_t *row_lens = rec_need(&nrl);
        const int64_t n = par[0], heads = par[1], kv = par[2], d = par[3];
        float *scratch = malloc(4 * (size_t)unf_decode_attention_scratch(heads, kv, d, par[7]));
        uint16_t *out = calloc((size_t)nq + 2, 1);
        int32_t code = unf_decode_attention(q, k, v, tables, seq_lens, chunks, rows, nrl ? row_lens : NULL, n, heads,
                                            kv, d, par[4], par[5], par[6], par[7], *scale, scratch, out, 0);
        rec_put(&code, 4);
        rec_put(out, nq);
    }
    return 0;
}
