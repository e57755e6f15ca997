"""The fast engine (fast/engine) on a tiny random Llama: same decisions and tokens as the reference engine.

The real-weights checks (SmolLM2, fp32 vs reference; compressed vs plain) are conformance cases
(``conformance/cases/engine_cases.py``); these run in a second and cover the edges.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fast.engine import Engine, FastModel, TorchLlama  # noqa: E402
from fast.errors import KernelInputError  # noqa: E402
from reference.engine import Engine as ReferenceEngine  # noqa: E402
from reference.engine import SamplingParams  # noqa: E402
from reference.model.llama import LlamaModel  # noqa: E402
from tests.tiny_llama import CONFIG, tiny_weights  # noqa: E402

PROMPTS = [list(range(1, 30)), list(range(1, 22)) + [50, 51], [7] * 5, list(range(40, 80))]
OPTIONS = dict(num_blocks=14, block_size=4, max_num_batched_tokens=16, max_num_seqs=3)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: a second thread only adds spin-waiting (and the machine may be shared)."""
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1, user_api="blas"):
        yield
    torch.set_num_threads(before)


def decisions(engine: ReferenceEngine) -> list[tuple]:
    return [(r.new_tokens, r.context_lens, r.is_prefill, r.num_sampled, r.num_preempted) for r in engine.step_log]


@pytest.mark.parametrize("kv_dtype", ["float32", "fp8"])
def test_fp32_fast_engine_matches_reference(kv_dtype):
    weights = tiny_weights()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = ReferenceEngine(LlamaModel(CONFIG, weights), kv_dtype=kv_dtype, **OPTIONS)
    fast = Engine(FastModel(TorchLlama(CONFIG, weights, dtype="float32")), kv_dtype=kv_dtype, **OPTIONS)
    want, got = ref.generate(PROMPTS, params), fast.generate(PROMPTS, params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want]
    assert decisions(fast) == decisions(ref)
    assert sum(r.num_preempted for r in ref.step_log) > 0  # 14 blocks of 4: the workload preempts
    assert any(o.num_cached_tokens for o in want)  # prompts 0 and 1 share a prefix


def test_logits_agree_with_reference_within_float32_rounding():
    weights = tiny_weights(1)
    ref = LlamaModel(CONFIG, weights).make_runner(8, 4)
    fast = FastModel(TorchLlama(CONFIG, weights, dtype="float32")).make_runner(8, 4)
    from reference.model.llama import Chunk

    for chunks in ([Chunk(PROMPTS[0][:10], 0, [0, 1, 2], wants_logits=False), Chunk([3, 4, 5], 0, [5])],
                   [Chunk(PROMPTS[0][10:13], 10, [0, 1, 2, 3]), Chunk([6], 3, [5])]):
        r, f = ref.forward(chunks), fast.forward(chunks)
        for a, b in zip(r, f, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


def test_compressed_weights_give_the_plain_bf16_outputs_bit_for_bit():
    weights = tiny_weights(2)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = Engine(FastModel(TorchLlama(CONFIG, weights, dtype="bfloat16")), **OPTIONS)
    packed_model = TorchLlama(CONFIG, weights, dtype="bfloat16", compressed=True)
    packed = Engine(FastModel(packed_model), **OPTIONS)
    assert [o.output_token_ids for o in packed.generate(PROMPTS, params)] == \
        [o.output_token_ids for o in plain.generate(PROMPTS, params)]
    layer = packed_model.layers[0]
    assert torch.equal(layer.gate_up.weight(), plain.runner.model.layers[0].gate_up.weight)


def test_bad_options_are_named():
    weights = tiny_weights()
    with pytest.raises(KernelInputError, match="dtype"):
        TorchLlama(CONFIG, weights, dtype="float16")
    with pytest.raises(KernelInputError, match="unknown matrices"):
        TorchLlama(CONFIG, weights, compressed=("mlp",))


def test_stream_and_abort_free_the_cache():
    fast = Engine(FastModel(TorchLlama(CONFIG, tiny_weights(), dtype="bfloat16")), **OPTIONS)
    free = fast.block_manager.num_free_blocks
    events = fast.stream(PROMPTS[3], SamplingParams(max_tokens=50, ignore_eos=True))
    first = [next(events) for _ in range(3)]
    assert [e.index for e in first] == [0, 1, 2]
    events.close()  # aborts the request
    assert fast.block_manager.num_free_blocks == free
    assert fast.runner.cache.dtype == "bfloat16"  # the KV cache takes the model's dtype by default


def test_decode_graph_buffers_give_the_eager_step():
    """The CUDA-graph path's padded static inputs, run eagerly (no capture on a CPU), equal a plain step."""
    from fast.engine.graphs import DecodeGraphs
    from reference.model.llama import Chunk

    model = TorchLlama(CONFIG, tiny_weights(3), dtype="float32")
    runner = FastModel(model, cuda_graphs=False).make_runner(12, 4)
    runner.forward([Chunk(PROMPTS[0][:9], 0, [0, 1, 2]), Chunk(PROMPTS[1][:5], 0, [5, 6]),
                    Chunk(PROMPTS[2][:3], 0, [8])])  # some context to attend to
    chunks = [Chunk([11], 9, [0, 1, 2]), Chunk([12], 5, [5, 6]), Chunk([13], 3, [8])]
    graphs = DecodeGraphs(model, runner.cache, max_batch=4, max_blocks=5, pad_block=11)
    b = graphs.fill(np.array([11, 12, 13]), np.array([9, 5, 3]), [c.block_table for c in chunks])
    assert b == 4 and graphs._step(b).max_seq_len == 5 * 4  # a padded row; the split-KV grid covers the table
    padded = model.forward(graphs.tokens[:b], graphs.positions[:b], graphs._step(b), runner.cache, graphs.rows[:b])
    eager = runner.forward(chunks)
    np.testing.assert_allclose(padded[:3].numpy(), np.stack(eager), rtol=1e-5, atol=1e-5)
