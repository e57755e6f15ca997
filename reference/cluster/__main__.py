"""Commands of the cluster layer.

    python -m reference.cluster simulate SCENARIO [--seed N] [--json OUT] [--trace T.jsonl]
    [--single-steps]
    python -m reference.cluster place SCENARIO --model NAME --chain H100,A100,L4 [--chain ...]
                                      [--nodes 0,0,1] [--batch 64 --context 1024 | --prefill 2048]
                                      [--kv-tokens 65536] [--brute-force] [--json OUT]

``simulate`` runs a scenario file (format: reference/cluster/README.md) and prints its summary;
``--trace`` writes the decision trace, one JSON line per request; ``--single-steps`` queues one
event per engine step instead of macro steps (the same run, slower: a check of the simulator).
``place`` splits a model's layers over each chain of GPUs (exact DP), next to the uniform split and
the LP upper bound of the pool.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reference.cluster.pipeline import ChainGpu, chain_problem, tokens_per_s
from reference.cluster.placement import (
    PlacementError,
    best_split,
    brute_force_split,
    lp_upper_bound,
    uniform_split,
)
from reference.cluster.scenario import ScenarioError, load_scenario
from reference.engine.cost import StepShape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference.cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="run a scenario in simulated time")
    sim.add_argument("scenario", type=Path, help="a scenario file (.toml or .json)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the arrivals and every random "
                                                         "choice (default 0)")
    sim.add_argument("--json", type=Path, help="write the summary here")
    sim.add_argument("--trace", type=Path, help="write the decision trace (JSON lines) here")
    sim.add_argument("--single-steps", action="store_true", help="one event per engine step (no "
                                                                 "macro steps)")
    place = sub.add_parser("place", help="split a model's layers over chains of unlike GPUs")
    place.add_argument("scenario", type=Path, help="a scenario file (for its gpu_types and models)")
    place.add_argument("--model", required=True, help="a model named in the scenario's models")
    place.add_argument("--chain", action="append", required=True,
                       help="GPU types in pipeline order, comma-separated")
    place.add_argument("--nodes", action="append", help="node id per GPU of the matching --chain "
                                                        "(default: one node)")
    place.add_argument("--batch", type=int, default=64, help="decode micro-batch: sequences")
    place.add_argument("--context", type=int, default=1024, help="decode micro-batch: context "
                                                                 "tokens each")
    place.add_argument("--prefill", type=int, default=0, help="instead, a prefill chunk of this "
                                                              "many tokens")
    place.add_argument("--kv-tokens", type=int, default=65_536,
                       help="KV reserve per layer, in tokens")
    place.add_argument("--brute-force", action="store_true",
                       help="also check the DP against every split")
    place.add_argument("--json", type=Path, help="write the placement here")
    args = parser.parse_args(argv)
    try:
        out = simulate_command(args) if args.command == "simulate" else place_command(args)
    except (ScenarioError, PlacementError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(out, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


def simulate_command(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from reference.cluster.simulator import Simulator

    scenario = load_scenario(args.scenario)
    trace = open(args.trace, "w") if args.trace else None  # noqa: SIM115 (closed below)
    try:
        sim = Simulator(scenario, args.seed, trace=trace, macro_steps=not args.single_steps)
        with tqdm(total=round(scenario.duration_s, 3), unit="sim s", file=sys.stderr) as bar:
            def progress(t: float) -> None:
                bar.n = round(min(t, scenario.duration_s), 3)
                bar.refresh()

            result = sim.run(on_progress=progress)
            progress(scenario.duration_s)
    finally:
        if trace is not None:
            trace.close()
    return {"scenario": str(args.scenario), "seed": args.seed, **result.summary()}


def place_command(args: argparse.Namespace) -> dict:
    scenario = load_scenario(args.scenario)
    if args.model not in scenario.models:
        raise PlacementError(f"unknown model {args.model!r}; the scenario has "
                             f"{sorted(scenario.models)}")
    model = scenario.models[args.model]
    if args.batch < 1 or args.context < 1 or args.prefill < 0 or args.kv_tokens < 0:
        raise PlacementError("--batch and --context must be >= 1, --prefill and --kv-tokens >= 0")
    shape = StepShape((args.prefill,), (args.prefill,), 1) if args.prefill else \
        StepShape((1,) * args.batch, (args.context,) * args.batch, args.batch)
    chains, problems = [], []
    for n, names in enumerate(args.chain):
        gpus = [g.strip() for g in names.split(",") if g.strip()]
        unknown = [g for g in gpus if g not in scenario.gpu_types]
        if unknown:
            raise PlacementError(f"--chain {names}: unknown GPU type(s) {unknown}; known: "
                                 f"{sorted(scenario.gpu_types)}")
        nodes = [0] * len(gpus)
        if args.nodes and n < len(args.nodes):
            try:
                nodes = [int(x) for x in args.nodes[n].split(",")]
            except ValueError:
                raise PlacementError(
                    f"--nodes {args.nodes[n]}: node ids must be integers"
                ) from None
            if len(nodes) != len(gpus):
                raise PlacementError(f"--nodes {args.nodes[n]}: one node id per GPU of --chain "
                                     f"{names}")
        p = chain_problem(model, [ChainGpu(scenario.gpu_types[g], node) for g,
                                  node in zip(gpus, nodes, strict=True)],
                          shape, kv_tokens=args.kv_tokens)
        best, uniform = best_split(p), uniform_split(p)
        row = {"chain": gpus, "nodes": nodes, "best_layers": best.layers,
               "best_tokens_per_s": tokens_per_s(best, shape),
               "uniform_layers": uniform.layers, "uniform_feasible": uniform.feasible,
               "uniform_tokens_per_s": tokens_per_s(uniform, shape)}
        if args.brute_force:
            row["brute_force_agrees"] = brute_force_split(p).bottleneck_s == best.bottleneck_s
        chains.append(row)
        problems.append(p)
    return {"model": model.name, "micro_batch_tokens": shape.num_tokens, "chains": chains,
            "pool_best_tokens_per_s": sum(c["best_tokens_per_s"] for c in chains),
            "pool_uniform_tokens_per_s": sum(c["uniform_tokens_per_s"] for c in chains),
            "pool_lp_upper_bound_tokens_per_s": shape.num_tokens * lp_upper_bound(problems)}


if __name__ == "__main__":
    sys.exit(main())
