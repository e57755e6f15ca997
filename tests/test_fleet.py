"""The fleet on real processes: ``python -m serve fleet`` over reference/cluster/examples/fleet_small.toml.

Every site is a real ``python -m serve`` process (the tiny model) and the gateway routes with the real
``reference.cluster.router``. Checked: the openai client gets answers; EU-restricted requests are served by
EU sites only (in the trace and, independently, in each server's own per-tenant token counters), also with
EU sites killed; with every EU site down an EU tenant gets 503 with the router's reason while a tenant
allowed elsewhere is still served; a stream whose site dies ends (error event or full answer), never hangs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from reference.cluster.scenario import ScenarioError, load_scenario, scenario_from_dict  # noqa: E402
from serve.fleet.sites import plan_workers  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SMALL = REPO / "reference/cluster/examples/fleet_small.toml"
TWO_REGIONS = REPO / "reference/cluster/examples/two_regions.toml"
EU_SITES = {"fra-edge", "fra-core"}


def client(url: str, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=tenant, max_retries=0, timeout=60)


def ask(url: str, tenant: str, model: str = "auto", stream: bool = False) -> str:
    c = client(url, tenant)
    if stream:
        chunks = c.completions.create(model=model, prompt="Where is Paris?", max_tokens=6, stream=True)
        return "".join(ch.choices[0].text for ch in chunks)
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Where is Paris?"}], max_tokens=6)
    return r.choices[0].message.content


def tenant_prompt_tokens(address: str) -> dict[str, int]:
    """A server's own count of prompt tokens it computed, per tenant (its /metrics)."""
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    return {m[0]: int(m[1]) for m in re.findall(r'unfire_prompt_tokens_total\{tenant="([^"]+)"\} (\d+)', text)}


# ---- without processes -------------------------------------------------------------------------


def test_serving_fields_are_checked() -> None:
    s = load_scenario(SMALL)
    assert s.sites["fra-edge"].serve_model == "tiny" and s.sites["fra-edge"].workers == 1
    data = __import__("tomllib").loads(SMALL.read_text())
    for bad, needle in [({"workers": -1}, "workers"), ({"address": ["nocolon"]}, "address"),
                        ({"address": ["h:1", "h:2"], "workers": 3}, "workers"), ({"serve_model": " "}, "serve_model"),
                        ({"address": "h:1"}, "address")]:
        broken = json.loads(json.dumps(data))
        broken["sites"][0].update(bad)
        with pytest.raises(ScenarioError, match=needle):
            scenario_from_dict(broken)


def test_workers_per_site_and_disaggregated_sites() -> None:
    s = load_scenario(TWO_REGIONS)
    assert [(w.prefill_workers, w.decode_workers) for w in plan_workers(s) if w.site == "fra-core"] == [(2, 2)]
    workers = plan_workers(s, colocate=True)
    assert [w.site for w in workers].count("central") == 4  # one server per replica by default
    assert {w.model for w in workers if w.site == "fra-edge"} == {"small-1b"}
    data = __import__("tomllib").loads(SMALL.read_text())
    data["sites"][1]["workers"] = 3
    data["sites"][3]["address"] = ["10.0.0.7:8000", "10.0.0.8:8000"]
    workers = plan_workers(scenario_from_dict(data))
    assert [w.site for w in workers].count("fra-core") == 3
    assert [w.address for w in workers if w.site == "central"] == ["10.0.0.7:8000", "10.0.0.8:8000"]


def test_api_keys_must_name_traffic_classes_on_their_plans() -> None:
    from serve.fleet.cli import check_keys
    from serve.keys import KeysError, KeyTable

    s = load_scenario(SMALL)
    check_keys(s, KeyTable.from_dict({"keys": {"k1": {"tenant": "eu-chat", "plan": "paid"}}}), "k")
    with pytest.raises(KeysError, match="not a traffic class"):
        check_keys(s, KeyTable.from_dict({"keys": {"k1": {"tenant": "acme", "plan": "paid"}}}), "k")
    with pytest.raises(KeysError, match="on plan 'free', its traffic class on 'paid'"):
        check_keys(s, KeyTable.from_dict({"keys": {"k1": {"tenant": "eu-chat", "plan": "free"}}}), "k")


def test_wait_estimate_is_the_simulated_replicas() -> None:
    from serve.fleet.sites import Worker
    from serve.fleet.view import SiteReplica

    rep = SiteReplica(Worker(0, "a", "m", "tiny"), "EU", "edge", max_num_seqs=2, tok_s=0.001, decode_s=0.01)
    assert rep.est_wait_s() == 0
    rep.pending_prefill, rep.pending_decode, rep.live = 100, 30, 3
    # 100 prompt tokens at 1 ms, plus (3 + 1 - 2) / 2 of the decode of one of the 3 sequences at 10 ms a step
    assert rep.est_wait_s() == pytest.approx(0.1 + 1.0 * (30 / 3) * 0.01)


