"""The step policy under a burst: ITL p99 against TTFT p50 of each server setting, throughput beside each point.

    python -m experiments.engine.burst_policy_figure experiments/results/bench_burst_policy.json [--out F.png]

Reads a ``bench_serve_vllm`` result (its ``median`` block: per server setting and client, medians over rounds)
and draws one point per setting and client (filled: ``serve.bench``, hollow: ``vllm bench serve``), vLLM's
server as stars, each labelled with its output tok/s; the shaded box is the target of issue 34 item 5 against
vLLM's server as measured by the same client (ITL p99 <= 1.5x vLLM's, TTFT p50 <= vLLM's). Also prints the
table the README carries (``--table``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

CLIENTS = ("serve.bench", "vllm bench serve")


def label(name: str, setup: dict[str, Any]) -> str:
    """``ours@2048//512`` -> "S=512"; ``ours@2048/256`` -> "cap 256"; ``ours@2048/256+g100`` -> "cap 256,
    gather 100 ms"; ``vllm@2048`` -> "vLLM"."""
    kind, _, setting = name.partition("@")
    if kind == "vllm":
        return "vLLM"
    o = setup["ours"][setting]
    parts = [f"cap {o['max_prefill_tokens_with_decodes']}"] if o.get("max_prefill_tokens_with_decodes") else []
    parts += [f"S={o['decode_stall_budget']}"] if o.get("decode_stall_budget") else []
    parts += [f"gather {o['burst_gather_ms']:g} ms"] if o.get("burst_gather_ms") else []
    return ", ".join(parts) or f"budget {o['max_num_batched_tokens']}"


def figure(result: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med, setup = result["median"], result["setup"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, client in zip(axes, CLIENTS, strict=True):
        vllm = next((m[client] for n, m in med.items() if n.startswith("vllm@") and client in m), None)
        if vllm is not None:
            ax.fill_between([0, vllm["ttft_ms.p50"]], 0, 1.5 * vllm["itl_ms.p99"], color="green", alpha=0.1,
                            label="target: ITL p99 <= 1.5x vLLM's, TTFT p50 <= vLLM's")
        for i, (name, m) in enumerate(med.items()):
            if client not in m:
                continue
            x, y, tps = m[client]["ttft_ms.p50"], m[client]["itl_ms.p99"], m[client]["output_throughput_tok_s"]
            is_vllm = name.startswith("vllm@")
            ax.scatter([x], [y], marker="*" if is_vllm else "o", s=160 if is_vllm else 60,
                       color="black" if is_vllm else colours[i % len(colours)], label=label(name, setup))
            ax.annotate(f"{tps:.0f} tok/s", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=7)
        ax.set_xlabel("TTFT p50 (ms)")
        ax.set_ylabel("ITL p99 (ms)")
        ax.set_title(f"client: {client}", fontsize=9)
        ax.set_ylim(bottom=0)
        ax.set_xlim(left=0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    loads = [x for es in result["runs"].values() for e in es for p in e["passes"] for x in p["load_average"]]
    fig.suptitle(f"{setup['workload']}; servers on core {setup['servers_on_cpus']}; medians of {setup['repeats']} "
                 f"rounds x {setup['passes']} passes; load average {min(loads):.1f}-{max(loads):.1f}; "
                 f"commit {setup['commit']}", fontsize=7)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(result: dict[str, Any]) -> str:
    med, setup = result["median"], result["setup"]
    rows = ["| server setting | output tok/s | TTFT p50 (s) | ITL p50 / p99 (ms) | CPU-ms per output token |",
            "|---|---|---|---|---|"]
    for name, m in med.items():
        cells = [" / ".join(f"{m[c][k]:.{d}f}" if c in m else "-" for c in CLIENTS)
                 for k, d in (("output_throughput_tok_s", 1),)]
        ttft = " / ".join(f"{m[c]['ttft_ms.p50'] / 1e3:.2f}" for c in CLIENTS if c in m)
        itl = ", ".join(f"{m[c]['itl_ms.p50']:.0f} / {m[c]['itl_ms.p99']:.0f}" for c in CLIENTS if c in m)
        cpu = " / ".join(f"{m[c]['server_cpu_ms_per_output_token']:.1f}" for c in CLIENTS if c in m)
        rows.append(f"| {name} ({label(name, setup)}) | {cells[0]} | {ttft} | {itl} | {cpu} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.engine.burst_policy_figure", description=__doc__)
    p.add_argument("result", type=Path, help="a bench_serve_vllm results JSON")
    p.add_argument("--out", type=Path, default=None, help="figure (default: the result's name + _tradeoff.png)")
    p.add_argument("--table", action="store_true", help="print the README's table")
    a = p.parse_args(argv)
    result = json.loads(a.result.read_text())
    out = a.out or a.result.with_name(a.result.stem + "_tradeoff.png")
    print(figure(result, out))
    if a.table:
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
