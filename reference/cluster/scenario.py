"""A cluster scenario: sites, GPUs, links, models, replicas and traffic, read from TOML or JSON.

The file format is documented in ``reference/cluster/README.md`` with a worked example in
``examples/``. Nothing read from the file is trusted: every missing, mistyped or inconsistent field
raises ``ScenarioError`` naming the field (``sites[2].replicas[0].gpus: ...``), before anything
runs.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference import jsonsafe
from reference.cluster.fields import ScenarioError, as_list, as_table, build, check_positive

TIERS = ("edge", "regional", "central")  # routing order: nearest and smallest first
ROLES = ("colocated", "prefill", "decode")
# Upper bounds on what a scenario may ask for, so that a typo cannot make the simulator run forever
# or
# allocate without end (a rate of 1e30 requests/s, a prompt of 10**12 tokens, ...).
MAX_REQUESTS = 100_000_000  # sum over traffic classes of rate_per_s x duration_s
MAX_TOKENS = 1_000_000  # any one prompt / output / system prompt / step budget
MAX_SEQS = 100_000  # max_num_seqs
MAX_REPLICAS = 100_000  # replicas in the whole scenario
MAX_WORKERS = 64  # server processes one site of a real fleet may ask for
MAX_STAGES = 16  # stages of a pipelined site's servers


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_gb: float
    peak_tflops: float  # dense bf16 peak
    bandwidth_tbps: float  # HBM bytes/s, in TB/s
    mfu: float = 0.7  # share of peak FLOP/s a compute-bound step reaches
    mbu: float = 0.8  # share of peak bandwidth a memory-bound step reaches
    step_overhead_ms: float = 1.0  # launch and scheduling time of every step


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    bytes_per_param: float = 2.0
    kv_bytes: float = 2.0  # per K/V element
    sites: tuple[str, ...] = ("*",)  # sites that may hold this model ("*": any)

    def may_live_at(self, site: str) -> bool:
        return "*" in self.sites or site in self.sites


@dataclass(frozen=True)
class ReplicaSpec:
    model: str
    gpu: str
    gpus: int = 1  # GPUs per replica (tensor parallel)
    count: int = 1
    role: str = "colocated"


@dataclass(frozen=True)
class Site:
    name: str
    tier: str
    jurisdiction: str
    gpus: dict[str, int]  # GPU type -> count
    replicas: tuple[ReplicaSpec, ...] = ()
    local_gbps: float = 400.0  # bandwidth between replicas inside the site (KV transfer)
    # what a real run (``python -m serve fleet``) needs; the simulator ignores these
    # the packaged model its servers run: "tiny", "smollm2" or a checkpoint path
    serve_model: str = "tiny"
    workers: int = 0  # server processes for the site (0: one per replica of ``replicas``)
    # host:port of servers already running elsewhere (then none is started)
    address: tuple[str, ...] = ()
    # each server a pipeline: a stage per GPU type named, in order
    pipeline: tuple[str, ...] = ()
    # scaling with load (``--ray``: serve/fleet/ray_sites.py): between min and max servers, one more
    # when the
    # requests in flight per server pass target_ongoing_requests; 0: no scaling (without --ray: max
    # servers)
    min_workers: int = 0
    max_workers: int = 0
    target_ongoing_requests: float = 2.0


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    rtt_ms: float
    gbps: float


@dataclass(frozen=True)
class Traffic:
    name: str
    origins: tuple[str, ...]
    rate_per_s: float
    models: tuple[str, ...]  # acceptable models, preferred first
    allowed: tuple[str, ...]  # jurisdictions where its data may be processed or stored
    plan: str = "free"
    arrival: str = "poisson"  # or "uniform" (evenly spaced)
    # "sharegpt": (prompt, answer) token counts of ShareGPT; "fixed": the two below
    lengths: str = "sharegpt"
    prompt_tokens: int = 256
    output_tokens: int = 64
    max_prompt: int = 1024
    max_output: int = 256
    output_scale: float = 1.0  # ShareGPT answer length multiplier
    # user <-> origin site round trip (last mile), added to every latency
    access_rtt_ms: float = 0.0
    system_prompts: int = 0  # size of the pool of shared system prompts (0: none)
    system_prompt_tokens: int = 0


@dataclass(frozen=True)
class Failure:
    site: str
    at_s: float
    duration_s: float


@dataclass(frozen=True)
class Scenario:
    gpu_types: dict[str, GpuType]
    models: dict[str, ModelSpec]
    sites: dict[str, Site]
    links: tuple[Link, ...]
    traffic: tuple[Traffic, ...]
    failures: tuple[Failure, ...] = ()
    duration_s: float = 10.0
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    policy: str = "fcfs"
    spill_wait_ms: dict[str, float] = field(
        default_factory=lambda: {"edge": 50.0, "regional": 100.0}
    )
    max_wait_s: float = 30.0  # a request whose best estimated wait is longer is refused
    prefix_affinity: bool = True
    kv_fraction: float = 0.9  # share of replica memory for weights + KV


def load_scenario(path: str | Path) -> Scenario:
    """Read a ``.toml`` or ``.json`` scenario file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read scenario: {e.strerror}") from None
    try:
        data = jsonsafe.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode("utf-8"))
    except (jsonsafe.JsonError, tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ScenarioError(
            f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}"
        ) from None
    try:
        return scenario_from_dict(data)
    except ScenarioError as e:
        raise ScenarioError(f"{path}: {e}") from None


