"""A load step on one site of a fleet on Ray: its servers (Ray actors) and its throughput over time.

    python -m experiments.edge.bench_ray_scale [--before 6] [--load 40] [--after 30] [--clients 8]
                                              [--json experiments/results/bench_ray_scale.json]

One site (``edge``: the tiny model, ``max_num_seqs`` 2, scaled between ``min_workers`` 1 and
``max_workers`` 3 with ``target_ongoing_requests`` 2) behind the fleet's gateway, on a local Ray cluster
(``--ray local``: one node labelled with the site's jurisdiction and tier). Each server emulates a
device whose step takes 20 ms (``--emulate-step-ms``): replicas on a shared 2-core machine add no
compute, replicas on devices do. Idle for ``--before`` seconds, then ``--clients`` closed-loop
clients each send one streamed request of 48 tokens after another for ``--load`` seconds, then idle
for ``--after`` seconds. Sampled every 0.5 s: the site's servers up (actors alive) and the output
tokens the clients received; throughput is the tokens of the last 2 s. Written: the samples, the
scaling events, throughput with one server (the load step before the first scale-up) against
throughput at the most servers, and a figure (replicas and throughput over time) beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "results"
OUTPUT_TOKENS = 48
STEP_MS = 20.0  # each server emulates a device whose step takes 20 ms (serve --emulate-step-ms)


def scenario() -> Any:
    from reference.cluster.scenario import scenario_from_dict

    model = {"name": "small-1b", "layers": 16, "hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8,
             "head_dim": 64, "vocab": 128256}
    return scenario_from_dict({
        "simulation": {"duration_s": 10.0, "max_num_seqs": 2, "max_num_batched_tokens": 256, "policy": "fcfs"},
        "gpu_types": [{"name": "L4", "memory_gb": 24, "peak_tflops": 121, "bandwidth_tbps": 0.3}],
        "models": [model],
        "sites": [{"name": "edge", "tier": "edge", "jurisdiction": "EU", "gpus": {"L4": 3},
                   "replicas": [{"model": "small-1b", "gpu": "L4"}], "serve_model": "tiny",
                   "min_workers": 1, "max_workers": 3, "target_ongoing_requests": 2.0}],
        "traffic": [{"name": "users", "origins": ["edge"], "rate_per_s": 1, "models": ["small-1b"],
                     "allowed": ["EU"], "lengths": "fixed", "prompt_tokens": 32, "output_tokens": OUTPUT_TOKENS}],
    })


def run(before: float, load: float, after: float, clients: int) -> dict[str, Any]:
    import httpx

    from serve.fleet import Fleet

    fleet = Fleet(scenario(), poll_s=0.25, ray="local", engine_args=["--emulate-step-ms", str(STEP_MS)])
    tokens = [0]
    lock = threading.Lock()
    stop = threading.Event()
    fleet.start_sites()
    url = fleet.serve(in_thread=True)
    t0 = time.monotonic()

    def client() -> None:
        body = {"model": "auto", "prompt": "Tell me a story about the sea.", "max_tokens": OUTPUT_TOKENS,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                with c.stream("POST", url + "/v1/completions", json=body,
                              headers={"Authorization": "Bearer users"}) as r:
                    for line in r.iter_lines():
                        if line.startswith('data: {"id"'):
                            with lock:
                                tokens[0] += 1

    samples: list[dict[str, float]] = []
    threads: list[threading.Thread] = []
    try:
        end = before + load + after
        while (t := time.monotonic() - t0) < end:
            if t >= before and not threads:
                threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
                for th in threads:
                    th.start()
            if t >= before + load and not stop.is_set():
                stop.set()
            alive = sum(1 for r in fleet.replicas if r.alive and r.worker.address)
            samples.append({"t": round(t, 2), "servers": fleet.sites.servers_up("edge"), "serving": alive,
                            "tokens": tokens[0]})
            time.sleep(0.5)
    finally:
        stop.set()
        for th in threads:
            th.join(120)
        shift = t0 - fleet.sites.t0  # the events' clock starts with the fleet; the samples' with the step
        events = [{**e, "t": round(e["t"] - shift, 3)} for e in fleet.sites.events]
        fleet.stop()
    for i, s in enumerate(samples):  # tokens of the last 2 s
        j = max(k for k in range(i + 1) if samples[k]["t"] <= s["t"] - 2.0) if s["t"] >= 2.0 else 0
        dt = s["t"] - samples[j]["t"]
        s["tok_s"] = round((s["tokens"] - samples[j]["tokens"]) / dt, 2) if dt > 0 else 0.0
    return {"samples": samples, "events": events}


def summarize(result: dict[str, Any], before: float, load: float) -> dict[str, Any]:
    samples = result["samples"]
    ups = [e["t"] for e in result["events"] if e["event"] == "scaled_up"]
    in_load = [s for s in samples if before + 2.0 <= s["t"] <= before + load]  # 2 s after the step: a full window
    one = [s["tok_s"] for s in in_load if s["serving"] == 1]  # until a second server serves
    top = max((s["serving"] for s in in_load), default=0)
    reached = min((s["t"] for s in in_load if s["serving"] == top), default=0.0)
    most = [s["tok_s"] for s in in_load if s["serving"] == top and s["t"] >= reached + 2.0]
    tail = [s for s in samples if s["t"] >= samples[-1]["t"] - 3.0]

    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 2) if xs else None

    return {"servers_before": samples[0]["servers"] if samples else None, "servers_max_during_load": top,
            "servers_at_end": tail[-1]["servers"] if tail else None,
            "tok_s_one_server": mean(one), "tok_s_most_servers": mean(most),
            "serving_max_at_s": reached, "scaled_up_at_s": ups, "scaled_down_at_s": [e["t"] for e in result["events"]
                                                         if e["event"] == "scaled_down"]}


def figure(result: dict[str, Any], path: Path, before: float, load: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.axvspan(before, before + load, color="0.92", label="load step")
    ax.plot([x["t"] for x in s], [x["tok_s"] for x in s], color="C0", label="output tokens/s (2 s window)")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("tokens/s", color="C0")
    ax2 = ax.twinx()
    ax2.step([x["t"] for x in s], [x["servers"] for x in s], where="post", color="C3", label="servers (Ray actors)")
    ax2.step([x["t"] for x in s], [x["serving"] for x in s], where="post", color="C3", ls=":",
             label="servers serving")
    ax2.set_ylabel("servers", color="C3")
    ax2.set_ylim(0, 4)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper right", fontsize=8)
    ax.set_title("A load step on one site of the fleet on Ray: it scales up, then back down")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.edge.bench_ray_scale",
                                description=__doc__.split("\n")[0])
    p.add_argument("--before", type=float, default=6.0, help="idle seconds before the load (default 6)")
    p.add_argument("--load", type=float, default=40.0, help="seconds of load (default 40)")
    p.add_argument("--after", type=float, default=30.0, help="idle seconds after the load (default 30)")
    p.add_argument("--clients", type=int, default=8, help="closed-loop clients (default 8)")
    p.add_argument("--json", type=Path, default=RESULTS / "bench_ray_scale.json",
                   help="where the samples go (a figure is written beside it)")
    args = p.parse_args()
    result = run(args.before, args.load, args.after, args.clients)
    summary = summarize(result, args.before, args.load)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"summary": summary, "setup": {"before_s": args.before, "load_s": args.load, "after_s": args.after,
                                         "clients": args.clients, "output_tokens": OUTPUT_TOKENS,
                                         "model": "tiny (serve/fleet/tiny.py), reference engine",
                                         "emulated_step_ms": STEP_MS, "commit": commit,
                                         "machine": f"{platform.machine()}, {platform.node()}: shared by other jobs"},
           **result}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    figure(result, args.json.with_suffix(".png"), args.before, args.load)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
