"""Baselines for ``bench_engine``: Hugging Face transformers with static padded batches, and llama.cpp.

Both run a list of ``Job``s (prompt ids, number of output tokens; end token ignored) and return, per
job, the times its output tokens were ready (seconds since the start of the run), so every system
is scored by the same code (``bench_engine.score``).

transformers gets exactly our weights: ``hf_llama`` builds a ``LlamaForCausalLM`` from the reference
loader's tensors (the GGUF loader has already undone llama.cpp's q/k row permutation), so all
systems compute the same model. A static batch is left-padded to its longest prompt and generates
until its longest job is done; a job's useful tokens are its own ``output_len`` first tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from experiments.engine_bench import Job
from reference.model.config import LlamaConfig
from reference.model.loader import LlamaWeights


def hf_llama(config: LlamaConfig, weights: LlamaWeights, dtype: Any) -> Any:
    """A transformers ``LlamaForCausalLM`` holding these weights, in ``dtype`` (a torch dtype)."""
    import torch
    import transformers

    scaling = None
    if config.rope_scaling is not None:
        s = config.rope_scaling
        scaling = {"rope_type": s["type"], "factor": s["factor"]}
        if s["type"] == "llama3":
            scaling |= {"low_freq_factor": s["low_freq_factor"], "high_freq_factor": s["high_freq_factor"],
                        "original_max_position_embeddings": s["original_max_position"]}
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, rope_scaling=scaling, max_position_embeddings=config.max_position,
        tie_word_embeddings=weights.lm_head is weights.embedding)
    model = transformers.LlamaForCausalLM(hf_config)
    state = {"model.embed_tokens.weight": weights.embedding, "model.norm.weight": weights.final_norm}
    if weights.lm_head is not weights.embedding:
        state["lm_head.weight"] = weights.lm_head
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
             "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
    for i, layer in enumerate(weights.layers):
        for ours, theirs in names.items():
            state[f"model.layers.{i}.{theirs}.weight"] = getattr(layer, ours)
    tensors = {k: torch.tensor(np.asarray(v)) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"weights do not fit the transformers model: missing {missing}, unexpected {unexpected}")
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def run_transformers(model: Any, jobs: Sequence[Job], batch_size: int, pad_id: int = 0,
                     on_batch: Callable[[int], None] | None = None,
                     clock: Callable[[], float] = time.perf_counter) -> list[list[float]]:
    """Static batches of ``batch_size`` jobs in order; per job, the ready time of each useful output token."""
    import torch
    import transformers

    class TokenTimes(transformers.LogitsProcessor):
        """Called once per generated position, right after the forward pass that produced it."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.times.append(clock())
            return scores

    times: list[list[float]] = [[] for _ in jobs]
    t0 = clock()
    for first in range(0, len(jobs), batch_size):
        batch = list(range(first, min(first + batch_size, len(jobs))))
        width = max(len(jobs[i].prompt) for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):  # left padding: every prompt ends at the last column
            p = jobs[i].prompt
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        steps = max(jobs[i].output_len for i in batch)
        stamps = TokenTimes()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                           do_sample=False, pad_token_id=pad_id, eos_token_id=None,
                           logits_processor=transformers.LogitsProcessorList([stamps]))
        for i in batch:
            times[i] = [t - t0 for t in stamps.times[:jobs[i].output_len]]
        if on_batch is not None:
            on_batch(len(batch))
    return times


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_llama_cpp(gguf_path: str, jobs: Sequence[Job], threads: int,
                  on_job: Callable[[int], None] | None = None) -> list[list[float]]:
    """llama-cpp-python on the same GGUF, one request after another (its Python API serves one sequence)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=512, n_threads=threads, n_batch=256, verbose=False)
    times: list[list[float]] = [[] for _ in jobs]
    t0 = time.perf_counter()
    for i, job in enumerate(jobs):
        llm.reset()
        out: list[float] = []
        for _ in llm.generate(job.prompt, temp=0.0, top_k=1, reset=True):
            out.append(time.perf_counter() - t0)
            if len(out) >= job.output_len:
                break
        times[i] = out
        if on_job is not None:
            on_job(1)
    return times
