"""A disaggregated site in the fleet: ``python -m serve fleet`` starts it as one disaggregated endpoint.

fleet_small.toml with its EU regional site (fra-core) made disaggregated (1 prefill + 2 decode
replicas): the fleet runs it as ``python -m serve --prefill-workers 1 --decode-workers 2`` behind the
gateway, on real processes (the tiny model). Checked: the plan (two_regions.toml's 2:2 site, the errors),
an EU tenant served there (trace, /fleet, the endpoint's own worker metrics), and a decode worker of that
site killed mid-stream: the stream ends whole (the fault-free text) or with an error event, the trace
says which, and the site answers again once the endpoint has restarted its worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from reference.cluster.scenario import load_scenario, scenario_from_dict  # noqa: E402
from serve.fleet.sites import FleetError, Sites, plan_workers  # noqa: E402
from tests.test_fleet import SMALL, TWO_REGIONS, ask, start_server  # noqa: E402

WORKER_UP = re.compile(r'unfire_disagg_worker_up\{node="(\d+)",role="(\w+)",pid="(\d+)"\} 1')
WORKER_REQUESTS = re.compile(r'unfire_disagg_worker_requests\{node="(\d+)",role="(\w+)",pid="(\d+)"\} (\d+)')


def disaggregated_small(prefill: int = 1, decode: int = 2) -> dict:
    """fleet_small.toml with fra-core as ``prefill`` prefill and ``decode`` decode replicas."""
    data = tomllib.loads(SMALL.read_text())
    core = next(s for s in data["sites"] if s["name"] == "fra-core")
    core["replicas"] = [{"model": "llama-8b", "gpu": "H100", "count": prefill, "role": "prefill"},
                        {"model": "llama-8b", "gpu": "H100", "count": decode, "role": "decode"}]
    core["gpus"] = {"H100": prefill + decode}
    return data


# ---- without processes -------------------------------------------------------------------------


def test_a_disaggregated_site_is_one_endpoint_with_the_scenarios_split(tmp_path: Path) -> None:
    s = load_scenario(TWO_REGIONS)
    workers = plan_workers(s)
    core = [w for w in workers if w.site == "fra-core"]
    assert [(w.model, w.prefill_workers, w.decode_workers) for w in core] == [("llama-8b", 2, 2)]
    assert len(workers) == 11 and not any(w.disaggregated for w in workers if w.site != "fra-core")
    cmd = Sites(s, workers, tmp_path, None, []).command(core[0])
    assert cmd[cmd.index("--prefill-workers") + 1] == "2" and cmd[cmd.index("--decode-workers") + 1] == "2"
    assert cmd[cmd.index("--engine") + 1] == "reference"
    from serve.fleet.view import site_replicas

    rep = next(r for r in site_replicas(s, workers) if r.site == "fra-core")
    assert rep.role == "colocated" and rep.max_num_seqs == 2 * s.max_num_seqs and rep.prefill_lanes == 2
    rep.tok_s, rep.pending_prefill = 0.001, 100
    assert rep.est_wait_s() == pytest.approx(0.05)  # 100 prompt tokens over its 2 prefill workers
    colocated = plan_workers(s, colocate=True)  # the option as it was: a server per replica
    assert [w.site for w in colocated].count("fra-core") == 4 and not any(w.disaggregated for w in colocated)

    data = disaggregated_small()
    data["sites"][1]["replicas"][1]["role"] = "prefill"  # prefill replicas and no decode one
    with pytest.raises(FleetError, match=r"sites\[fra-core\]: model llama-8b has 3 prefill and 0 decode"):
        plan_workers(scenario_from_dict(data))
    data = disaggregated_small()
    data["sites"][1]["workers"] = 2
    with pytest.raises(FleetError, match=r"sites\[fra-core\]: workers = 2 with prefill/decode replicas"):
        plan_workers(scenario_from_dict(data))
    data = disaggregated_small()
    data["sites"][1]["address"] = ["10.0.0.9:8000"]  # remote: the endpoint as it was started there
    remote = [w for w in plan_workers(scenario_from_dict(data)) if w.site == "fra-core"]
    assert [(w.address, w.prefill_workers, w.decode_workers) for w in remote] == [("10.0.0.9:8000", 1, 2)]


# ---- the command, on real processes --------------------------------------------------------------


class DisaggFleet:
    def __init__(self, tmp: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent), OMP_NUM_THREADS="1")
        scenario = tmp / "fleet_disagg.json"
        scenario.write_text(json.dumps(disaggregated_small()))
        self.trace = tmp / "trace.jsonl"
        cmd = [sys.executable, "-m", "serve", "fleet", str(scenario), "--port", "0", "--trace", str(self.trace),
               "--workdir", str(tmp / "work"), "--poll-s", "0.5"]
        self.proc, gateway = start_server(cmd, env)
        self.url = "http://" + gateway

    def server(self, site: str) -> dict:
        return next(s for s in httpx.get(self.url + "/fleet", timeout=10).json()["servers"] if s["site"] == site)

    def workers(self, site: str) -> list[tuple[str, int, int]]:
        """(role, pid, requests there) of the site's endpoint's live workers, from its own /metrics."""
        text = httpx.get(f"http://{self.server(site)['address']}/metrics", timeout=10).text
        return [(role, int(pid), int(n)) for _, role, pid, n in WORKER_REQUESTS.findall(text)]

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.trace.read_text().splitlines()]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = DisaggFleet(tmp_path_factory.mktemp("fleet-disagg"))
    yield f
    f.stop()


def stream(url: str, max_tokens: int, on_event=None) -> tuple[str, list[dict]]:
    """A streamed completion through the gateway as eu-chat, trait llama-8b: (its text, its events)."""
    body = {"model": "llama-8b", "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True,
            "temperature": 0}
    events: list[dict] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"Authorization": "Bearer eu-chat"},
                      timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            if line.strip() == "data: [DONE]":
                events.append({"done": True})
                break
            events.append(json.loads(line[5:]))
            if on_event is not None:
                on_event(len(events))
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    return text, events


@pytest.mark.slow
def test_an_eu_tenant_is_served_by_the_disaggregated_regional_site(fleet: DisaggFleet) -> None:
    core = fleet.server("fra-core")
    assert core["disaggregated"] == "1:2" and core["jurisdiction"] == "EU" and core["alive"]
    assert sorted(role for role, _, _ in fleet.workers("fra-core")) == ["decode", "decode", "prefill"]
    assert ask(fleet.url, "eu-chat", model="llama-8b")  # the larger model: the regional site
    assert ask(fleet.url, "eu-chat", model="llama-8b", stream=True)
    assert ask(fleet.url, "eu-chat")  # auto: the edge first, colocated
    recs = [r for r in fleet.records() if r["tenant"] == "eu-chat"]
    regional = [r for r in recs if r["models"][0] == "llama-8b"]
    assert len(regional) == 2 and all(r["outcome"] == "done" and r["status"] == 200 for r in regional)
    assert all(r["prefill_site"] == "fra-core" and r["visited"][-1] == "fra-core" for r in regional)
    assert all(r["disaggregated"] == "1:2" and r["tier"] == "regional" for r in regional)
    edge = [r for r in recs if r["models"][0] == "small-1b"]
    assert edge and edge[-1]["prefill_site"] == "fra-edge" and edge[-1]["disaggregated"] is None
    # the endpoint's own accounting: the prompts went prefill -> decode over the KV wire
    text = httpx.get(f"http://{core['address']}/metrics", timeout=10).text
    sent = sum(int(v) for v in re.findall(r'unfire_disagg_worker_kv_bytes_sent_total\{[^}]*\} (\d+)', text))
    assert sent > 0


@pytest.mark.slow
def test_a_killed_decode_worker_of_the_site_ends_the_stream_whole_or_with_an_error(fleet: DisaggFleet) -> None:
    whole, events = stream(fleet.url, 1500)  # the fault-free answer (greedy)
    assert events[-1] == {"done": True} and len(events) > 1000, "the tiny model should talk for a while"
    killed: list[int] = []

    def kill_the_serving_decode_worker(n: int) -> None:
        if n == 3 and not killed:
            busy = [pid for role, pid, requests in fleet.workers("fra-core") if role == "decode" and requests]
            assert len(busy) == 1
            os.kill(busy[0], signal.SIGKILL)
            killed.append(busy[0])

    started = time.monotonic()
    text, events = stream(fleet.url, 1500, kill_the_serving_decode_worker)
    assert killed and time.monotonic() - started < 90 and events[-1] == {"done": True}
    errors = [e for e in events if "error" in e]
    print(f"decode worker {killed[0]} killed at event 3: {'an error event' if errors else 'the whole answer'}, "
          f"{len(events) - 1} events")
    if errors:  # ended early with the endpoint's reason; what came is the start of the answer
        assert whole.startswith(text) and len(errors) == 1
    else:  # migrated to the other decode worker: the whole answer, no token twice
        assert text == whole
    last = fleet.records()[-1]
    assert last["prefill_site"] == "fra-core" and last["outcome"] == ("failed" if errors else "done")
    # the endpoint restarts its worker: the site serves again, with its full split
    deadline = time.monotonic() + 60
    while len(fleet.workers("fra-core")) < 3 or killed[0] in {pid for _, pid, _ in fleet.workers("fra-core")}:
        assert time.monotonic() < deadline, fleet.workers("fra-core")
        time.sleep(0.5)
    again, events = stream(fleet.url, 1500)
    assert again == whole and fleet.records()[-1]["prefill_site"] == "fra-core"
    assert fleet.stop() == 0
