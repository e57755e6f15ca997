"""``python -m serve --prefill-workers 1 --decode-workers 1 --kv-carrier nixl`` with real processes and the
``openai`` client on SmolLM2: the decode worker reads every prompt's KV out of the prefill worker's registered
memory with NIXL (UCX, DRAM to DRAM), and the answers equal the TCP carrier's token for token, greedy and
seeded sampling, with fp32 and bf16 on the wire. A prefill worker killed (SIGKILL) while its KV is being read:
every stream still ends whole (the decode worker computes what did not land). Without nixl the option is
refused at start, naming the package and the install command."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.test_serve_disagg import REPO, Server, gauges, stream_chat, wait_idle

pytest.importorskip("openai")

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write one short sentence about cats."]
MAX_TOKENS = 16


def answers(server: Server) -> list[tuple]:
    """Greedy streams one at a time, then two seeded samples (temperature 0.7)."""
    got: list[tuple] = [stream_chat(server, q, MAX_TOKENS) for q in QUESTIONS]
    for seed in (11, 12):
        out = server.client().chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
            temperature=0.7, seed=seed, extra_body={"ignore_eos": True})
        got.append((out.choices[0].message.content, out.usage.completion_tokens, None))
    return got


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_nixl_carrier_gives_the_tcp_carriers_tokens(wire: str) -> None:
    pytest.importorskip("nixl")
    results = {}
    for carrier in ("tcp", "nixl"):
        server = Server("--prefill-workers", "1", "--decode-workers", "1", "--kv-wire", wire,
                        "--kv-carrier", carrier)
        try:
            results[carrier] = answers(server)
            text = wait_idle(server, 2)
            sent = sum(gauges(text, "unfire_disagg_worker_kv_bytes_sent_total").values())
            nixl = gauges(text, "unfire_disagg_worker_kv_bytes_nixl_total")
            recomputes = gauges(text, "unfire_disagg_worker_recomputes_total")
            assert sent > 0 and sum(recomputes.values()) == 0  # every answer continued from the KV sent
            # the NIXL carrier read every KV byte (prefill's count = decode's = all); TCP none
            assert sum(v for (_, role), v in nixl.items() if role == "prefill") == (sent if carrier == "nixl" else 0)
        finally:
            assert server.close() == 0
    assert all(err is None and n for _, n, err in results["nixl"])
    assert results["nixl"] == results["tcp"]


def test_prefill_worker_killed_while_its_kv_is_read() -> None:
    pytest.importorskip("nixl")
    questions = [f"Write a long paragraph about the number {n}, its history and its uses." for n in range(6)]
    server = Server("--prefill-workers", "1", "--decode-workers", "1", "--kv-carrier", "nixl",
                    "--worker-lease", "10", "--max-num-seqs", "8")
    try:
        with ThreadPoolExecutor(len(questions)) as pool:
            expected = list(pool.map(lambda q: stream_chat(server, q, 12), questions))
        assert all(e is None for _, _, e in expected)
        wait_idle(server, 2)
        text = server.metrics()
        pid = int(re.search(r'unfire_disagg_worker_up{node="\d+",role="prefill",pid="(\d+)"}', text).group(1))
        before = sum(gauges(text, "unfire_disagg_worker_kv_bytes_nixl_total").values())
        killed = threading.Event()

        def kill_once_reads_start() -> None:  # the first descriptors forwarded: reads are under way
            end = time.monotonic() + 120
            while time.monotonic() < end:
                now = sum(gauges(server.metrics(), "unfire_disagg_worker_kv_bytes_nixl_total").values())
                if now > before:
                    os.kill(pid, signal.SIGKILL)
                    killed.set()
                    return
                time.sleep(0.005)

        with ThreadPoolExecutor(len(questions) + 1) as pool:
            killer = pool.submit(kill_once_reads_start)
            got = list(pool.map(lambda q: stream_chat(server, q, 12), [q + " " for q in questions]))
            killer.result()
        assert killed.is_set()
        assert all(e is None and n for _, n, e in got), got  # the decode worker computed what did not land
        events = dict(re.findall(r'^unfire_disagg_events_total{event="(\w+)"} (\d+)$', server.metrics(), re.M))
        assert int(events["prefill_workers_lost"]) == 1
        text = wait_idle(server, 2)  # the prefill worker was restarted, every block is free again
        # the handoffs cut short were finished here: the decode worker computed (some of) those prompts
        assert sum(v for (_, role), v in gauges(text, "unfire_disagg_worker_recomputes_total").items()
                   if role == "decode") >= 1
        assert stream_chat(server, questions[0], 12) == expected[0]  # the new prefill worker's KV is read again
    finally:
        assert server.close() == 0


def test_nixl_carrier_without_nixl_is_refused_naming_the_install_command() -> None:
    hide = ("import sys, runpy; sys.modules['nixl'] = None; "  # nixl absent, as on a machine without it
            "runpy.run_module('serve', run_name='__main__', alter_sys=True)")
    run = subprocess.run([sys.executable, "-c", hide, "--prefill-workers", "1", "--decode-workers", "1",
                          "--kv-carrier", "nixl"], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert run.returncode == 2, run.stderr
    assert "`nixl`" in run.stderr and "pip install 'nixl==1.5.1'" in run.stderr
    run = subprocess.run([sys.executable, "-m", "serve", "--kv-carrier", "nixl"], cwd=REPO, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert run.returncode == 2 and "--prefill-workers P" in run.stderr
