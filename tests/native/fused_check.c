/* The fused ops (fast/engine/native/fused_ops.c) on cases from tests/test_aarch64.py, under qemu-aarch64: their
 * plain loops (the only ones off x86), which the test compares with the torch lines' bits.
 *
 * Per case, records in (check_io.h): int64 [rows n, heads, kv heads, head size d, RoPE positions, cache slots,
 * norm width h, norm lanes], float32 [eps], qkv (uint16 [n, (heads + 2 kv) d]), cos and signed sin (float32
 * [positions, d]), positions and slots (int64 [n]), the k and v caches (uint16 [slots, kv, d]), then for the norm
 * x (float32 [n, h]), delta (uint16 [n, h]), weight (float32 [h]) and r (float32 [n]: torch's sqrt of the mean
 * squares, which the model takes between the two C passes).
 * Out: int32 [RoPE's return code], q (uint16 [n, heads, d]), the k and v caches, x + float(delta) (float32),
 * mean(x^2) + eps (float32 [n]), bf16(x / r * w) (uint16 [n, h]).
 */
#include "../../fast/engine/native/fused_ops.c"

#include "check_io.h"

int main(int argc, char **argv) {
    rec_open(argc, argv);
    int64_t m, nk, nv;
    for (int64_t *par; (par = rec_next(&m));) {
        const float *eps = rec_need(&m);
        const uint16_t *qkv = rec_need(&m);
        const float *cos = rec_need(&m), *ssin = rec_need(&m);
        const int64_t *positions = rec_need(&m), *slots = rec_need(&m);
        uint16_t *k = rec_need(&nk), *v = rec_need(&nv);
        const float *x = rec_need(&m);
        const uint16_t *delta = rec_need(&m);
        const float *w = rec_need(&m), *r = rec_need(&m);
        const int64_t n = par[0], heads = par[1], kv = par[2], d = par[3], h = par[6];
        uint16_t *q = malloc(2 * (size_t)(n * heads * d) + 2), *normed = malloc(2 * (size_t)(n * h) + 2);
        float *x_out = malloc(4 * (size_t)(n * h) + 4), *ms = malloc(4 * (size_t)n + 4);
        int32_t code = unf_rope_write_bf16(qkv, n, heads, kv, d, cos, ssin, par[4], positions, slots, par[5], k, v, q, 0);
        rec_put(&code, 4);
        rec_put(q, 2 * n * heads * d);
        rec_put(k, nk);
        rec_put(v, nv);
        code = unf_add_mean_squares(x, delta, x_out, n, h, *eps, ms, par[7], 0);
        unf_scale_rows_bf16(x_out, r, w, n, h, normed, 0);
        rec_put(x_out, 4 * n * h);
        rec_put(ms, 4 * n);
        rec_put(normed, 2 * n * h);
    }
    return 0;
}
