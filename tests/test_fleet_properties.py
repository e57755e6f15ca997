"""Residency on real processes, as a property: random tenants, random traits, random site kills.

One fleet of ``reference/cluster/examples/fleet_small.toml`` (four real ``python -m serve`` processes, the
gateway in this process so the test can kill and restart sites). Each example sends requests of random
tenants and kills random sites in between; for every request, against what is really alive:

* answered (200) if and only if some live site of an allowed jurisdiction holds an acceptable model
  (never refused while one is up, never served when none is);
* served by such a site (the trace), and the 503 names the router's reason;
* no server ever computed a prompt of a tenant outside that tenant's jurisdictions (each server's own
  per-tenant token counters, read from its ``/metrics``: independent of the gateway).
"""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from serve.fleet import Fleet  # noqa: E402
from serve.keys import KeyTable  # noqa: E402

SMALL = Path(__file__).resolve().parent.parent / "reference/cluster/examples/fleet_small.toml"
TENANTS = ("eu-chat", "us-chat", "us-hard")
SITES = ("fra-edge", "fra-core", "iad-edge", "central")
# serve's own keys table: each key's tenant is a traffic class of the scenario, on its plan
KEYS = {"keys": {"sk-eu-1": {"tenant": "eu-chat", "plan": "paid"}, "sk-us-1": {"tenant": "us-chat", "plan": "free"},
                 "sk-us-2": {"tenant": "us-hard", "plan": "free"}}}
KEY_OF = {entry["tenant"]: key for key, entry in KEYS["keys"].items()}


class Run:
    def __init__(self, workdir: Path) -> None:
        self.trace = io.StringIO()
        self.fleet = Fleet(SMALL, workdir=workdir, keys=KeyTable.from_dict(KEYS), trace=self.trace, poll_s=0.3)
        self.fleet.start_sites()
        self.url = self.fleet.serve(in_thread=True)
        self.killed: set[str] = set()
        self.s = self.fleet.s

    def ask(self, tenant: str, model: str, stream: bool) -> httpx.Response:
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 4, "stream": stream}
        return httpx.post(self.url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY_OF[tenant]}"}, timeout=60)

    def could_serve(self, tenant: str, model: str) -> set[str]:
        """The live sites allowed for ``tenant`` holding a model its request accepts (the truth, not the view)."""
        t = next(t for t in self.s.traffic if t.name == tenant)
        models = t.models if model == "auto" else t.models[t.models.index(model):] if model in t.models else (model,)
        return {name for name, site in self.s.sites.items() if name not in self.killed
                and site.jurisdiction in t.allowed and any(r.model in models for r in site.replicas)}

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.trace.getvalue().splitlines()]

    def restore(self) -> None:
        for site in sorted(self.killed):
            self.fleet.sites.restart_site(site)
        self.killed.clear()
        deadline = time.monotonic() + 30
        while not all(r.alive for r in self.fleet.replicas):
            assert time.monotonic() < deadline, "restarted servers were not seen alive"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    r = Run(tmp_path_factory.mktemp("fleetprop"))
    yield r
    r.fleet.stop()


action = st.one_of(
    st.tuples(st.just("ask"), st.sampled_from(TENANTS), st.sampled_from(["auto", "llama-8b"]), st.booleans()),
    st.tuples(st.just("kill"), st.sampled_from(SITES)))


def test_keys_are_servers_keys_and_name_traffic_classes(run: Run) -> None:
    assert run.ask("eu-chat", "auto", False).status_code == 200
    wrong = httpx.post(run.url + "/v1/completions", json={"model": "auto", "prompt": "x"},
                       headers={"Authorization": "Bearer eu-chat"}, timeout=30)  # a class name is no key here
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"


def check_example(run: Run, actions: list[tuple]) -> None:
    for a in actions:
        if a[0] == "kill":
            run.fleet.sites.kill_site(a[1])
            run.killed.add(a[1])
            continue
        _, tenant, model, stream = a
        expected = run.could_serve(tenant, model)
        before = len(run.records())
        resp = run.ask(tenant, model, stream)
        text = resp.text
        rec = run.records()[before:]
        assert len(rec) == 1, text
        rec = rec[0]
        if expected:
            assert resp.status_code == 200, (tenant, model, run.killed, text)
            assert rec["outcome"] == "done" and rec["prefill_site"] in expected, (rec, expected)
        else:
            assert resp.status_code == 503, (tenant, model, run.killed, text)
            assert "no live replica" in resp.json()["error"]["message"], text
            assert rec["outcome"] == "refused"
        allowed = next(t.allowed for t in run.s.traffic if t.name == tenant)
        assert all(run.s.sites[site].jurisdiction in allowed for site in rec["visited"]), rec
    for rep in run.fleet.replicas:  # the servers' own accounts (the live ones: a killed one lost its counters)
        if rep.site in run.killed:
            continue
        text = httpx.get(f"http://{rep.worker.address}/metrics", timeout=10).text
        for tenant, n in re.findall(r'unfire_prompt_tokens_total\{tenant="([^"]+)"\} (\d+)', text):
            t = next((t for t in run.s.traffic if t.name == tenant), None)
            assert t is None or int(n) == 0 or rep.jurisdiction in t.allowed, (rep.site, tenant, n)
    run.restore()


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action, min_size=3, max_size=8).filter(lambda xs: sum(a[0] == "kill" for a in xs) <= 2))
@example(actions=[("kill", "fra-edge"), ("ask", "eu-chat", "auto", True), ("ask", "us-hard", "auto", False),
                  ("kill", "fra-core"), ("ask", "eu-chat", "auto", False), ("ask", "us-hard", "llama-8b", True)])
def test_residency_under_random_tenants_and_site_kills(run: Run, actions: list[tuple]) -> None:
    check_example(run, actions)


@pytest.mark.slow
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action, min_size=4, max_size=14).filter(lambda xs: sum(a[0] == "kill" for a in xs) <= 3))
def test_residency_under_random_tenants_and_site_kills_longer(run: Run, actions: list[tuple]) -> None:
    check_example(run, actions)
