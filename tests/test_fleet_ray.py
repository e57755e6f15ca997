"""The fleet on Ray: ``python -m serve fleet SCENARIO --ray local`` (serve/fleet/ray_sites.py).

One local Ray cluster (``ray.cluster_utils.Cluster``: a node per site, labelled with the site's
jurisdiction and tier) serves the whole module: the fleet of reference/cluster/examples/fleet_small.toml,
with its US edge site scaled between 1 and 2 servers. Real processes throughout: Ray's raylets and actor
workers, the servers they start, the gateway in this process. Checked: every tenant is served; every
server runs on a node whose labels are its site's (asked of Ray itself); a killed server is restarted by
Ray and routed to again; a removed node's site waits, pending, while EU requests stay in the EU, and is
placed by Ray on a new node with the same labels; with no EU node left, EU tenants get 503 while others
are served; the residency audit and each US server's own counters show no EU prompt ever left the EU;
a load step scales the US edge up and back down. Without Ray, ``--ray`` says how to install it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from reference.cluster.scenario import load_scenario, scenario_from_dict  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SMALL = REPO / "reference/cluster/examples/fleet_small.toml"
EU_SITES = {"fra-edge", "fra-core"}
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="ray is not installed (pip install -e '.[ray]')")


def ask(url: str, tenant: str, model: str = "auto", max_tokens: int = 4, **more: object) -> httpx.Response:
    body = {"model": model, "prompt": "Where is Paris?", "max_tokens": max_tokens, **more}
    return httpx.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {tenant}"}, timeout=120)


def wait_for(what: str, cond, timeout: float = 60.0) -> None:  # noqa: ANN001
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def scaled_scenario() -> object:
    """fleet_small with its US edge scaled between 1 and 2 servers, one request in flight per server."""
    import tomllib

    data = tomllib.loads(SMALL.read_text())
    iad = next(site for site in data["sites"] if site["name"] == "iad-edge")
    iad.update(min_workers=1, max_workers=2, target_ongoing_requests=1.0)
    return scenario_from_dict(data)


def test_scaling_keys_are_checked() -> None:
    import tomllib

    from reference.cluster.scenario import ScenarioError

    data = tomllib.loads(SMALL.read_text())
    for bad, needle in [({"min_workers": 2, "max_workers": 1}, "min_workers"), ({"max_workers": 3, "workers": 1},
                        "max_workers"), ({"min_workers": 1, "max_workers": 2, "target_ongoing_requests": 0},
                                         "target_ongoing_requests")]:
        broken = json.loads(json.dumps(data))
        broken["sites"][0] = {k: v for k, v in broken["sites"][0].items() if k != "workers"} | bad
        with pytest.raises(ScenarioError, match=needle):
            scenario_from_dict(broken)
    s = scaled_scenario()
    from serve.fleet.ray_sites import first_servers, local_nodes
    from serve.fleet.sites import plan_workers

    workers = plan_workers(s)
    assert [w.site for w in workers].count("iad-edge") == 2  # a slot per server it may scale to
    assert [w.site for w in first_servers(s, workers)].count("iad-edge") == 1
    nodes = {labels["site"]: (labels, cpus) for labels, cpus in local_nodes(s, workers)}
    assert nodes["iad-edge"] == ({"jurisdiction": "US", "tier": "edge", "site": "iad-edge"}, 2)


def test_without_ray_the_flag_says_how_to_install(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['ray'] = None\nfrom serve.fleet import main\n"
            f"sys.exit(main([{str(SMALL)!r}, '--ray', 'local', '--port', '0', '--workdir', {str(tmp_path)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 2 and "--ray needs Ray" in r.stderr and "pip install -e '.[ray]'" in r.stderr


# ---- one local Ray cluster for the rest of the module ---------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[ray]')")
    from serve.fleet import Fleet

    tmp = tmp_path_factory.mktemp("fleet_ray")
    trace = (tmp / "trace.jsonl").open("w")
    f = Fleet(scaled_scenario(), workdir=tmp / "work", trace=trace, poll_s=0.3, ray="local")
    f.sites.down_delay_s = 2.0
    f.trace_path = tmp / "trace.jsonl"
    try:
        f.start_sites()
        f.serve(in_thread=True)
        yield f
    finally:
        f.stop()
        trace.close()


def servers(f) -> list[dict]:  # noqa: ANN001
    return httpx.get(f.url + "/fleet", timeout=10).json()["servers"]


def records(f) -> list[dict]:  # noqa: ANN001
    return [json.loads(line) for line in f.trace_path.read_text().splitlines()]


def alive(f, site: str) -> list[dict]:  # noqa: ANN001
    return [s for s in servers(f) if s["site"] == site and s["alive"] and s["address"]]


@needs_ray
def test_every_tenant_is_served_on_nodes_of_its_sites_labels(fleet) -> None:  # noqa: ANN001
    import ray

    for tenant in ("eu-chat", "us-chat", "us-hard"):
        assert ask(fleet.url, tenant).status_code == 200
        assert ask(fleet.url, tenant, stream=True).status_code == 200
    assert ask(fleet.url, "eu-chat", model="llama-8b").status_code == 200
    labels = {n["NodeID"]: n["Labels"] for n in ray.nodes() if n["Alive"]}
    up = [s for s in servers(fleet) if s["address"]]
    assert len(up) == 4  # the scaled site starts with its minimum
    s = fleet.s
    for server in up:  # Ray's own word on where each actor runs
        site = s.sites[server["site"]]
        assert labels[server["node"]]["jurisdiction"] == site.jurisdiction
        assert labels[server["node"]]["tier"] == site.tier
    recs = {(r["tenant"], r["models"][0]): r for r in records(fleet)}
    assert recs[("eu-chat", "small-1b")]["prefill_site"] == "fra-edge"
    assert recs[("eu-chat", "llama-8b")]["prefill_site"] == "fra-core"
    assert recs[("us-chat", "small-1b")]["prefill_site"] == "iad-edge"


@needs_ray
def test_a_killed_server_is_restarted_by_ray_and_served_again(fleet) -> None:  # noqa: ANN001
    before = alive(fleet, "fra-edge")[0]
    os.kill(before["pid"], signal.SIGKILL)  # the server process; its actor follows it, Ray restarts both
    for _ in range(3):
        assert ask(fleet.url, "eu-chat").status_code == 200  # meanwhile: the EU's regional site, or fra-edge back
    wait_for("fra-edge back", lambda: any(s["pid"] != before["pid"] for s in alive(fleet, "fra-edge")), 90)
    after = alive(fleet, "fra-edge")[0]
    assert after["node"] == before["node"]  # its node is still there: restarted in place
    assert any(e["event"] == "restarted" and e["site"] == "fra-edge" for e in fleet.sites.events)
    assert ask(fleet.url, "eu-chat").status_code == 200
    assert records(fleet)[-1]["prefill_site"] == "fra-edge"  # edge first again


@needs_ray
def test_a_removed_nodes_site_comes_back_on_a_new_node_with_its_labels(fleet) -> None:  # noqa: ANN001
    conn = fleet.sites.conn
    before = alive(fleet, "fra-edge")[0]
    node = next(n for labels, n in conn.nodes if labels["site"] == "fra-edge")
    conn.remove_node(node)
    wait_for("fra-edge down", lambda: not alive(fleet, "fra-edge"), 30)
    for _ in range(3):  # no EU edge node: served by the EU regional site, never outside the EU
        r = ask(fleet.url, "eu-chat")
        assert r.status_code == 200
        assert records(fleet)[-1]["prefill_site"] == "fra-core"
    time.sleep(2)
    assert not alive(fleet, "fra-edge")  # pending: Ray has no node with its labels
    conn.add_node({"jurisdiction": "EU", "tier": "edge", "site": "fra-edge-2"}, 1)
    wait_for("fra-edge on the new node", lambda: bool(alive(fleet, "fra-edge")), 90)
    after = alive(fleet, "fra-edge")[0]
    assert after["node"] != before["node"]
    assert ask(fleet.url, "eu-chat").status_code == 200
    assert records(fleet)[-1]["prefill_site"] == "fra-edge"


@needs_ray
def test_with_no_eu_node_left_eu_tenants_get_503_and_residency_holds(fleet) -> None:  # noqa: ANN001
    conn = fleet.sites.conn
    for labels, node in list(conn.nodes):
        if labels["jurisdiction"] == "EU":
            conn.remove_node(node)
    wait_for("the EU sites down", lambda: not alive(fleet, "fra-edge") and not alive(fleet, "fra-core"), 30)
    r = ask(fleet.url, "eu-chat")
    assert r.status_code == 503 and "no live replica" in r.text and "EU" in r.text
    assert ask(fleet.url, "us-hard").status_code == 200  # allowed in the US too
    assert ask(fleet.url, "us-chat").status_code == 200
    eu = [r for r in records(fleet) if r["tenant"] == "eu-chat"]
    assert eu and all(set(r["visited"]) <= EU_SITES for r in eu)
    assert all(r["prefill_site"] in EU_SITES for r in eu if r["outcome"] == "done")
    assert eu[-1]["outcome"] == "refused" and eu[-1]["status"] == 503
    assert httpx.get(fleet.url + "/fleet", timeout=10).json()["summary"]["residency_violations"] == 0
    # independently of the gateway: the US servers' own per-tenant counters
    import re

    for s in servers(fleet):
        if s["jurisdiction"] == "US" and s["address"]:
            text = httpx.get(f"http://{s['address']}/metrics", timeout=10).text
            assert not re.search(r'unfire_prompt_tokens_total\{tenant="eu-chat"\} [1-9]', text)


@needs_ray
def test_a_load_step_scales_the_site_up_and_back_down(fleet) -> None:  # noqa: ANN001
    assert fleet.sites.servers_up("iad-edge") == 1
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            ask(fleet.url, "us-chat", max_tokens=64, ignore_eos=True)

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    def served() -> set:
        return {r["worker"] for r in records(fleet) if r["tenant"] == "us-chat" and r["prefill_site"] == "iad-edge"}

    try:
        wait_for("a second iad-edge server", lambda: len(alive(fleet, "iad-edge")) == 2, 90)
        # the load goes on until the new server has answered too (it may come up just as a request finishes)
        wait_for("both iad-edge servers serving", lambda: len(served()) == 2, 60)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    wait_for("back to one iad-edge server", lambda: fleet.sites.servers_up("iad-edge") == 1, 60)
    kinds = [e["event"] for e in fleet.sites.events if e["site"] == "iad-edge"]
    assert "scaled_up" in kinds and "scaled_down" in kinds
    assert len(served()) == 2  # both servers took requests
    assert ask(fleet.url, "us-chat").status_code == 200


def test_load_scenario_still_reads_the_example() -> None:
    assert load_scenario(SMALL).sites["iad-edge"].max_workers == 0


@needs_ray
def test_the_command_with_ray_local_prints_its_servers_serves_and_stops(tmp_path: Path) -> None:
    import tomllib

    data = tomllib.loads(SMALL.read_text())  # one site, one tenant: the command's own path, kept short
    data["sites"] = [s for s in data["sites"] if s["name"] == "fra-edge"]
    data["models"] = data["models"][:1]
    data["traffic"] = [dict(t, models=["small-1b"]) for t in data["traffic"] if t["name"] == "eu-chat"]
    for key in ("links", "failures"):
        data.pop(key)
    scenario = tmp_path / "one_site.json"
    scenario.write_text(json.dumps(data))
    cmd = [sys.executable, "-m", "serve", "fleet", str(scenario), "--ray", "local", "--port", "0",
           "--workdir", str(tmp_path / "work")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"), start_new_session=True)
    try:
        lines, url = [], None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "gateway on http://" in line:
                url = line.split("gateway on ")[1].split("/v1")[0]
        assert url, "".join(lines)
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        assert sum(" on Ray node " in line for line in lines) == 1 and "on Ray (local)" in lines[-1]
        assert ask(url, "eu-chat").status_code == 200
        pids = [s["pid"] for s in httpx.get(url + "/fleet", timeout=10).json()["servers"]]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for pid in pids:  # the servers went with their actors
            wait_for(f"server {pid} gone", lambda pid=pid: not Path(f"/proc/{pid}").exists()
                     or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z", 20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
