"""lm-evaluation-harness (``lm-eval``, ``local-completions``) scores a tiny multiple-choice task against our server.

The task (``tests/lm_eval_tiny/tiny_mc.jsonl``: six questions) is scored by loglikelihood: lm-eval sends
``/v1/completions`` with token-id prompts, ``echo: true``, ``logprobs: 1``, ``max_tokens: 1`` and sums the
continuation's prompt logprobs. Its tokenizer is SmolLM2's own, written as a Hugging Face folder (no hub). The
run must complete, and every choice's loglikelihood must be within 0.01 nats of the reference model's float32
log-softmax (the server runs the reference engine). On the fast engine, the scores are bit-identical with plain
and ``--compressed`` weights and with a prefill and a decode worker. Skipped where lm-eval is not installed
(the ``eval`` extra, in ``all``: it brings datasets, pandas, scikit-learn; torch and numpy stay as they are).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("openai")

from tests.smollm import smollm2_tokenizer  # noqa: E402
from tests.test_api_logprobs import reference_logprobs  # noqa: E402
from tests.test_serve_disagg import REPO, Server  # noqa: E402

DATA = Path(__file__).parent / "lm_eval_tiny" / "tiny_mc.jsonl"
TASK = """task: unfire_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


GEN_TASK = """task: unfire_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Answer with one word. {{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
"""


def hf_tokenizer_folder(root: Path) -> Path:
    folder = root / "tokenizer"
    folder.mkdir()
    tok = smollm2_tokenizer()
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token, "bos_token": tok.bos_token}))
    return folder


def continuation_loglikelihood(context: str, continuation: str) -> float:
    """What lm-eval asks for, from the reference model: the sum of the continuation tokens' logprobs after
    the context (trailing spaces of the context move to the continuation, as lm-eval's _encode_pair does)."""
    tok = smollm2_tokenizer()
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tok.encode(context + continuation)
    n = len(tok.encode(context))
    lp = reference_logprobs(whole)
    return float(sum(lp[i - 1, whole[i]] for i in range(n, len(whole))))


def run_lm_eval(tmp_path: Path, server: Server) -> list[dict]:
    """lm-eval's loglikelihood run of the tiny task against ``server`` (closed at the end); its samples."""
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    tasks = tmp_path / "tasks"
    if not tasks.exists():
        tasks.mkdir()
        (tasks / "unfire_tiny_mc.yaml").write_text(TASK.format(data=DATA))
        hf_tokenizer_folder(tmp_path)
    try:
        env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   HF_HOME=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
        args = (f"model=smollm2,base_url={server.base}/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={tmp_path / 'tokenizer'},num_concurrent=1,max_retries=1,tokenized_requests=True")
        run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                              "--tasks", "unfire_tiny_mc", "--include_path", str(tasks), "--output_path",
                              str(out), "--log_samples", "--batch_size", "1"],
                             capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    finally:
        assert server.close() == 0
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    samples = [json.loads(line) for path in out.rglob("samples_unfire_tiny_mc_*.jsonl")
               for line in path.read_text().splitlines()]
    assert len(samples) == 6
    return sorted(samples, key=lambda s: s["doc_id"])


def loglikelihoods(samples: list[dict]) -> list[list[float]]:
    return [[float(resp[0][0]) for resp in s["resps"]] for s in samples]


def test_lm_eval_loglikelihood_run_completes_and_matches_the_model(tmp_path):
    samples = run_lm_eval(tmp_path, Server("--engine", "reference", "--max-num-seqs", "8"))
    for s in samples:  # arguments: {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        pairs = [(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()]
        assert len(pairs) == 4
        for (context, continuation), resp in zip(pairs, s["resps"], strict=True):
            ours = float(resp[0][0])
            assert abs(ours - continuation_loglikelihood(context, continuation)) < 0.01
    accuracy = np.mean([s["acc"] for s in samples])
    assert 0 <= accuracy <= 1


def test_lm_eval_scores_are_bit_identical_plain_compressed_and_pd(tmp_path):
    """The fast engine (CPU tile products: batch-invariant): every choice's loglikelihood the same bits with
    plain weights, ``--compressed`` weights and a prefill + a decode worker (prompt logprobs in REQUEST
    revision 3), and within the bf16 engine's tolerance of the float32 reference model."""
    pytest.importorskip("torch")
    from tests.test_api_logprobs import BF16_NATS

    runs = [run_lm_eval(tmp_path, Server("--engine", "fast", *extra, timeout=300)) for extra in
            ((), ("--compressed",), ("--prefill-workers", "1", "--decode-workers", "1"))]
    plain, compressed, pd = (loglikelihoods(r) for r in runs)
    assert plain == compressed == pd
    assert [s["acc"] for s in runs[0]] == [s["acc"] for s in runs[2]]
    for s, lls in zip(runs[0], plain, strict=True):
        for (context, continuation), ll in zip([(a["arg_0"], a["arg_1"]) for a in s["arguments"].values()], lls,
                                               strict=True):
            assert abs(ll - continuation_loglikelihood(context, continuation)) < 2 * BF16_NATS


def test_lm_eval_chat_generation_run_completes(tmp_path):
    """``local-chat-completions`` (``--apply_chat_template``): a generate_until task through
    /v1/chat/completions, greedy, every answer the server's own for the same messages."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "unfire_tiny_gen.yaml").write_text(GEN_TASK.format(data=DATA))
    server = Server("--engine", "fast", timeout=300)
    try:
        env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   HF_HOME=str(tmp_path / "hf"), TOKENIZERS_PARALLELISM="false")
        args = f"model=smollm2,base_url={server.base}/v1/chat/completions,num_concurrent=1,max_retries=1"
        run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-chat-completions", "--model_args",
                              args, "--tasks", "unfire_tiny_gen", "--include_path", str(tasks), "--output_path",
                              str(tmp_path / "out"), "--log_samples", "--apply_chat_template", "--batch_size", "1"],
                             capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        samples = [json.loads(line) for path in (tmp_path / "out").rglob("samples_unfire_tiny_gen_*.jsonl")
                   for line in path.read_text().splitlines()]
        assert len(samples) == 6
        client = server.client()
        for s in samples:
            question = s["doc"]["question"]
            ours = client.chat.completions.create(
                model="smollm2", max_tokens=8, temperature=0, stop=["\n"],
                messages=[{"role": "user", "content": f"Answer with one word. {question}"}]).choices[0].message.content
            assert s["resps"][0][0] == ours
            assert s["exact_match"] in (0.0, 1.0)
    finally:
        assert server.close() == 0