# ---- the command, on real processes --------------------------------------------------------------


def start_server(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """Start a process that prints an http://host:port address; returns it and that address."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 90
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        m = re.search(r"(?:gateway )?on http://(127\.0\.0\.1:\d+)/v1", line)
        if m and (cmd[3:4] != ["fleet"] or "gateway" in line):
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"{cmd[:4]} did not start:\n" + "".join(lines))


class FleetProcess:
    """``python -m serve fleet`` on fleet_small.toml, with its central site "remote": a server this test
    starts itself and lists in the scenario as the site's ``address``, both run with one ``--site-keys`` file."""

    def __init__(self, tmp: Path) -> None:
        from serve.fleet.cli import write_site_keys
        from serve.fleet.tiny import write_tiny_checkpoint

        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        keys = tmp / "site-keys.toml"
        write_site_keys(load_scenario(SMALL), keys)
        tiny = write_tiny_checkpoint(tmp / "tiny")
        self.remote, address = start_server(
            [sys.executable, "-m", "serve", "--model", str(tiny), "--served-model-name", "llama-8b", "--port", "0",
             "--api-keys", str(keys), "--max-num-seqs", "16", "--max-num-batched-tokens", "256"], env)
        scenario = tmp / "fleet_remote.toml"
        text = SMALL.read_text()
        assert '# address = ["10.0.0.7:8000"]' in text
        scenario.write_text(text.replace('# address = ["10.0.0.7:8000"]', f'address = ["{address}"]'))
        self.trace = tmp / "trace.jsonl"
        cmd = [sys.executable, "-m", "serve", "fleet", str(scenario), "--port", "0", "--trace", str(self.trace),
               "--workdir", str(tmp / "work"), "--site-keys", str(keys), "--poll-s", "30"]  # failures found by requests
        self.proc, gateway = start_server(cmd, env)
        self.url = "http://" + gateway

    def servers(self) -> list[dict]:
        return httpx.get(self.url + "/fleet", timeout=10).json()["servers"]

    def kill_site(self, site: str) -> None:
        for s in self.servers():
            if s["site"] == site:
                os.killpg(s["pid"], signal.SIGKILL)

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.trace.read_text().splitlines()]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            for p in (self.proc, self.remote):
                if p.poll() is None:
                    p.kill()
                    p.wait(10)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = FleetProcess(tmp_path_factory.mktemp("fleet"))
    yield f
    f.stop()


def test_openai_client_gets_answers_routed_by_tier(fleet: FleetProcess) -> None:
    for tenant in ("eu-chat", "us-chat", "us-hard"):
        assert ask(fleet.url, tenant)
        assert ask(fleet.url, tenant, stream=True)
    assert ask(fleet.url, "eu-chat", model="llama-8b")  # a trait that needs the larger model: not the edge
    names = [m.id for m in client(fleet.url, "eu-chat").models.list().data]
    assert names == ["auto", "small-1b", "llama-8b"]
    with pytest.raises(openai.AuthenticationError):
        ask(fleet.url, "nobody")
    with pytest.raises(openai.NotFoundError):
        ask(fleet.url, "eu-chat", model="gpt-5")
    central = next(s for s in fleet.servers() if s["site"] == "central")
    assert central["pid"] is None and central["alive"]  # remote: not started by the fleet, reached over HTTP
    recs = {(r["tenant"], r["models"][0]): r for r in fleet.records()}
    assert recs[("eu-chat", "small-1b")]["prefill_site"] == "fra-edge"
    assert recs[("eu-chat", "small-1b")]["tier"] == "edge"
    assert recs[("eu-chat", "llama-8b")]["prefill_site"] == "fra-core"
    assert recs[("us-chat", "small-1b")]["prefill_site"] == "iad-edge"
    for r in fleet.records():
        assert r["outcome"] == "done" and r["status"] == 200 and r["ttft_ms"] > 0 and r["token_times_ms"]
        assert {"arrival_s", "tier", "prefill_site", "reason", "e2e_ms"} <= set(r)


def test_the_gateway_passes_logprobs_echo_and_structured_output_through(fleet: FleetProcess) -> None:
    """What evaluation harnesses and applications send reaches a site's server unchanged: echo with logprobs and no
    tokens (lm-eval's loglikelihood request), chat logprobs, a JSON schema and a forced tool call."""
    c = client(fleet.url, "us-chat")
    r = c.completions.create(model="auto", prompt=["Where is Paris?", "Hi there"], max_tokens=0, echo=True, logprobs=1)
    assert [ch.text for ch in r.choices] == ["Where is Paris?", "Hi there"]
    assert all(ch.logprobs.token_logprobs[0] is None and len(ch.logprobs.tokens) >= 2 for ch in r.choices)
    r = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                  logprobs=True, top_logprobs=2)
    assert len(r.choices[0].logprobs.content) >= 1 and len(r.choices[0].logprobs.content[0].top_logprobs) == 2
    if importlib.util.find_spec("llguidance") is None:
        return
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    r = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "A number?"}], max_tokens=12,
                                  response_format=fmt)
    assert r.choices[0].message.content.startswith('{"n": ')
    r = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "A number?"}], max_tokens=16,
                                  tools=[{"type": "function", "function": {"name": "pick", "parameters": schema}}],
                                  tool_choice="required")
    assert r.choices[0].finish_reason in ("tool_calls", "length")


