"""The runner split: the engine's control plane drives any object with the ModelRunner interface."""

from __future__ import annotations

import pytest

from reference.engine import Engine, SamplingParams, StepRecord
from reference.model.llama import LlamaModel, NumpyRunner
from reference.sched import Sequence
from tests.tiny_llama import CONFIG, tiny_weights


class RecordingModel:
    """A model whose runner logs what the engine asks of it, then delegates to the NumPy runner."""

    def __init__(self) -> None:
        self.model = LlamaModel(CONFIG, tiny_weights())
        self.config = self.model.config
        self.calls: list[tuple[str, object]] = []

    def make_runner(self, num_blocks: int, block_size: int, kv_dtype: str) -> NumpyRunner:
        outer = self

        class Runner(NumpyRunner):
            def copy_blocks(self, copies):
                outer.calls.append(("copy", list(copies)))
                super().copy_blocks(copies)

            def forward(self, chunks):
                outer.calls.append(("forward", [(len(c.tokens), c.start, c.wants_logits) for c in chunks]))
                return super().forward(chunks)

        return Runner(self.model, num_blocks, block_size, kv_dtype)


def test_engine_runs_through_the_runner_only():
    opts = dict(num_blocks=32, block_size=8, max_num_batched_tokens=16, max_num_seqs=2)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14]]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    plain = Engine(LlamaModel(CONFIG, tiny_weights()), **opts).generate(prompts, params)
    recording = RecordingModel()
    eng = Engine(recording, **opts)
    spied = eng.generate(prompts, params)
    assert [o.output_token_ids for o in spied] == [o.output_token_ids for o in plain]
    forwards = [c for kind, c in recording.calls if kind == "forward"]
    assert len(forwards) == len(eng.step_log)
    assert forwards[0] == [(13, 0, True), (3, 0, False)]  # a 16-token budget: the second prompt is chunked
    assert ("copy", []) in recording.calls
    for record in eng.step_log:
        assert 0 <= record.model_time <= record.duration


def test_wide_constructors_take_keywords():
    with pytest.raises(TypeError):
        Sequence([1, 2], 5)  # max_tokens must be named
    with pytest.raises(TypeError):
        StepRecord(0.0, 0.1, 0.05, (1,), (1,), (False,), 1, 0)
    assert Sequence([1, 2], max_tokens=5).max_tokens == 5