def scenario_from_dict(data: dict[str, Any]) -> Scenario:
    """Build and check a Scenario from plain data (the parsed file)."""
    if not isinstance(data, dict):
        raise ScenarioError("a scenario must be a table/object at the top level")
    sim = as_table(data.get("simulation", {}), "simulation")
    gpu_types = {g.name: g for g in (build(GpuType, t, f"gpu_types[{i}]")
                                     for i, t in enumerate(as_list(data, "gpu_types")))}
    models = {}
    for i, t in enumerate(as_list(data, "models")):
        t = dict(as_table(t, f"models[{i}]"))
        t["sites"] = tuple(as_list(t, "sites", f"models[{i}].", required=False, default=["*"]))
        models[t.get("name")] = build(ModelSpec, t, f"models[{i}]")
    sites = {}
    for i, t in enumerate(as_list(data, "sites")):
        t = dict(as_table(t, f"sites[{i}]"))
        t["replicas"] = tuple(
            build(ReplicaSpec, r, f"sites[{i}].replicas[{k}]")
            for k, r in enumerate(as_list(t, "replicas", f"sites[{i}].", required=False))
        )
        t["address"] = tuple(as_list(t, "address", f"sites[{i}].", required=False))
        t["pipeline"] = tuple(as_list(t, "pipeline", f"sites[{i}].", required=False))
        sites[t.get("name")] = build(Site, t, f"sites[{i}]")
    links = tuple(
        build(Link, t, f"links[{i}]") for i, t in enumerate(as_list(data, "links", required=False))
    )
    traffic = []
    for i, t in enumerate(as_list(data, "traffic")):
        t = dict(as_table(t, f"traffic[{i}]"))
        for key in ("origins", "models", "allowed"):
            t[key] = tuple(as_list(t, key, f"traffic[{i}]."))
        traffic.append(build(Traffic, t, f"traffic[{i}]"))
    failures = tuple(build(Failure, t, f"failures[{i}]")
                     for i, t in enumerate(as_list(data, "failures", required=False)))
    routing = as_table(data.get("routing", {}), "routing")
    scenario = build(Scenario, {**sim, **routing, "gpu_types": gpu_types, "models": models,
                                "sites": sites,
                                "links": links, "traffic": tuple(traffic), "failures": failures},
                     "simulation")
    check(scenario)
    return scenario


