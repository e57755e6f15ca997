"""Real OS processes over sockets: identity with the colocated engine (real SmolLM2), the batch
command, and the fault matrix (every fault kind x several seeds) with its invariants: every
accepted request ends exactly once, with its full output or a clear error; nothing hangs past its
deadline; no block, socket or process leaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from reference.disagg.batch import ProcessFaults, run_requests
from reference.disagg.faults import FAULTS, FaultInjector
from reference.disagg.models import load_model
from reference.disagg.pool import FAST_FAULTS, ProcessPool, WorkerOptions
from reference.engine.engine import Engine
from reference.engine.params import SamplingParams

OPTS = WorkerOptions(num_blocks=128, block_size=8, **FAST_FAULTS)
ROOT = Path(__file__).resolve().parents[1]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def workload(n: int, seed: int = 0, max_tokens: int = 10) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"id": f"r{i}", "prompt_token_ids": rng.integers(1, 128, size=int(rng.integers(3, 60))).tolist(),
             "max_tokens": max_tokens} for i in range(n)]


def colocated(model, requests: list[dict], **engine_kwargs) -> list[list[int]]:
    engine = Engine(model, **engine_kwargs)
    params = SamplingParams(max_tokens=requests[0]["max_tokens"])
    outs = engine.generate([r["prompt_token_ids"] for r in requests], params)
    return [o.output_token_ids for o in outs]


def test_fault_matrix_with_real_processes():
    """Each fault kind, two seeds, on a tiny random Llama (the behaviour, not the model, is under test)."""
    requests = workload(6)
    expected = colocated(load_model("tiny"), requests, num_blocks=128, block_size=8)
    fds = open_fds()
    for fault in FAULTS:
        for seed in (1, 2):
            started = time.monotonic()
            injector = FaultInjector([fault], seed)
            with ProcessPool("tiny", 1, 1, opts=OPTS, injector=injector,
                                deadline=lambda p, o: 20.0) as pool:
                ProcessFaults(pool, [fault], seed, len(requests))
                results = run_requests(pool, requests, timeout=60)
                coordinator = pool.coordinator
                if fault.startswith("kill"):  # the killed worker was restarted (and, once, serves)
                    pool.wait_ready(1, 1, timeout=30)
                if fault.startswith("kill") and seed == 1:
                    again = run_requests(pool, [dict(r, id=f"again-{r['id']}") for r in requests[:2]], timeout=60)
                    assert [r["output_token_ids"] for r in again] == expected[:2]
                pids = list(pool.procs.values())
            where = f"fault {fault}, seed {seed}"
            assert time.monotonic() - started < 90, f"{where}: took too long"  # deadlines are 20 s: a hang errs
            # every accepted request ended exactly once: one result each, no late second answer
            assert [r["id"] for r in results] == [r["id"] for r in requests], where
            assert coordinator.counters.get("late_finish", 0) == 0, where
            for r, want in zip(results, expected, strict=True):
                if r["finish_reason"] == "abort":
                    assert fault == "abort" and r["error"] == "aborted by the client", where
                else:  # the full output, identical to the colocated engine, whatever happened on the way
                    assert r["error"] is None and r["output_token_ids"] == want, (where, r)
            assert sum(r["finish_reason"] == "abort" for r in results) == (fault == "abort"), where
            if fault in injector.faults:
                assert injector.counters.get(fault, 0) > 0, f"{where}: the fault never happened"
            if fault.startswith("kill"):
                assert coordinator.counters.get(f"{fault[5:]}_workers_lost", 0) == 1, where
            # nothing leaks: all blocks free and no stream left in every worker that said goodbye,
            # every process reaped, every socket closed
            assert len(pool.byes) == 2, f"{where}: {len(pool.byes)} BYEs"
            for bye in pool.byes:
                assert bye["free_blocks"] == bye["total_blocks"], (where, bye)
                assert bye["live_streams"] == 0 and bye["live_sequences"] == 0, (where, bye)
            assert all(p.poll() is not None for p in pids), where
            assert open_fds() <= fds, f"{where}: file descriptors leaked"


def test_processes_with_smollm2_are_identical_to_the_colocated_engine():
    from tests.smollm import smollm2_model, smollm2_tokenizer

    tok = smollm2_tokenizer()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    requests = [{"id": f"p{i}", "prompt_token_ids": tok.encode(p), "max_tokens": 8} for i, p in enumerate(prompts)]
    with ProcessPool("smollm2", 1, 1, opts=WorkerOptions(num_blocks=64, block_size=16)) as pool:
        results = run_requests(pool, requests, timeout=300)
        pool.shutdown()
    decode_bye = next(b for b in pool.byes if "kv_frames_received" in b["counters"])
    assert decode_bye["counters"]["kv_digest_match"] == len(requests)  # received KV bytes == the prefill worker's
    want = colocated(smollm2_model(), requests, num_blocks=64, block_size=16)
    assert [r["output_token_ids"] for r in results] == want
    assert all(r["error"] is None for r in results)


def run_cli(tmp_path: Path, lines: list[str], *args: str) -> tuple[int, list[dict], str]:
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "reference.disagg", "run", "--model", "tiny", "--prompts",
                           str(tmp_path / "in.jsonl"), "--out", str(out), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    rows = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    return proc.returncode, rows, proc.stderr


def test_batch_command_disaggregated_colocated_and_bad_lines(tmp_path):
    good = [json.dumps(r) for r in workload(3, seed=4, max_tokens=5)]
    lines = good[:1] + ["{not json", json.dumps({"id": "neg", "prompt_token_ids": [-1], "max_tokens": 2})] + good[1:]
    code, disagg, _ = run_cli(tmp_path, lines, "--prefill", "1", "--decode", "1", "--inject", "drop,kill-prefill",
                              "--seed", "3")
    assert code == 1  # two lines failed
    assert len(disagg) == len(lines)  # one output line per input line, in order
    assert "not valid JSON" in disagg[1]["error"] and "prompt_token_ids" in disagg[2]["error"]
    code, coloc, _ = run_cli(tmp_path, lines, "--prefill", "0", "--decode", "0")
    assert len(coloc) == len(lines)
    for a, b in zip(disagg, coloc, strict=True):
        assert (a["error"] is None) == (b["error"] is None)
        if a["error"] is None:
            assert a["output_token_ids"] == b["output_token_ids"] and len(a["output_token_ids"]) == 5


def test_batch_command_refuses_bad_arguments(tmp_path):
    code, _, err = run_cli(tmp_path, ["{}"], "--inject", "meteor")
    assert code == 2 and "unknown fault 'meteor'" in err
    code, _, err = run_cli(tmp_path, ["{}"], "--prefill", "0", "--decode", "1")
    assert code == 2 and "both be 0" in err
    help_text = subprocess.run([sys.executable, "-m", "reference.disagg", "run", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60,
                               env=dict(os.environ, PYTHONPATH=str(ROOT))).stdout
    assert all(name in help_text for name in FAULTS)


@pytest.mark.parametrize("secret_ok", [False])
def test_a_worker_with_the_wrong_secret_is_never_registered(secret_ok):
    with ProcessPool("tiny", 1, 1, opts=OPTS) as pool:
        env = dict(os.environ, UNFIRE_DISAGG_SECRET="ab" * 32, PYTHONPATH=str(ROOT))
        intruder = subprocess.Popen([sys.executable, "-m", "reference.disagg", "worker", "--role", "decode", "--node",
                                     "999", "--port", str(pool.port), "--model", "tiny"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            end = time.monotonic() + 20
            while time.monotonic() < end and pool.coordinator.counters.get("frames_refused", 0) == 0:
                pool.pump()
            assert pool.coordinator.counters.get("frames_refused", 0) >= 1
            assert 999 not in pool.coordinator.workers
        finally:
            intruder.kill()
            intruder.wait(timeout=10)
