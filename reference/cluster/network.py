"""Network paths between sites, restricted to the jurisdictions a request allows.

Links are undirected (RTT in ms, bandwidth in Gbit/s). A request's data may only cross sites in its
allowed jurisdictions, so paths are found by Dijkstra (on RTT) over the allowed sites only, plus
the request's own origin site (where the user already is). A site with no such path is simply
unreachable for that request: this is the routing half of the residency rule. Inside one site the
delay is zero and the bandwidth is the site's ``local_gbps``.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from reference.cluster.scenario import Scenario


@dataclass(frozen=True)
class Path:
    sites: tuple[str, ...]  # every site the data crosses, both ends included
    one_way_s: float  # propagation delay, half the summed RTT
    gbps: float  # the narrowest link's bandwidth

    def transfer_s(self, num_bytes: float) -> float:
        """Time to move ``num_bytes`` over this path: one-way delay plus serialisation."""
        return self.one_way_s + num_bytes * 8 / (self.gbps * 1e9)


class Network:
    """All the scenario's links; shortest paths inside an allowed set of jurisdictions, cached."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.jurisdiction = {name: s.jurisdiction for name, s in scenario.sites.items()}
        self.neighbours: dict[str, list[tuple[str, float, float]]] = {
            name: [] for name in scenario.sites
        }
        for link in scenario.links:
            self.neighbours[link.a].append((link.b, link.rtt_ms, link.gbps))
            self.neighbours[link.b].append((link.a, link.rtt_ms, link.gbps))
        self._cache: dict[tuple[str, tuple[str, ...], str | None], dict[str, Path]] = {}

    def paths_from(self, source: str, allowed: tuple[str, ...],
                   also: str | None = None) -> dict[str, Path]:
        """Shortest paths from ``source`` to every site reachable through allowed sites (and
        ``also``)."""
        key = (source, allowed, also)
        if key not in self._cache:
            self._cache[key] = self._dijkstra(source, set(allowed), also)
        return self._cache[key]

    def path(self, a: str, b: str, allowed: tuple[str, ...],
             also: str | None = None) -> Path | None:
        return self.paths_from(a, allowed, also).get(b)

    def _dijkstra(self, source: str, allowed: set[str], also: str | None) -> dict[str, Path]:
        def ok(site: str) -> bool:
            return site == also or self.jurisdiction[site] in allowed

        local = self.scenario.sites[source].local_gbps
        best: dict[str, Path] = {}
        heap: list[tuple[float, tuple[str, ...], float]] = [(0.0, (source,), local)]
        while heap:
            rtt, sites, gbps = heapq.heappop(heap)
            here = sites[-1]
            if here in best:
                continue
            best[here] = Path(sites, rtt / 2000, gbps)
            for nxt, link_rtt, link_gbps in self.neighbours[here]:
                if nxt not in best and ok(nxt):
                    narrowest = link_gbps if len(sites) == 1 else min(gbps, link_gbps)
                    heapq.heappush(heap, (rtt + link_rtt, (*sites, nxt), narrowest))
        return best
