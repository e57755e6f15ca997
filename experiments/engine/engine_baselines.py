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

from experiments.engine.stats import Job
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


_LLAMA_QUIET: Any = None  # the C callback must outlive every call into llama.cpp


def run_llama_cpp(gguf_path: str, jobs: Sequence[Job], threads: int,
                  on_job: Callable[[int], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                  max_seqs: int = 32, max_batch_tokens: int = 512,
                  tokens: list[list[int]] | None = None, kv_unified: bool = True) -> list[list[float]]:
    """llama.cpp (through llama-cpp-python's C API) on the same GGUF, at its best: continuous batching.

    ``max_seqs`` sequences share one unified KV cache; every ``llama_decode`` call carries one token of each
    decoding sequence and then prompt tokens of newly admitted ones up to ``max_batch_tokens`` (logits only
    for a prompt's last token and for decode tokens); greedy (argmax), end token ignored, like our engines.
    Returns each job's token times (seconds on ``clock`` from the start); ``tokens``, if given, receives each
    job's generated token ids."""
    import ctypes

    import llama_cpp as lc

    global _LLAMA_QUIET
    if _LLAMA_QUIET is None:  # llama.cpp logs every tensor it loads; keep the progress bar readable
        _LLAMA_QUIET = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_LLAMA_QUIET, ctypes.c_void_p(0))
    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(gguf_path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    longest = max(len(j.prompt) + j.output_len for j in jobs)
    cparams = lc.llama_context_default_params()
    cparams.n_seq_max = min(max_seqs, len(jobs))
    cparams.n_ctx = cparams.n_seq_max * (longest + 16)
    cparams.n_batch = cparams.n_ubatch = max_batch_tokens
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.kv_unified = kv_unified
    ctx = lc.llama_init_from_model(model, cparams)
    if not ctx:
        lc.llama_model_free(model)
        raise RuntimeError("llama.cpp could not create a context")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    batch = lc.llama_batch_init(max_batch_tokens, 0, 1)
    mem = lc.llama_get_memory(ctx)
    times: list[list[float]] = [[] for _ in jobs]
    if tokens is not None:
        tokens[:] = [[] for _ in jobs]
    waiting = list(range(len(jobs)))
    free_slots = list(range(cparams.n_seq_max))
    live: dict[int, list[int]] = {}  # slot -> [job, tokens of the job fed so far, last token]
    try:
        t0 = clock()
        while waiting or live:
            while waiting and free_slots:
                live[free_slots.pop()] = [waiting.pop(0), 0, -1]
            entries: list[tuple[int, bool]] = []  # (slot, wants logits) per batch row
            for slot, (j, fed, last) in live.items():  # decodes first, one token each
                if fed >= len(jobs[j].prompt):
                    entries.append((slot, True))
                    _put(batch, len(entries) - 1, last, fed, slot, True)
                    live[slot][1] += 1
            for slot, (j, fed, _) in live.items():  # then prompt chunks, within the token budget
                prompt = jobs[j].prompt
                while fed < len(prompt) and len(entries) < max_batch_tokens:
                    wants = fed == len(prompt) - 1
                    entries.append((slot, wants))
                    _put(batch, len(entries) - 1, prompt[fed], fed, slot, wants)
                    fed += 1
                live[slot][1] = fed
            batch.n_tokens = len(entries)
            if lc.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache too small?)")
            now = clock() - t0
            for row, (slot, wants) in enumerate(entries):
                if not wants:
                    continue
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
                j = live[slot][0]
                live[slot][2] = int(np.argmax(logits))
                times[j].append(now)
                if tokens is not None:
                    tokens[j].append(live[slot][2])
                if len(times[j]) >= jobs[j].output_len:
                    lc.llama_memory_seq_rm(mem, slot, -1, -1)
                    del live[slot]
                    free_slots.append(slot)
                    if on_job is not None:
                        on_job(1)
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return times


def _put(batch: Any, row: int, token: int, pos: int, seq: int, wants_logits: bool) -> None:
    batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, pos, 1
    batch.seq_id[row][0], batch.logits[row] = seq, int(wants_logits)


def write_hf_folder(config: LlamaConfig, weights: LlamaWeights, folder: Any) -> Any:
    """A Hugging Face checkpoint folder (config.json + bf16 model.safetensors) holding exactly these weights:
    what vLLM loads (``run_vllm``). Written through transformers, so it is the model ``hf_llama`` builds."""
    import torch

    model = hf_llama(config, weights, torch.bfloat16)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def run_vllm(python: str, model_dir: Any, jobs: Sequence[Job], *, max_num_seqs: int, max_num_batched_tokens: int,
             cpus: str | None = None, enforce_eager: bool = False, timeout_s: float = 1800.0,
             clock: str = "wall") -> dict[str, Any]:
    """vLLM's engine on ``jobs`` in a process of the vLLM environment's ``python``
    (experiments/engine/vllm_baseline.py).

    Returns its measured pass: ``token_times`` per job (s from the start), ``cpu_seconds`` of the whole
    process tree during that pass, and vLLM's version and start-up time. ``cpus`` ("0", "0,1") pins the
    process tree with taskset, as the other systems are pinned by the caller. ``clock`` "cpu": the token times are
    CPU seconds of vLLM's process tree since the pass began (``bench_engine --clock cpu``), else wall seconds."""
    import json
    import os
    import signal
    import subprocess
    import tempfile
    from pathlib import Path

    longest = max(len(j.prompt) + j.output_len for j in jobs)
    request = {"model_dir": str(model_dir), "jobs": [[list(j.prompt), j.output_len] for j in jobs],
               "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
               "max_model_len": max(256, -(-longest // 16) * 16), "enforce_eager": enforce_eager,
               "clock": clock}
    with tempfile.TemporaryDirectory(prefix="unfire-vllm-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        req.write_text(json.dumps(request))
        cmd = [python, "-m", "experiments.engine.vllm_baseline", "--request", str(req), "--out", str(out)]
        if cpus is not None:
            cmd = ["taskset", "-c", cpus, *cmd]
        threads = str(len(cpus.split(","))) if cpus else "1"
        env = os.environ | {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "VLLM_CPU_OMP_THREADS_BIND": cpus or "0", "OMP_NUM_THREADS": threads,
                            "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        log = Path(tmp) / "vllm.log"
        with log.open("w") as f:  # its own session: vLLM's engine-core and worker processes go with it
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except BaseException:  # a timeout, or this benchmark interrupted: leave no vLLM process behind
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        if rc != 0 or not out.exists():
            lines = log.read_text(errors="replace").splitlines()
            cause = next((ln for ln in lines if "Error:" in ln), None)  # vLLM's workers log the root cause first
            tail = "\n".join(lines[-8:])
            raise RuntimeError(f"vLLM baseline failed (exit {rc})" + (f": {cause.strip()}" if cause else "")
                               + f"; last lines of its log:\n{tail}")
        result = json.loads(out.read_text())
    if [len(t) for t in result["token_times"]] != [j.output_len for j in jobs]:
        raise RuntimeError("vLLM produced a different number of tokens than the workload asks")
    return result
