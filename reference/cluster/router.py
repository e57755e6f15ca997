"""The router: residency first, then tiers (edge -> regional -> central) with spill, prefix
affinity, load.

For each request, in this order:

1. **Residency (hard filter).** Only replicas at sites whose jurisdiction the request allows,
reached
   by a network path through allowed sites only, are candidates; a disaggregated prefill replica is
   a candidate only if a decode replica for the same model is reachable from it inside the allowed
   jurisdictions too (so the request's KV never travels outside them). Nothing later can add a
   candidate back. No candidate alive: the request waits and is retried (``wait``); no candidate at
   all: it is refused with the reason.
2. **Tiers.** Candidates are tried tier by tier, edge first. A tier is skipped when it holds none of
   the request's acceptable models ("model absent") or when its best estimated wait is above the
   tier's spill threshold ("overloaded"); the central tier has no threshold unless set.
3. **Prefix affinity.** The deterministic keys of the prompt's first blocks (``reference.kv``) are
   looked up in a table of where each key was last sent; the replica holding the longest matching
   prefix wins if its wait is under the threshold (its prefix cache then skips that prefill).
4. **Load.** Otherwise the candidate with the smallest network round trip + estimated wait, where
   the wait is estimated from the prompt and decode tokens in flight on the replica. Per tier only
   the ``nearest`` candidates (by network delay from the origin) are considered, as a front door
   that knows its nearby sites would.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from reference.cluster.network import Network, Path
from reference.cluster.replica import Replica
from reference.cluster.scenario import TIERS, Scenario

AFFINITY_TABLE_SIZE = 200_000  # keys remembered (least recently used forgotten first)


@dataclass(frozen=True)
class RouteRequest:
    """What the router needs to know about a request."""

    origin: str
    allowed: tuple[str, ...]
    models: tuple[str, ...]  # acceptable models, preferred first
    prefix_keys: tuple[bytes, ...] = ()  # keys of the prompt's first full blocks


@dataclass(frozen=True)
class Decision:
    prefill: Replica | None  # the replica that takes the prompt (colocated or prefill role)
    decode: Replica | None  # where decoding runs (the same replica when colocated)
    path_in: Path | None  # origin -> prefill site
    kv_path: Path | None  # prefill site -> decode site (disaggregated only)
    reason: str
    wait: bool = False  # nowhere allowed is alive now: retry later
    refused: bool = False


class Router:
    def __init__(self, scenario: Scenario, replicas: list[Replica], network: Network,
                 nearest: int = 16) -> None:
        self.scenario, self.network = scenario, network
        self.entry = [r for r in replicas if r.role in ("colocated", "prefill")]
        self.decoders = [r for r in replicas if r.role == "decode"]
        self.affinity: OrderedDict[bytes, int] = OrderedDict()
        self.nearest = nearest
        self._candidates: dict[tuple, dict[str, list[Replica]]] = {}
        self._decoders: dict[tuple, list[Replica]] = {}

    def candidates(self, req: RouteRequest) -> dict[str, list[Replica]]:
        """Per tier, the replicas that pass the residency filter, nearest first (at most
        ``nearest``)."""
        key = (req.origin, req.allowed, req.models)
        if key not in self._candidates:
            paths = self.network.paths_from(req.origin, req.allowed, also=req.origin)
            ok = [
                r
                for r in self.entry
                if r.model in req.models and r.jurisdiction in req.allowed and r.site in paths
            ]
            ok.sort(key=lambda r: (paths[r.site].one_way_s, r.index))
            self._candidates[key] = {
                t: [r for r in ok if r.tier == t][: self.nearest] for t in TIERS
            }
        return self._candidates[key]

    def route(self, req: RouteRequest, now: float = 0.0) -> Decision:
        """Where ``req`` goes, with the replicas' load as it is at simulated time ``now``."""
        paths = self.network.paths_from(req.origin, req.allowed, also=req.origin)
        rank = {m: i for i, m in enumerate(req.models)}
        by_tier = self.candidates(req)
        if not any(by_tier.values()):
            return Decision(None, None, None, None, refused=True,
                            reason=f"refused: no replica of {list(req.models)} in allowed "
                                   "jurisdictions "
                                   f"{list(req.allowed)} reachable from {req.origin}")
        notes: list[str] = []
        live_all: list[tuple] = []
        for tier in TIERS:
            live = []
            for r in by_tier[tier]:
                if r.alive:
                    partner = (
                        (r, None) if r.role == "colocated" else self._decoder(r, req.allowed, now)
                    )
                    if partner is not None:
                        live.append((r, *partner))
            if not live:
                notes.append(f"{tier}: model absent" if not by_tier[tier] else f"{tier}: no live "
                                                                               "replica")
                continue
            live_all += live
            limit = self.scenario.spill_wait_ms.get(tier, math.inf) / 1000
            choice = self._affine(live, req, limit, now)
            if choice is not None:
                return self._decide(choice, paths, req, f"{tier}: prefix affinity", notes)
            best = min(live, key=lambda c: (rank[c[0].model],
                                            2 * paths[c[0].site].one_way_s + c[0].est_wait_s(now),
                                            c[0].index))
            wait = best[0].est_wait_s(now)
            if wait <= limit:
                return self._decide(best, paths, req, f"{tier}: least loaded (est wait "
                                                      f"{wait * 1000:.0f} ms)", notes)
            notes.append(f"{tier}: overloaded (est wait {wait * 1000:.0f} ms)")
        if not live_all:
            return Decision(None, None, None, None, wait=True,
                            reason="wait: no live replica (with a live decode partner) in "
                                   f"{list(req.allowed)}")
        best = min(live_all, key=lambda c: (2 * paths[c[0].site].one_way_s + c[0].est_wait_s(now),
                                            c[0].index))
        wait = best[0].est_wait_s(now)
        if wait > self.scenario.max_wait_s:
            return Decision(None, None, None, None, refused=True,
                            reason=f"refused: overloaded; best estimated wait {wait:.1f} s > "
                                   "max_wait_s "
                                   f"{self.scenario.max_wait_s} s in {list(req.allowed)}")
        return self._decide(best, paths, req, "all tiers over threshold: least loaded overall",
                            notes)

    def _decoder(self, prefill: Replica, allowed: tuple[str, ...],
                 now: float) -> tuple[Replica, Path] | None:
        """The best live decode replica for ``prefill``'s model reachable inside ``allowed``."""
        key = (prefill.site, prefill.model, allowed)
        paths = self.network.paths_from(prefill.site, allowed)
        if key not in self._decoders:
            ok = [d for d in self.decoders if d.model == prefill.model and d.jurisdiction in allowed
                  and d.site in paths]
            ok.sort(key=lambda d: (paths[d.site].one_way_s, d.index))
            self._decoders[key] = ok[:self.nearest]
        best = None
        for d in self._decoders[key]:
            if d.alive:
                rank = (paths[d.site].one_way_s + d.est_wait_s(now), d.index)
                if best is None or rank < best[0]:
                    best = (rank, d, paths[d.site])
        return None if best is None else (best[1], best[2])

    def _affine(self, cands: list[tuple], req: RouteRequest, limit: float,
                now: float) -> tuple | None:
        if not self.scenario.prefix_affinity:
            return None
        by_index = {c[0].index: c for c in cands}
        for key in reversed(req.prefix_keys):
            index = self.affinity.get(key)
            if (
                index is not None
                and index in by_index
                and by_index[index][0].est_wait_s(now) <= limit
            ):
                return by_index[index]
        return None

    def _decide(self, choice: tuple, paths: dict[str, Path], req: RouteRequest, reason: str,
                notes: list[str]) -> Decision:
        prefill, decode, kv_path = choice
        for key in req.prefix_keys:
            self.affinity[key] = prefill.index
            self.affinity.move_to_end(key)
        while len(self.affinity) > AFFINITY_TABLE_SIZE:
            self.affinity.popitem(last=False)
        full = "; ".join([*notes, reason])
        return Decision(prefill, decode or prefill, paths[prefill.site], kv_path, reason=full)
