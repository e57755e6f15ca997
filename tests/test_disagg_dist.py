"""The handoff over torch.distributed (gloo on CPU): three ranks started by torchrun, outputs equal to
the colocated engine's, and a peer's length field is never trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reference.disagg.models import load_model
from reference.engine.engine import Engine
from reference.engine.params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_torchrun_three_ranks_match_colocated(tmp_path):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, size=int(rng.integers(3, 50))).tolist() for _ in range(4)]
    lines = [json.dumps({"id": f"r{i}", "prompt_token_ids": p, "max_tokens": 6}) for i, p in enumerate(prompts)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), UNFIRE_DISAGG_SECRET="cd" * 32)
    common = ["--model", "tiny", "--prompts", str(tmp_path / "in.jsonl")]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                    "-m", "fast.disagg", *common, "--out", str(tmp_path / "dist.jsonl")], cwd=ROOT, env=env,
                   check=True, timeout=180, capture_output=True)
    dist_rows = [json.loads(x) for x in (tmp_path / "dist.jsonl").read_text().splitlines()]
    engine = Engine(load_model("tiny"))
    colocated = [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6))]
    assert [r["id"] for r in dist_rows] == [f"r{i}" for i in range(4)]
    assert [r["output_token_ids"] for r in dist_rows] == colocated


@pytest.mark.slow
def test_dist_endpoint_refuses_an_absurd_length_without_allocating(tmp_path):
    script = tmp_path / "two_ranks.py"
    script.write_text('''
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.environ["ROOT"])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=int(sys.argv[1]),
                        world_size=2)
from fast.disagg.dist import DistEndpoint
if dist.get_rank() == 0:
    dist.send(torch.tensor([1 << 40], dtype=torch.int64), dst=1)   # a terabyte frame: refused
else:
    e = DistEndpoint(0)
    _, data = e.inbox.get(timeout=30)
    assert data is None and "announced a frame" in e.error, e.error
    print("refused")
    os._exit(0)
dist.destroy_process_group()
''')
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, ROOT=str(ROOT), PORT=str(port))
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env, stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert "refused" in outs[1]
