"""The launches the fast path makes on a GPU at real shapes, computed without one.

Llama-3.1-8B (hidden 4096, intermediate 14336, 32 query / 8 KV heads, head_dim 128; the engine
fuses q/k/v into one [6144, 4096] matrix and gate/up into one [28672, 4096]):

* its projections at batch 1, 4, 16, 64, 256, plain bf16 and fused palette weights, and the split-K
  reduce where the launcher splits;
* its KV cache (block 16; bf16, fp8 and fp32 caches, bf16 and fp32 queries): decode attention split
  and unsplit, the split merge, 512-token prefill chunks, and the write-to-cache kernels;
* every codec decode kernel (palette decode, Huffman decode and transcode, verbatim patch) at a
  4096 x 14336 tensor, and the bf16 rounding kernel.

Tiles, warps, stages and splits come from the launchers' own pure functions
(``fast.codec.matmul_triton.default_config``, ``fast.codec.palette_triton.decode_config``,
``fast.kv.attention_triton.num_splits_for``) with the H100/H200 properties of
``fast.triton_util``, so what is compiled here is what a GPU would launch. The argument lists follow
the launchers; ``tests/test_compile_gate.py`` checks each against a launch recorded from the
running code. ``subset`` is the representative few CI compiles; ``all`` is everything (gpu_check).
"""

from __future__ import annotations

