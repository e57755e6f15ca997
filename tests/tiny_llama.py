"""A tiny Llama with random weights (2 layers, hidden 64, GQA 4/2): engine tests that run in milliseconds."""

from __future__ import annotations

from typing import Any

import numpy as np

from reference.model.config import LlamaConfig
from reference.model.loader import LayerWeights, LlamaWeights

CONFIG = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=256,
                     tie_embeddings=True, eos_token_ids=(0,))


def tiny_weights(seed: int = 0) -> LlamaWeights:
    rng = np.random.default_rng(seed)
    c = CONFIG

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(c.hidden_size)).astype(np.float32)

    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layers = [LayerWeights(attn_norm=norm(), wq=w(q, c.hidden_size), wk=w(kv, c.hidden_size), wv=w(kv, c.hidden_size),
                           wo=w(c.hidden_size, q), mlp_norm=norm(), w_gate=w(c.intermediate_size, c.hidden_size),
                           w_up=w(c.intermediate_size, c.hidden_size), w_down=w(c.hidden_size, c.intermediate_size))
              for _ in range(c.num_layers)]
    embedding = 3 * w(c.vocab_size, c.hidden_size)
    return LlamaWeights(embedding=embedding, layers=layers, final_norm=norm(), lm_head=embedding)


def bf16_outputs_on_and_off(monkeypatch: Any, module: Any, name: str, switch: str
                            ) -> tuple[dict[str, list[list[int]]], int, int]:
    """Greedy tokens of the fast engine in bf16 on three prompts with the environment switch ``switch`` at "1"
    and at "0", counting the calls to ``module.name`` (the native path the switch guards; plain C loops, so any
    CPU takes it): (outputs by flag, calls with it on, calls with it off)."""
    from fast.engine import Engine, FastModel, TorchLlama
    from reference.engine import SamplingParams

    monkeypatch.setenv("UNFIRE_NATIVE_SIMD", "0")
    calls = []
    real = getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    prompts = [list(range(1, 30)), [7] * 5, list(range(40, 80))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    options = dict(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_num_seqs=3)
    outputs, counts = {}, {}
    for flag in ("1", "0"):
        monkeypatch.setenv(switch, flag)
        before = len(calls)
        engine = Engine(FastModel(TorchLlama(CONFIG, tiny_weights(), dtype="bfloat16")), **options)
        outputs[flag] = [o.output_token_ids for o in engine.generate(prompts, params)]
        counts[flag] = len(calls) - before
    return outputs, counts["1"], counts["0"]