def check(s: Scenario) -> None:
    """Consistency across tables: names resolve, counts fit, numbers are in range."""
    for g in s.gpu_types.values():
        check_positive(f"gpu_types[{g.name}]", memory_gb=g.memory_gb, peak_tflops=g.peak_tflops,
                  bandwidth_tbps=g.bandwidth_tbps, mfu=g.mfu, mbu=g.mbu)
        if g.mfu > 1 or g.mbu > 1:
            raise ScenarioError(f"gpu_types[{g.name}]: mfu and mbu are shares of peak, at most 1")
    for m in s.models.values():
        check_positive(f"models[{m.name}]", layers=m.layers, hidden=m.hidden,
                       intermediate=m.intermediate,
                       heads=m.heads, kv_heads=m.kv_heads, head_dim=m.head_dim, vocab=m.vocab,
                       bytes_per_param=m.bytes_per_param)
        if m.heads % m.kv_heads or m.head_dim % 2 or max(m.layers, m.hidden, m.intermediate,
                                                         m.vocab) > MAX_TOKENS:
            raise ScenarioError(f"models[{m.name}]: heads must be a multiple of kv_heads, head_dim "
                                "even, and "
                                f"layers/hidden/intermediate/vocab at most {MAX_TOKENS:,}")
    for site in s.sites.values():
        where = f"sites[{site.name}]"
        if site.tier not in TIERS:
            raise ScenarioError(f"{where}.tier: {site.tier!r} is not one of {TIERS}")
        for gpu, n in site.gpus.items():
            if gpu not in s.gpu_types or isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ScenarioError(f"{where}.gpus: {gpu!r} = {n!r}; need a known GPU type and a "
                                    "count >= 0")
        _check_serving(site, where)
        if site.pipeline and not 2 <= len(site.pipeline) <= MAX_STAGES:
            raise ScenarioError(f"{where}.pipeline: {len(site.pipeline)} stages; a pipeline has 2 "
                                f"to {MAX_STAGES}")
        for gpu in site.pipeline:
            if not isinstance(gpu, str) or site.gpus.get(gpu, 0) < 1:
                raise ScenarioError(f"{where}.pipeline: stage {gpu!r} is not a GPU type of the "
                                    f"site's gpus ({sorted(site.gpus)})")
        used: dict[str, int] = {}
        for r in site.replicas:
            if r.model not in s.models:
                raise ScenarioError(f"{where}.replicas: unknown model {r.model!r}; known: "
                                    f"{sorted(s.models)}")
            if not s.models[r.model].may_live_at(site.name):
                raise ScenarioError(f"{where}.replicas: model {r.model!r} may not be held at this "
                                    "site "
                                    f"(its sites: {list(s.models[r.model].sites)})")
            if r.gpu not in s.gpu_types:
                raise ScenarioError(f"{where}.replicas: unknown GPU type {r.gpu!r}; known: "
                                    f"{sorted(s.gpu_types)}")
            if r.role not in ROLES:
                raise ScenarioError(f"{where}.replicas: role {r.role!r} is not one of {ROLES}")
            check_positive(f"{where}.replicas", gpus=r.gpus, count=r.count)
            used[r.gpu] = used.get(r.gpu, 0) + r.gpus * r.count
        for gpu, n in used.items():
            if n > site.gpus.get(gpu, 0):
                raise ScenarioError(f"{where}: replicas use {n} {gpu} GPUs, the site has "
                                    f"{site.gpus.get(gpu, 0)}")
    for k, link in enumerate(s.links):
        for end in (link.a, link.b):
            if end not in s.sites:
                raise ScenarioError(f"links[{k}]: unknown site {end!r}")
        if not (link.rtt_ms >= 0 and link.gbps > 0):
            raise ScenarioError(f"links[{k}]: rtt_ms must be >= 0 and gbps > 0")
    for t in s.traffic:
        where = f"traffic[{t.name}]"
        for o in t.origins:
            if o not in s.sites:
                raise ScenarioError(f"{where}.origins: unknown site {o!r}")
        for m in t.models:
            if m not in s.models:
                raise ScenarioError(f"{where}.models: unknown model {m!r}")
        if not t.origins or not t.models or not t.allowed:
            raise ScenarioError(f"{where}: origins, models and allowed must each name at least one "
                                "entry")
        if t.lengths not in ("sharegpt", "fixed"):
            raise ScenarioError(f"{where}.lengths: {t.lengths!r} is not 'sharegpt' or 'fixed'")
        if t.arrival not in ("poisson", "uniform"):
            raise ScenarioError(f"{where}.arrival: {t.arrival!r} is not 'poisson' or 'uniform'")
        check_positive(where, rate_per_s=t.rate_per_s, max_prompt=t.max_prompt,
                       max_output=t.max_output,
                       output_scale=t.output_scale, prompt_tokens=t.prompt_tokens,
                       output_tokens=t.output_tokens)
        if t.system_prompts < 0 or t.system_prompt_tokens < 0 or t.access_rtt_ms < 0:
            raise ScenarioError(f"{where}: system_prompts, system_prompt_tokens and access_rtt_ms "
                                "must be >= 0")
    for tier, ms in s.spill_wait_ms.items() if isinstance(s.spill_wait_ms, dict) else [("?", None)]:
        if (
            tier not in TIERS
            or isinstance(ms, bool)
            or not isinstance(ms, int | float)
            or not ms >= 0
        ):
            raise ScenarioError(f"routing.spill_wait_ms: {tier} = {ms!r}; need a table of tier = "
                                "milliseconds >= 0 "
                                f"with tiers from {TIERS}")
    if not isinstance(s.prefix_affinity, bool):
        raise ScenarioError("routing.prefix_affinity: expected true or false, got "
                            f"{s.prefix_affinity!r}")
    for f in s.failures:
        if f.site not in s.sites or not (f.at_s >= 0 and f.duration_s > 0):
            raise ScenarioError(f"failures: site {f.site!r} unknown, or at_s < 0, or duration_s <= "
                                "0")
    _check_limits(s)
    check_positive("simulation", duration_s=s.duration_s, block_size=s.block_size,
                   max_wait_s=s.max_wait_s,
              max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs)