from conformance.launches import Launch, make_launch

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4096, 14336, 32, 8, 128, 16
PROJECTIONS = {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "o": (HIDDEN, HIDDEN),
               "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
BATCHES = (1, 4, 16, 64, 256)
CODEC_SHAPE = (4096, 14336)
CHUNK, GROUP, MAX_L = 64, 32, 12  # the codec's defaults (reference/codec/codec.py)


def T(dtype: str, aligned: bool = True) -> tuple:
    """A tensor argument of ``dtype`` (torch's name)."""
    return ("tensor", dtype, aligned)


def _plan(kernel, origin: str, default: bool = True, num_warps: int = 4, num_stages: int = 3, **values) -> Launch:
    """A launch of ``kernel`` (a @triton.jit object) with arguments by name: descriptors or plain values."""
    fn = getattr(kernel, "fn", kernel)
    launch = make_launch(fn, (), {k: _Desc(v) if isinstance(v, tuple) else v for k, v in values.items()},
                         origin, default)
    return Launch(launch.kernel, launch.args, num_warps, num_stages, origin, default, (origin,))


class _Desc:
    """A descriptor passed through ``make_launch`` as if it were a value."""

    def __init__(self, d: tuple):
        self.d = d

    @property
    def dtype(self) -> str:
        return self.d[1]

    def data_ptr(self) -> int:
        return 0 if self.d[2] else 2


def matmul_launches(props) -> list[Launch]:
    from fast.codec import matmul_triton as mm
    from fast.triton_util import cdiv

    out = []
    for name, (n, k) in PROJECTIONS.items():
        for m in BATCHES:
            for fused in (False, True):
                cfg = mm.default_config(m, n, k, props)
                k_per_split = cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
                split = cdiv(k, k_per_split)
                where = f"llama8b.{name}.b{m}.{'fused' if fused else 'plain'} on {props.name}"
                w = dict(w_ptr=T("uint8"), idx_ptr=T("uint8"), sm_ptr=T("uint8"), palette_ptr=T("uint8"),
                         vchunks_ptr=T("int64"), vexp_ptr=T("uint8"), vstart_ptr=T("int64"),
                         row_vstart_ptr=T("int64"), half_k=k // 2, chunks_per_row=k // CHUNK, CS=CHUNK)
                if not fused:
                    w.update(w_ptr=T("bfloat16"), idx_ptr=T("uint8"), vchunks_ptr=T("int64"), half_k=0,
                             chunks_per_row=1, CS=64)
                out.append(_plan(mm._matmul_kernel, where, True, cfg.num_warps, cfg.num_stages,
                                 x_ptr=T("bfloat16"), bias_ptr=T("uint8"), out_ptr=T("int16"),
                                 part_ptr=T("float32") if split > 1 else T("int16"), M=m, N=n, K=k,
                                 k_per_split=k_per_split, W_PALETTE=fused, HAS_BIAS=False, SPLIT_K=split,
                                 NV_ITERS=cdiv(cfg.block_k, w["CS"]) + 1, BM=cfg.block_m, BN=cfg.block_n,
                                 BK=cfg.block_k, DOT_F32=False, **w))
                if split > 1:
                    out.append(_plan(mm._reduce_kernel, where + " (split-K reduce)", True, 4, 3,
                                     part_ptr=T("float32"), bias_ptr=T("uint8"), out_ptr=T("int16"), M=m, N=n,
                                     HAS_BIAS=False, SPLIT_K=split, BLOCK=1024))
    return out


def codec_launches(props) -> list[Launch]:
    from fast import bf16
    from fast.codec import decode_triton as hd
    from fast.codec import palette_triton as pd
    from fast.triton_util import cdiv

    rows, cols = CODEC_SHAPE
    n = rows * cols
    where = f"codec {rows}x{cols} on {props.name}"
    br, bc, splits = pd.decode_config(rows, cols, props)
    cols_per_split = cdiv(cdiv(cols, splits), bc) * bc
    splits = cdiv(cols, cols_per_split)
    out = [_plan(pd._palette_decode_kernel, where, True, idx_ptr=T("uint8"), sm_ptr=T("uint8"),
                 palette_ptr=T("uint8"), vchunks_ptr=T("int64"), vexp_ptr=T("uint8"), vstart_ptr=T("int64"),
                 row_vstart_ptr=T("int64"), out_ptr=T("int16"), n_rows=rows, n_cols=cols, half_cols=cols // 2,
                 chunks_per_row=cols // CHUNK, cols_per_split=cols_per_split, CS=CHUNK,
                 NV_ITERS=cdiv(bc, CHUNK) + 1, SPLITS=splits, BR=br, BC=bc)]
    n_chunks = n // CHUNK
    n_groups = cdiv(n_chunks, GROUP)
    stream_words = n * 3 // 32  # about 3 bits per exponent
    for mode in (0, 1):
        out.append(_plan(hd._huffman_kernel, f"{where} (Huffman {'decode' if mode == 0 else 'transcode'})", True,
                         windows_ptr=T("int64"), last_word=stream_words - 2, offsets_ptr=T("int64"),
                         gvstart_ptr=T("int64"), vchunks_ptr=T("int64"), n_verbatim=37, sm_ptr=T("uint8"),
                         lut_ptr=T("int64"), out_ptr=T("int16") if mode == 0 else T("uint8"),
                         status_ptr=T("int32"), n_groups=n_groups, n_chunks=n_chunks, cols=cols,
                         chunks_per_row=cols // CHUNK, CS=CHUNK, G=GROUP, L=MAX_L, MODE=mode,
                         BLOCK=min(64, 1 << (n_groups - 1).bit_length())))
    block_w = min(1 << (CHUNK - 1).bit_length(), 256)
    out.append(_plan(hd._verbatim_kernel, f"{where} (verbatim chunks)", True, vchunks_ptr=T("int64"), n_verbatim=37,
                     vexp_ptr=T("uint8"), sm_ptr=T("uint8"), out_ptr=T("int16"), cols=cols,
                     chunks_per_row=cols // CHUNK, CS=CHUNK, BLOCK_V=max(1, 4096 // block_w), BLOCK_W=block_w))
    out.append(_plan(bf16._round_kernel, f"bf16 rounding of {rows}x{cols}", True, x_ptr=T("float32"),
                     out_ptr=T("int16"), n=n, BLOCK=1024))
    return out


CACHES = {"bf16": "bfloat16", "fp32": "float32", "fp8": "uint8"}


def kv_launches(props) -> list[Launch]:
    from fast.kv import attention_triton as ta
    from fast.kv import write_triton as tw

    out = []
    max_blocks = 4096 // BLOCK  # a 4K-token context
    for cache, store in CACHES.items():
        for q in ("bfloat16", "float32"):
            qb = q == "bfloat16"
            exp = T("int8") if cache == "fp8" else T(store)
            common = dict(q_ptr=T(q), out_ptr=T("int16") if qb else T("float32"), k_ptr=T(store), v_ptr=T(store),
                          kexp_ptr=exp, vexp_ptr=exp, tables_ptr=T("int32"), table_stride=max_blocks, scale=0.088,
                          IS_FP8=cache == "fp8", OUT_BF16=qb, HEADS=KV_HEADS, GROUP=HEADS // KV_HEADS, DIM=HEAD_DIM,
                          BLOCK_SIZE=BLOCK)
            for batch in (1, 64):
                splits = ta.num_splits_for(batch, KV_HEADS, max_blocks, props)
                per_split = -(-max_blocks // splits)
                where = f"kv.decode {cache} cache, {q} q, batch {batch}, {splits} split(s) on {props.name}"
                part = T("float32")  # (a 1-element dummy when unsplit)
                out.append(_plan(ta._decode_kernel, where, True, ta.decode_num_warps(4, BLOCK, HEAD_DIM), 3,
                                 seq_lens_ptr=T("int32"), part_m_ptr=part,
                                 part_l_ptr=part, part_acc_ptr=part, blocks_per_split=per_split,
                                 SPLIT=splits > 1, NUM_SPLITS=splits, G_P2=4, D_P2=HEAD_DIM, BS_P2=BLOCK, **common))
                if splits > 1:
                    out.append(_plan(ta._combine_kernel, where + " (merge)", True, out_ptr=common["out_ptr"],
                                     part_m_ptr=T("float32"), part_l_ptr=T("float32"), part_acc_ptr=T("float32"),
                                     OUT_BF16=qb, NUM_SPLITS=splits, HEADS=KV_HEADS, GROUP=HEADS // KV_HEADS,
                                     DIM=HEAD_DIM, G_P2=4, D_P2=HEAD_DIM))
            block_m = ta.prefill_block_m(HEAD_DIM, props)
            out.append(_plan(ta._prefill_kernel, f"kv.prefill 512-token chunk, {cache} cache, {q} q on {props.name}",
                             True, ta.prefill_num_warps(block_m, HEAD_DIM), 3, query_starts_ptr=T("int32"),
                             context_lens_ptr=T("int32"), BLOCK_M=block_m, D_P2=HEAD_DIM,
                             **{k: v for k, v in common.items() if k != "table_stride"},
                             table_stride=512 // BLOCK + max_blocks))
            x = T(q)
            row = KV_HEADS * HEAD_DIM
            where = f"kv.write 512 tokens, {q} into a {cache} cache"
            if cache != "fp8":
                to_bf16 = cache == "bf16" and q == "float32"
                src = T("float32") if cache == "fp32" else (x if to_bf16 else T("int16"))
                out.append(_plan(tw._copy_kernel, where, True, x_ptr=src, store_ptr=T("int16") if cache == "bf16"
                                 else T("float32"), slots_ptr=T("int64"), ROW=row, ROW_P2=row, TO_BF16=to_bf16))
                continue
            out.append(_plan(tw._row_exponent_kernel, where + " (row exponents)", True, x_ptr=x, out_ptr=T("int32"),
                             HEADS=KV_HEADS, DIM=HEAD_DIM, H_P2=KV_HEADS, D_P2=HEAD_DIM))
            out.append(_plan(tw._rescale_kernel, where + " (rescale)", True, codes_ptr=T("uint8"), exps_ptr=T("int8"),
                             new_ptr=T("int32"), fresh_ptr=T("int32"), owner_ptr=T("int64"), slots_ptr=T("int64"),
                             BLOCK_SIZE=BLOCK, HEADS=KV_HEADS, DIM=HEAD_DIM, BS_P2=BLOCK, D_P2=HEAD_DIM))
            out.append(_plan(tw._encode_kernel, where + " (encode)", True, x_ptr=x, codes_ptr=T("uint8"),
                             new_ptr=T("int32"), slots_ptr=T("int64"), BLOCK_SIZE=BLOCK, HEADS=KV_HEADS,
                             DIM=HEAD_DIM, H_P2=KV_HEADS, D_P2=HEAD_DIM))
    out.append(_plan(tw._encode_elementwise_kernel, "fp8 encode_codes of 512 x 1024", True, x_ptr=T("float32"),
                     e_ptr=T("int32"), out_ptr=T("uint8"), n=512 * 1024, BLOCK=1024))
    return out


def all_launches(props_list=None) -> list[Launch]:
    """Every real-shape launch, for each GPU in ``props_list`` (default: H100 and H200)."""
    from fast.triton_util import H100, H200

    out = []
    for props in props_list or (H100, H200):
        out += matmul_launches(props) + codec_launches(props) + kv_launches(props)
    return out


SUBSET = ("llama8b.gate_up.b1.", "llama8b.gate_up.b16.", "llama8b.gate_up.b256.", "llama8b.down.b4.",
          "codec ", "kv.decode bf16 cache, bfloat16 q", "kv.decode fp8 cache, bfloat16 q, batch 1",
          "kv.prefill 512-token chunk, bf16 cache, bfloat16", "kv.prefill 512-token chunk, fp8 cache, bfloat16",
          "kv.write 512 tokens, bfloat16 into a fp8", "kv.write 512 tokens, float32 into a bf16", "bf16 rounding",
          "fp8 encode_codes")


def gpus_for(target: str) -> list:
    """The GPUs whose launches a compile target checks: sm_90 H100 and H200, sm_80 A100."""
    from fast.triton_util import A100, H100, H200

    return [A100] if target == "sm_80" else [H100, H200]


def subset_launches(target: str = "sm_90") -> list[Launch]:
    """The representative few CI compiles: each kernel at least once, the heaviest configurations of the
    fused matmul and prefill attention, on the target's first GPU (H100 for sm_90)."""
    return [x for x in all_launches(gpus_for(target)[:1]) if any(s in x.origin for s in SUBSET)]
