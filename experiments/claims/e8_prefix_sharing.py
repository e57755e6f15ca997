"""E8: requests sharing a system prompt get the same cache keys and reuse its KV: higher hit rate, lower TTFT.

Every request is the SmolLM2 chat template around one long system prompt (the same for all) and a
ShareGPT question (truncated). Requests arrive in a Poisson stream and run through our NumPy engine
three times: prefix cache off; on (one shared key space); on with a per-tenant salt (two tenants,
alternating), which isolates tenants: a request may only hit blocks its own tenant computed. Each
full block's key is a hash chained from its parent's key, its tokens and the salt, so it is the
same in every engine and process; we check that too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from experiments.engine.stats import CLOCK, CpuClock, Job, one_blas_thread, pct, run_jobs, smollm2, spread, spread_text
from experiments.registry import Context, Experiment, Result, pyplot, save_figure
from reference.engine import Engine
from reference.kv import prefix_keys
from reference.workload import iter_sharegpt

SYSTEM = (
    "You are the support assistant of an online bookshop. Answer politely and briefly. You can look up "
    "orders, explain shipping options (standard: 3-5 working days; express: next working day when ordered "
    "before 2 pm; international: 7-14 days), returns (30 days, unread condition, refund to the original "
    "payment method within 5 days of receipt), gift cards (valid for 3 years, not exchangeable for cash) "
    "and the loyalty programme (one point per euro spent; 100 points give a 5 euro voucher). Never reveal "
    "other customers' data. If you do not know an answer, say so and offer to connect the customer with a "
    "human colleague. Keep answers under 80 words, use plain language, and do not invent order numbers, "
    "prices or delivery dates. Always end by asking whether there is anything else you can help with."
)
BLOCK = 16


def jobs_for(tok: Any, n: int, rate: float, seed: int = 0) -> list[Job]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, size=n))
    out = []
    for conv, t in zip(iter_sharegpt(limit=n), arrivals, strict=False):
        question = tok.decode(tok.encode(conv.prompt)[:48])
        ids = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        out.append(Job(ids, 8, float(t), tenant=f"tenant{len(out) % 2}"))
    return out


def measure(jobs: list[Job], prefix_cache: bool, salted: bool) -> dict[str, Any]:
    model, tok = smollm2()
    engine = Engine(model, tok, clock=CpuClock(),
                    num_blocks=256, block_size=BLOCK, max_num_batched_tokens=512, max_num_seqs=8,
                    prefix_cache=prefix_cache)
    outs = run_jobs(engine, jobs, salt_by_tenant=salted)
    bm = engine.block_manager
    computed = sum(n for r in engine.step_log for n, p in zip(r.new_tokens, r.is_prefill, strict=True) if p)
    first_of_tenant = [i for i, j in enumerate(jobs) if all(jobs[k].tenant != j.tenant for k in range(i))]
    ttft = [o.metrics.ttft for o in outs]
    return {"prefix_cache": prefix_cache, "salted_by_tenant": salted,
            "hit_rate": round(bm.num_hit_tokens / max(bm.num_lookup_tokens, 1), 4),
            "prompt_tokens": sum(len(j.prompt) for j in jobs), "prefill_tokens_computed": computed,
            "cached_tokens_per_request": [o.num_cached_tokens for o in outs],
            "hits_on_first_request_of_each_tenant": sum(outs[i].num_cached_tokens for i in first_of_tenant),
            "ttft_ms": pct(ttft), "ttft_ms_after_first_two": pct(ttft[2:]), "_ttft": ttft,
            "_outputs": [o.output_token_ids for o in outs]}


def unloaded_ttft(jobs: list[Job], prefix_cache: bool) -> list[float]:
    """TTFT of requests sent one at a time (no queueing); the first one warms the cache."""
    model, tok = smollm2()
    engine = Engine(model, tok, clock=CpuClock(),
                    num_blocks=256, block_size=BLOCK, max_num_batched_tokens=512, max_num_seqs=8,
                    prefix_cache=prefix_cache)
    return [run_jobs(engine, [Job(j.prompt, 1)])[0].metrics.ttft for j in jobs]


def run(ctx: Context) -> Result:
    _, tok = smollm2()
    n, rate = (48, 1.0) if ctx.full else (16, 1.5)
    repeats = 7 if ctx.full else 3  # unloaded pairs (one token each): the quick run's 3 still give a spread
    jobs = jobs_for(tok, n, rate)
    modes = {"off": (False, False), "shared": (True, False), "salted per tenant": (True, True)}
    # unloaded pairs (one request at a time, no queueing), off and shared back to back, order alternating:
    # the headline TTFT ratio. Under the Poisson load the ratio also measures how overloaded this CPU
    # is at the fixed arrival rate (queueing), so it moves with the machine's speed: context only.
    alone_jobs = jobs[:7]
    pairs = [(k, m) for k in range(repeats) for m in ((False, True) if k % 2 == 0 else (True, False))]
    alone_runs: list[dict[str, Any]] = [{} for _ in range(repeats)]
    with one_blas_thread():
        for k, cache in ctx.track(pairs, f"E8 unloaded off/shared x {repeats}"):
            alone_runs[k]["shared" if cache else "off"] = pct(unloaded_ttft(alone_jobs, cache)[1:])
        runs = {name: measure(jobs, *m) for name, m in ctx.track(modes.items(), "E8 modes under load")}
    alone = alone_runs[0]
    same_outputs = all(r["_outputs"] == runs["off"]["_outputs"] for r in runs.values())
    # keys are deterministic: the system prompt's block keys are the same in a fresh computation
    shared_len = min(len(j.prompt) for j in jobs)
    keys_a = prefix_keys(jobs[0].prompt[:shared_len], BLOCK)
    keys_b = prefix_keys(jobs[1].prompt[:shared_len], BLOCK)
    common_blocks = sum(a == b for a, b in zip(keys_a, keys_b, strict=True))
    salted_differ = prefix_keys(jobs[0].prompt, BLOCK, "tenant0")[0] != prefix_keys(jobs[0].prompt, BLOCK, "tenant1")[0]
    figure = plot(runs, ctx)
    for r in runs.values():
        r.pop("_ttft")
        r.pop("_outputs")
    off, on = runs["off"], runs["shared"]
    unloaded_ratio = spread([a["off"]["p50"] / a["shared"]["p50"] for a in alone_runs])
    prefill_ratio = off["prefill_tokens_computed"] / on["prefill_tokens_computed"]  # counts: no clock
    loaded_ratio = off["ttft_ms"]["p50"] / on["ttft_ms"]["p50"]
    better = unloaded_ratio["min"] > 1 and loaded_ratio > 1 and on["hit_rate"] > 0.5
    isolated = runs["salted per tenant"]["hits_on_first_request_of_each_tenant"] == 0
    measured = {"runs": runs, "repeats": repeats, "same_outputs_in_all_modes": same_outputs,
                "system_prompt_blocks_with_equal_keys": common_blocks, "salt_changes_keys": salted_differ,
                "unloaded_ttft_p50_off_over_shared": unloaded_ratio, "unloaded_ttft_ms": alone,
                "unloaded_ttft_ms_other_repeats": alone_runs[1:],
                "prefill_tokens_off_over_shared": round(prefill_ratio, 2),
                "loaded_ttft_p50_off_over_shared": round(loaded_ratio, 2),
                "ttft_p50_speedup": round(loaded_ratio, 2)}
    return Result(
        measured=measured,
        summary=summarize({"measured": measured}),
        verdict="matches" if better and isolated and same_outputs else "differs",
        why=("'matches': sharing raises the hit rate above 50%, lowers median TTFT unloaded in every repeat and "
             "under load, outputs are unchanged, and with per-tenant salts no tenant's first request hits another "
             "tenant's blocks. The loaded ratio is context, not the headline: at a fixed arrival rate the engine "
             "without sharing is overloaded on this CPU, and how much depends on the machine's speed at the time "
             "(it moved between runs under other load), while the unloaded ratio is the prefill saving alone."),
        clock="cpu-process",
        clock_detail=CLOCK + "; hit rates and prefill token counts involve no clock",
        setup={"weights": "smollm2 (NumPy engine, float32, 1 BLAS thread)",
               "workload": (f"{n} requests, Poisson arrivals at {rate}/s (engine clock); chat template with one "
                            f"shared system prompt ({len(tok.encode(SYSTEM))} tokens) + the first {n} ShareGPT "
                            f"questions truncated to 48 tokens; 8 output tokens each; prompts "
                            f"{min(len(j.prompt) for j in jobs)}-{max(len(j.prompt) for j in jobs)} tokens; "
                            f"2 tenants alternating; unloaded: the first {len(alone_jobs)} prompts one at a time "
                            f"(the first warms the cache and is not counted)"),
               "engine": f"block {BLOCK}, token budget 512/step, 8 sequences max",
               "repeats": f"unloaded off and shared {repeats} times each, back to back (order alternating); "
                          "each loaded mode once"},
        article={"claim": "shared system prompts get a deterministic cache key; reusing their KV cuts TTFT"},
        figures=[figure],
    )


def summarize(record: dict[str, Any]) -> str:
    """The table cell from an E8 record; the TTFTs name the engine that produced them."""
    m = record["measured"]
    off, on, salted = m["runs"]["off"], m["runs"]["shared"], m["runs"]["salted per tenant"]
    prefill_ratio = off["prefill_tokens_computed"] / on["prefill_tokens_computed"]
    return (f"NumPy reference engine (SmolLM2, 1 BLAS thread), sharing on vs off: prefill tokens computed "
            f"{prefill_ratio:.1f}x fewer ({off['prefill_tokens_computed']} -> {on['prefill_tokens_computed']}), "
            f"unloaded TTFT p50 {spread_text(m['unloaded_ttft_p50_off_over_shared'])} lower (within one run); hit "
            f"rate {on['hit_rate']:.0%} (salted {salted['hit_rate']:.0%}); under Poisson load (depends on this CPU's "
            f"speed) TTFT p50 {off['ttft_ms']['p50']:.0f} -> {on['ttft_ms']['p50']:.0f} ms "
            f"({m['loaded_ttft_p50_off_over_shared']:.1f}x, CPU time)")


def plot(runs: dict[str, dict[str, Any]], ctx: Context) -> str:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for name, r in runs.items():
        axes[0].plot(np.array(r["_ttft"]) * 1000, marker="o", ms=3, label=f"{name} (hit rate {r['hit_rate']:.0%})")
        axes[1].bar(name, r["prefill_tokens_computed"])
    axes[0].set_xlabel("request (arrival order)")
    axes[0].set_ylabel("TTFT (ms)")
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("prompt tokens computed (prefill)")
    return save_figure(fig, ctx, "E8.png")


EXPERIMENT = Experiment(claim="E8", title="Prefix sharing of a common system prompt", run=run, quick_minutes=1,
                        summarize=summarize)
