"""The engine benchmark's JSON (summary, verdict against the issue's goals) and figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments.registry import pyplot

GOAL = "fast engine >= 2x the useful tok/s of transformers bf16 at its best batch size, and above llama.cpp"
LLAMA_CPP_EARLIER = "~155 useful tok/s, static B=32, measured earlier on this machine (not in this run)"


def result_json(measured: dict[str, Any], setup: dict[str, Any]) -> dict[str, Any]:
    systems = {k: v for k, v in measured.items() if isinstance(v, dict) and "useful_tok_s" in v}
    tok_s = {k: v["useful_tok_s"] for k, v in systems.items()}
    out: dict[str, Any] = {
        "title": "Engine throughput: fast engine vs transformers vs reference (one run, same threads)",
        "measured": {"useful_tok_s": tok_s,
                     "ttft_ms": {k: v["ttft_ms"] for k, v in systems.items()},
                     "itl_ms": {k: v["itl_ms"] for k, v in systems.items()},
                     "seconds": {k: v["seconds"] for k, v in systems.items()},
                     "phases": {k: v["phases"] for k, v in systems.items() if "phases" in v},
                     "cpu_s_per_token": {k: v["cpu_s_per_token"] for k, v in systems.items()
                                         if "cpu_s_per_token" in v},
                     "runs": {k: v["runs"] for k, v in systems.items() if len(v.get("runs", ())) > 1}},
        "setup": setup, "goal": GOAL,
    }
    if "vllm_bf16" in tok_s:
        out["vs_vllm"] = vs_vllm(measured, tok_s, out["measured"]["cpu_s_per_token"])
        out["measured"]["fast_over_vllm"] = out["vs_vllm"]["median"]
    if "llama_cpp" not in tok_s:
        out["llama_cpp_reference_point"] = LLAMA_CPP_EARLIER
    if "transformers_by_batch" in measured:
        out["measured"]["transformers_by_batch"] = measured["transformers_by_batch"]
        out["measured"]["transformers_best_batch"] = systems["transformers_bf16"]["batch_size"]
    fast = max((tok_s[k] for k in ("fast_bf16", "fast_fp32") if k in tok_s), default=None)
    hf = tok_s.get("transformers_bf16")
    parts = [f"{k} {v:.1f}" for k, v in tok_s.items()]
    out["summary"] = "useful tok/s: " + ", ".join(parts)
    if "median" in out.get("vs_vllm", {}):
        v = out["vs_vllm"]
        out["summary"] += (f"; fast_bf16 / vllm_bf16 {v['median']:.2f}x (spread {v['spread'][0]:.2f}-"
                           f"{v['spread'][1]:.2f}, {v['repeats']} repeats; goal {v['goal']}x: {v['verdict']})")
    if fast is not None and hf:
        ratio = fast / hf
        out["measured"]["fast_over_transformers"] = round(ratio, 2)
        llama = tok_s.get("llama_cpp")
        beats_llama = llama is None or fast > llama
        if llama is not None:
            out["measured"]["fast_over_llama_cpp"] = round(fast / llama, 2)
        out["verdict"] = "goal met" if ratio >= 2 and beats_llama else "goal missed"
        if setup.get("clock") == "cpu":
            timing = (f"times are CPU seconds of each system's process ({setup.get('threads')} thread), so the "
                      f"other jobs on the shared machine (load average {setup.get('load_average')}) count only "
                      "through what they do to a shared core's caches and execution units")
        else:
            timing = (f"{setup.get('threads')} threads, wall clock; the machine may have been shared (load average "
                      f"{setup.get('load_average')}): the ratios, measured in one run, are the result")
        short = "" if ratio >= 2 else f", {2 - ratio:.2f}x short of the goal"
        vs_llama = ("llama.cpp was not in this run (not installed)" if llama is None else
                    f"{fast / llama:.2f}x llama.cpp's ({llama:.1f}) in the same run")
        out["why"] = (f"the fast engine made {ratio:.2f}x the useful tokens/s of transformers bf16 at its best "
                      f"batch size (goal 2x{short}) and {vs_llama}; {timing}. Where the time went: "
                      f"{where_time_went(systems)}")
    elif "median" in out.get("vs_vllm", {}):
        out["verdict"], out["why"] = vllm_verdict(out["vs_vllm"])
    else:
        out["verdict"], out["why"] = "not compared", "run fast and transformers_bf16 together to compare them"
    return out


def where_time_went(systems: dict[str, Any]) -> str:
    """Per engine, seconds in steps with prefill vs pure decode steps; transformers' TTFT and ITL."""
    parts = []
    for name, v in systems.items():
        ph = v.get("phases")
        if ph:
            parts.append(f"{name} {ph['prefill_s']:.1f} s in {ph['prefill_steps']} steps with prefill + "
                         f"{ph['decode_s']:.1f} s in {ph['decode_steps']} decode steps (ITL p50 "
                         f"{v['itl_ms']['p50']:.0f} ms)")
        elif name == "transformers_bf16":
            parts.append(f"transformers_bf16 (static batches of {v.get('batch_size')}) {v['seconds']:.1f} s: each "
                         "batch prefills its prompts left-padded to the longest, then takes one decode step per "
                         f"token of its longest output (ITL p50 {v['itl_ms']['p50']:.0f} ms); a batch also waits "
                         f"for the one before it (TTFT p50 {v['ttft_ms']['p50'] / 1000:.1f} s)")
        elif name == "llama_cpp":
            parts.append(f"llama_cpp (its C API, continuous batching of up to 32 sequences, on the Q4_1 GGUF itself) "
                         f"{v['seconds']:.1f} s (ITL p50 {v['itl_ms']['p50']:.0f} ms)")
    return "; ".join(parts)


