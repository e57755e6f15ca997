"""Random small scenarios with failures injected: the residency property's test cases (tests, claim
R3).

Each scenario has 2-6 sites in random tiers and jurisdictions (EU, US, CN), a random connected set
of links, colocated and disaggregated replicas, 1-3 traffic classes with random allowed
jurisdictions (sometimes ones no site has, to exercise refusals), and 0-3 site failures.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reference.cluster.scenario import TIERS, Scenario, scenario_from_dict

JURISDICTIONS = ("EU", "US", "CN")
TINY_MODEL = {"layers": 2, "hidden": 256, "intermediate": 512, "heads": 4, "kv_heads": 2,
              "head_dim": 64, "vocab": 1000}
GPU = {"name": "G", "memory_gb": 1.0, "peak_tflops": 100.0, "bandwidth_tbps": 1.0,
       "step_overhead_ms": 1.0}


def random_scenario_dict(rng: np.random.Generator, *, residency: bool = True,
                         requests: float = 20.0) -> dict[str, Any]:
    """A random scenario as plain data. ``residency=False``: every traffic class may go anywhere."""
    n = int(rng.integers(2, 7))
    names = [f"s{i}" for i in range(n)]
    sites = []
    for name in names:
        replicas = []
        for _ in range(int(rng.integers(1, 3))):
            kind = rng.choice(["colocated", "disagg"], p=[0.6, 0.4])
            model = str(rng.choice(["a", "b"]))
            if kind == "colocated":
                replicas.append({"model": model, "gpu": "G", "role": "colocated"})
            else:
                replicas.append({"model": model, "gpu": "G", "role": "prefill"})
                replicas.append({"model": model, "gpu": "G", "role": "decode"})
        sites.append({"name": name, "tier": str(rng.choice(TIERS)),
                      "jurisdiction": str(rng.choice(JURISDICTIONS)),
                      "gpus": {"G": len(replicas)}, "replicas": replicas})
    links = []
    for i in range(1, n):  # a random tree keeps everything connected ...
        links.append({"a": names[i], "b": names[int(rng.integers(i))],
                      "rtt_ms": float(rng.uniform(1, 80)), "gbps": float(rng.uniform(1, 100))})
    # ... plus a few shortcuts, maybe through other jurisdictions
    for _ in range(int(rng.integers(0, n))):
        a, b = rng.choice(n, size=2, replace=False)
        links.append({"a": names[a], "b": names[b], "rtt_ms": float(rng.uniform(1, 80)),
                      "gbps": float(rng.uniform(1, 100))})
    traffic = []
    for k in range(int(rng.integers(1, 4))):
        allowed = sorted({str(j) for j in rng.choice(JURISDICTIONS, size=int(rng.integers(1, 3)))})
        traffic.append(
            {
                "name": f"t{k}",
                "origins": [names[int(rng.integers(n))]],
                "rate_per_s": float(requests),
                "models": [str(m) for m in rng.permutation(["a", "b"])],
                "allowed": allowed if residency else list(JURISDICTIONS),
                "lengths": "fixed",
                "prompt_tokens": int(rng.integers(8, 80)),
                "output_tokens": int(rng.integers(1, 6)),
                "system_prompts": int(rng.integers(0, 3)),
                "system_prompt_tokens": 32,
            }
        )
    failures = [{"site": names[int(rng.integers(n))], "at_s": float(rng.uniform(0, 1)),
                 "duration_s": float(rng.uniform(0.05, 1))} for _ in range(int(rng.integers(0, 4)))]
    return {"simulation": {"duration_s": 1.0, "block_size": 16, "max_num_batched_tokens": 256,
                           "max_num_seqs": 8},
            "routing": {"spill_wait_ms": {"edge": 5.0, "regional": 20.0}, "max_wait_s": 3.0},
            "gpu_types": [dict(GPU)], "models": [{"name": "a", **TINY_MODEL},
                                                 {"name": "b", **TINY_MODEL, "layers": 4}],
            "sites": sites, "links": links, "traffic": traffic, "failures": failures}


def random_scenario(rng: np.random.Generator, **kwargs: Any) -> Scenario:
    return scenario_from_dict(random_scenario_dict(rng, **kwargs))
