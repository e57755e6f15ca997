"""The torch.distributed carrier (gloo on CPU): a peer's length field is never trusted. (Ranks serving the
colocated engine's tokens through the HTTP door: tests/test_serve_disagg_dist.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