def _check_serving(site: Site, where: str) -> None:
    """The fields only a real run reads: a model to serve, a worker count, well-formed addresses."""
    if not site.serve_model.strip():
        raise ScenarioError(f"{where}.serve_model: must name a model (tiny, smollm2 or a "
                            "checkpoint path)")
    if site.workers < 0 or site.workers > MAX_WORKERS:
        raise ScenarioError(f"{where}.workers: {site.workers} is not in 0..{MAX_WORKERS}")
    if site.address and site.workers and site.workers != len(site.address):
        raise ScenarioError(f"{where}.workers: {site.workers} workers but {len(site.address)} "
                            "addresses")
    if site.max_workers or site.min_workers:
        if not 1 <= site.min_workers <= site.max_workers <= MAX_WORKERS:
            raise ScenarioError(f"{where}.min_workers, max_workers: {site.min_workers}, "
                                f"{site.max_workers}: "
                                f"scaling needs 1 <= min_workers <= max_workers <= {MAX_WORKERS}")
        if site.address or site.workers:
            raise ScenarioError(f"{where}.max_workers: a scaled site has no fixed workers or "
                                "address")
        if any(r.role != "colocated" for r in site.replicas):
            raise ScenarioError(f"{where}.max_workers: only a colocated site scales (this one has "
                                "prefill/decode)")
        if not site.target_ongoing_requests > 0:
            raise ScenarioError(f"{where}.target_ongoing_requests: must be > 0")
    for a in site.address:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ScenarioError(f"{where}.address: {a!r} is not host:port")


def _check_limits(s: Scenario) -> None:
    expected = sum(t.rate_per_s for t in s.traffic) * s.duration_s
    if expected > MAX_REQUESTS:
        raise ScenarioError(f"traffic: rate_per_s x duration_s asks for ~{expected:.3g} requests; "
                            f"at most {MAX_REQUESTS:,}")
    for t in s.traffic:
        for name in ("max_prompt", "max_output", "prompt_tokens", "output_tokens",
                     "system_prompt_tokens"):
            if getattr(t, name) > MAX_TOKENS:
                raise ScenarioError(f"traffic[{t.name}].{name}: {getattr(t, name)} is more than "
                                    f"{MAX_TOKENS:,} tokens")
        if t.system_prompts > MAX_SEQS:
            raise ScenarioError(f"traffic[{t.name}].system_prompts: at most {MAX_SEQS:,}")
    if (
        s.max_num_batched_tokens > MAX_TOKENS
        or s.block_size > MAX_TOKENS
        or s.max_num_seqs > MAX_SEQS
    ):
        raise ScenarioError("simulation: max_num_batched_tokens and block_size must be <= "
                            f"{MAX_TOKENS:,}, "
                            f"max_num_seqs <= {MAX_SEQS:,}")
    replicas = sum(r.count for site in s.sites.values() for r in site.replicas)
    if replicas > MAX_REPLICAS:
        raise ScenarioError(f"sites: {replicas:,} replicas in all; at most {MAX_REPLICAS:,}")
