"""Shared pieces of the cluster experiments (R1-R4, E5, bench_cluster): GPUs, model shapes, fleets.

Not an experiment itself. GPU numbers are the vendors' public datasheet figures (dense bf16 peak,
HBM bandwidth, memory); ``mfu`` / ``mbu`` (the share of peak a real step reaches) and the per-step
overhead are assumptions, stated in every result's setup. Model shapes are the public Llama
configurations. Everything runs in simulated time (``reference.cluster``).
"""

from __future__ import annotations

from typing import Any

GPUS: dict[str, dict[str, Any]] = {
    "H100": {"name": "H100", "memory_gb": 80, "peak_tflops": 989, "bandwidth_tbps": 3.35, "mfu": 0.7, "mbu": 0.8,
             "step_overhead_ms": 1.0},
    "A100": {"name": "A100", "memory_gb": 80, "peak_tflops": 312, "bandwidth_tbps": 2.0, "mfu": 0.7, "mbu": 0.8,
             "step_overhead_ms": 1.0},
    "L4": {"name": "L4", "memory_gb": 24, "peak_tflops": 121, "bandwidth_tbps": 0.3, "mfu": 0.6, "mbu": 0.7,
           "step_overhead_ms": 2.0},
}
MODELS: dict[str, dict[str, Any]] = {
    "llama-1b": {"name": "llama-1b", "layers": 16, "hidden": 2048, "intermediate": 8192, "heads": 32, "kv_heads": 8,
                 "head_dim": 64, "vocab": 128256},
    "llama-8b": {"name": "llama-8b", "layers": 32, "hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8,
                 "head_dim": 128, "vocab": 128256},
    "llama-70b": {"name": "llama-70b", "layers": 80, "hidden": 8192, "intermediate": 28672, "heads": 64,
                  "kv_heads": 8, "head_dim": 128, "vocab": 128256},
}
ASSUMPTIONS = ("GPU peaks from datasheets (H100 989 TFLOP/s 3.35 TB/s 80 GB; A100 312, 2.0, 80; L4 121, 0.3, 24); "
               "a step reaches mfu 0.7 (L4 0.6) of peak FLOP/s and mbu 0.8 (L4 0.7) of bandwidth, plus 1 ms "
               "(L4 2 ms) overhead; Llama 1B/8B/70B shapes")
SHARED_MACHINE = "simulated time; wall time measured on the machine in setup (its load average is recorded there)"


def site(name: str, tier: str, jurisdiction: str, replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """A site whose GPU inventory is exactly what its replicas use."""
    gpus: dict[str, int] = {}
    for r in replicas:
        gpus[r["gpu"]] = gpus.get(r["gpu"], 0) + r.get("gpus", 1) * r.get("count", 1)
    return {"name": name, "tier": tier, "jurisdiction": jurisdiction, "gpus": gpus, "replicas": replicas}


def scenario(sites: list[dict], links: list[dict], traffic: list[dict], *, duration_s: float,
             models: tuple[str, ...] = ("llama-1b", "llama-8b", "llama-70b"), **simulation: Any) -> dict[str, Any]:
    routing = {k: simulation.pop(k) for k in ("spill_wait_ms", "max_wait_s", "prefix_affinity") if k in simulation}
    return {"simulation": {"duration_s": duration_s, **simulation}, "routing": routing,
            "gpu_types": list(GPUS.values()), "models": [MODELS[m] for m in models], "sites": sites,
            "links": links, "traffic": traffic}


def link(a: str, b: str, rtt_ms: float, gbps: float = 100.0) -> dict[str, Any]:
    return {"a": a, "b": b, "rtt_ms": rtt_ms, "gbps": gbps}