def test_a_stream_whose_site_dies_ends_with_an_error_event(fleet: FleetProcess) -> None:
    body = {"model": "auto", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    events = []
    started = time.monotonic()
    with httpx.stream("POST", fleet.url + "/v1/completions", json=body, headers={"Authorization": "Bearer us-chat"},
                      timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                if len(events) == 3:
                    fleet.kill_site("iad-edge")
    assert time.monotonic() - started < 30 and events[-1] == "data: [DONE]"
    assert any('"site_failed"' in e for e in events) and len(events) < 1500  # cut short, with the reason
    assert ask(fleet.url, "us-chat")  # the next one goes to the US central site
    last = [r for r in fleet.records() if r["tenant"] == "us-chat"][-2:]
    assert last[0]["prefill_site"] == "iad-edge" and last[0]["outcome"] == "failed" and last[0]["status"] == 502
    assert last[1]["prefill_site"] == "central" and last[1]["outcome"] == "done"


def test_residency_with_eu_sites_killed_and_503_when_none_is_left(fleet: FleetProcess) -> None:
    fleet.kill_site("fra-edge")
    for _ in range(4):  # the first finds the dead server (connection refused), is routed again: still the EU
        assert ask(fleet.url, "eu-chat")
        assert ask(fleet.url, "us-hard")
    fleet.kill_site("fra-core")
    with pytest.raises(openai.APIStatusError) as e:
        ask(fleet.url, "eu-chat")
    assert e.value.status_code == 503 and "no live replica" in str(e.value) and "EU" in str(e.value)
    assert ask(fleet.url, "us-hard")  # allowed in the US too: served by the central site
    assert ask(fleet.url, "us-chat")
    recs = fleet.records()
    eu = [r for r in recs if r["tenant"] == "eu-chat"]
    assert eu and all(r["prefill_site"] in EU_SITES for r in eu if r["outcome"] == "done")
    assert all(set(r["visited"]) <= EU_SITES for r in eu)
    assert any(r["retries"] > 0 for r in eu)  # failed over, and the trace says so
    assert eu[-1]["outcome"] == "refused" and eu[-1]["status"] == 503
    # independently of the gateway: no US server ever computed an EU tenant's prompt
    audited = 0
    for s in fleet.servers():
        if s["jurisdiction"] == "US":
            try:
                counts = tenant_prompt_tokens(s["address"])
            except httpx.ConnectError:  # killed by the test before (its counters died with it)
                continue
            audited += 1
            assert counts.get("eu-chat", 0) == 0 and sum(counts.values()) > 0
    assert audited >= 1
    health = httpx.get(fleet.url + "/fleet", timeout=10).json()
    assert health["summary"]["residency_violations"] == 0
    assert fleet.stop() == 0


def test_fleet_sim_replays_the_simulators_own_arrivals_and_tabulates_by_tier() -> None:
    from experiments.edge.scenario_sim import Recorded, compare, markdown, per_tier

    s = load_scenario(SMALL)
    lengths = np.array([[40, 60], [120, 20], [300, 8]])  # (prompt, answer) pairs instead of ShareGPT's
    a, b = Recorded(s, 3, lengths=lengths), Recorded(s, 3, lengths=lengths)
    a.run(), b.run()
    assert a.arrivals == b.arrivals and len(a.arrivals) == len(a.finished) > 10  # the same seed, the same requests
    rows = [{"tier": "edge", "outcome": "done", "ttft": 0.01 * i, "gaps": [0.002, 0.004]} for i in range(1, 11)]
    rows += [{"tier": None, "outcome": "refused", "ttft": None, "gaps": []}]
    stats = per_tier(rows)
    assert stats["edge"]["share"] == 1.0 and stats["regional"]["n"] == 0 and stats["outcomes"]["refused"] == 1
    assert stats["edge"]["ttft_ms"]["p50"] == pytest.approx(55.0) and stats["edge"]["itl_ms"]["p50"] == 3.0
    table = compare(stats, [stats, per_tier(rows[:5])], stats)
    assert table["edge"]["ttft_p50_ms"]["real"] == {"median": 42.5, "min": 30.0, "max": 55.0}
    assert "| edge | 100% / 100% / **100%** [100%-100%]" in markdown(table)