def figure(result: dict[str, Any], path: Path) -> Path:
    """Bars of useful tok/s per system, and TTFT / ITL p50 and p99 per system."""
    plt = pyplot()

    m = result["measured"]
    names = list(m["useful_tok_s"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(names, [m["useful_tok_s"][n] for n in names], color="tab:blue")
    axes[0].set_title("useful output tokens/s (higher is better)")
    if "transformers_bf16" in m["useful_tok_s"]:
        axes[0].axhline(2 * m["useful_tok_s"]["transformers_bf16"], color="gray", ls="--",
                        label="goal: 2x transformers")
        axes[0].legend()
    for ax, key, title in ((axes[1], "ttft_ms", "TTFT (ms)"), (axes[2], "itl_ms", "inter-token latency (ms)")):
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [m[key][n]["p50"] for n in names], width=0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [m[key][n]["p99"] for n in names], width=0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=25)
    s = result["setup"]
    fig.suptitle(f"{s['workload'][:90]}; {s['threads']} threads; commit {s['commit']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


VLLM_GOAL = 1.2  # the article: Infire makes ~20% more tokens/s than the vLLM-based setup it replaced


def vs_vllm(measured: dict[str, Any], tok_s: dict[str, float], cpu: dict[str, float]) -> dict[str, Any]:
    """fast_bf16 over vllm_bf16: the median and spread of the per-repeat ratios (each from one alternation),
    the verdict against the article's +20% (clears it over the whole spread: met; straddles it: inconclusive),
    and CPU seconds per output token of our process against vLLM's process tree."""
    ratios = measured.get("fast_over_vllm_runs") or ([tok_s["fast_bf16"] / tok_s["vllm_bf16"]]
                                                     if "fast_bf16" in tok_s else [])
    if not ratios:
        return {"verdict": "not compared", "why": "run fast_bf16 and vllm_bf16 together to compare them"}
    from experiments.engine.stats import against, spread

    sp = spread(ratios)
    side = against(sp, VLLM_GOAL)
    verdict = {"clears": "goal met", "fails": "goal missed"}.get(
        side, f"inconclusive (spread {sp['min']:.2f}-{sp['max']:.2f})")
    out = {"median": sp["median"], "spread": [sp["min"], sp["max"]], "repeats": len(ratios),
           "goal": VLLM_GOAL, "verdict": verdict}
    if "fast_bf16" in cpu and "vllm_bf16" in cpu:
        out["cpu_s_per_token"] = {"fast_bf16": cpu["fast_bf16"], "vllm_bf16": cpu["vllm_bf16"]}
        out["cpu_over_vllm"] = round(cpu["fast_bf16"] / cpu["vllm_bf16"], 3)
    return out


def vllm_verdict(v: dict[str, Any]) -> tuple[str, str]:
    """The verdict and its reason for a run that compared the fast engine with vLLM only."""
    cpu = (f"; CPU seconds per output token {v['cpu_over_vllm']:.2f}x those of vLLM's process tree"
           if "cpu_over_vllm" in v else "")
    return (f"vs vLLM: {v['verdict']}",
            f"the fast engine made {v['median']:.2f}x vLLM's useful tokens/s (median of {v['repeats']} alternating "
            f"repeats, spread {v['spread'][0]:.2f}-{v['spread'][1]:.2f}; the article's goal {v['goal']}x){cpu}")
