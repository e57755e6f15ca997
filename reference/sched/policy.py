"""Scheduling policies: who is admitted next, and who is preempted first.

A policy gives every request a sort key, ``key(seq, now)``: the waiting request with the smallest
key is admitted first, and when blocks run out the running request with the largest key is preempted
first. Keys end with ``(arrival_time, seq_id)`` so that every decision is deterministic.

* ``FCFS``: by arrival time.
* ``SJF``: by predicted remaining work (prompt tokens still to compute + predicted output tokens
  still to generate), minus ``aging`` tokens per second of waiting, so a long request's key keeps
  falling until it is served: nothing starves.
* ``WFQ``: weighted fair queuing across tenants, virtual-token-counter style. Each tenant has a
  counter that grows by ``tokens computed / weight`` whenever the scheduler computes tokens for it;
  the tenant with the smallest counter goes first, and inside a tenant the ``within`` policy orders
  its requests (FCFS, or SJF: ``sjf_wfq``). A tenant that becomes active (its first live request
  after being idle) has its counter lifted to the smallest counter of the active tenants, so idle
  time cannot be banked as credit.
* ``Static``: the static-batching baseline: admits a batch only when nothing is running, then no new
  admissions until the whole batch has finished.

Fairness bound of WFQ (``wfq_fairness_bound`` below; tests/test_sched_fairness.py asserts exactly
it): with tenants backlogged from the start, admission always picks the tenant with the smallest
counter, and after its last admission a tenant's counter can grow only by the remaining work of its
running requests, at most ``max_num_seqs * L_max / w`` (L_max = the largest prompt + max_tokens),
plus what one step charges, at most ``max_num_batched_tokens / w``. So at any time, for any two
backlogged tenants a and b,
``|S_a / w_a - S_b / w_b| <= (max_num_seqs * L_max + max_num_batched_tokens) / w_min`` where S is
the number of tokens computed for the tenant (without preemptions, which recompute tokens).
"""

from __future__ import annotations

from collections import Counter
from operator import attrgetter

from reference.sched.errors import ConfigError
from reference.sched.sequence import Sequence
from reference.sched.tenants import Tenants


class Policy:
    """Base policy (FCFS order); subclasses override ``key`` and the hooks they need."""

    name = "fcfs"
    admit_while_running = True  # False: static batching

    def key(self, seq: Sequence, now: float) -> tuple:
        """Sort key: smaller is admitted first; the largest running one is preempted first."""
        return (seq.arrival_time, seq.seq_id)

    def pick(self, waiting: list[Sequence], now: float) -> Sequence:
        """The waiting request to admit next: the one with the smallest key."""
        return min(waiting, key=lambda s: self.key(s, now))

    def on_add(self, seq: Sequence) -> None:
        """A request entered the system."""

    def on_schedule(self, seq: Sequence, num_tokens: int) -> None:
        """``num_tokens`` of ``seq`` are computed in this step."""

    def on_finish(self, seq: Sequence) -> None:
        """A request left the system (finished or aborted)."""


class FCFS(Policy):
    """First come, first served."""

    def pick(self, waiting: list[Sequence], now: float) -> Sequence:
        """The smallest key, ``(arrival_time, seq_id)``, read by ``attrgetter``: the same choice as
        the base class at a fraction of the cost (a scheduler with a long queue picks once per
        step)."""
        if type(self).key is not FCFS.key:  # a subclass with its own key: the general pick
            return super().pick(waiting, now)
        return min(waiting, key=_BY_ARRIVAL)


_BY_ARRIVAL = attrgetter("arrival_time", "seq_id")  # FCFS.key without ``now``


class SJF(Policy):
    """Shortest (predicted) job first, with aging in tokens per second of waiting."""

    name = "sjf"

    def __init__(self, aging: float = 0.0) -> None:
        if not aging >= 0:
            raise ConfigError(f"aging must be >= 0 tokens per second, got {aging!r}")
        self.aging = aging

    def key(self, seq: Sequence, now: float) -> tuple:
        waited = max(0.0, now - seq.arrival_time)
        return (seq.predicted_remaining_work() - self.aging * waited, seq.arrival_time, seq.seq_id)


class WFQ(Policy):
    """Weighted fair queuing across tenants (virtual token counters), ``within`` inside a tenant."""

    name = "wfq"

    def __init__(self, tenants: Tenants, within: Policy | None = None) -> None:
        self.tenants = tenants
        self.within = within or FCFS()
        self.name = "wfq" if isinstance(self.within, FCFS) else f"{self.within.name}+wfq"
        self.counters: dict[str, float] = {}  # tenant -> virtual tokens received (tokens / weight)
        self.num_live: Counter[str] = Counter()  # tenant -> live (waiting or running) requests

    def key(self, seq: Sequence, now: float) -> tuple:
        return (self.counters[seq.tenant], *self.within.key(seq, now))

    def pick(self, waiting: list[Sequence], now: float) -> Sequence:
        """Same as the smallest key, faster: only the least-served tenants' requests are
        compared."""
        lowest = min(self.counters[s.tenant] for s in waiting)
        return self.within.pick([s for s in waiting if self.counters[s.tenant] == lowest], now)

    def on_add(self, seq: Sequence) -> None:
        # unknown tenant -> UnknownTenantError, before any state changes
        self.tenants.weight(seq.tenant)
        tenant = seq.tenant
        if self.num_live[tenant] == 0:
            active = [self.counters[t] for t, n in self.num_live.items() if n > 0]
            floor = min(active) if active else 0.0
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self.num_live[tenant] += 1
        self.within.on_add(seq)

    def on_schedule(self, seq: Sequence, num_tokens: int) -> None:
        self.counters[seq.tenant] += num_tokens / self.tenants.weight(seq.tenant)
        self.within.on_schedule(seq, num_tokens)

    def on_finish(self, seq: Sequence) -> None:
        self.num_live[seq.tenant] -= 1
        self.within.on_finish(seq)


class Static(Policy):
    """Static batching (baseline for E1): no admissions while any request of the batch runs."""

    name = "static"
    admit_while_running = False

    def __init__(self, within: Policy | None = None) -> None:
        self.within = within or FCFS()

    def key(self, seq: Sequence, now: float) -> tuple:
        return self.within.key(seq, now)

    def on_add(self, seq: Sequence) -> None:
        self.within.on_add(seq)

    def on_schedule(self, seq: Sequence, num_tokens: int) -> None:
        self.within.on_schedule(seq, num_tokens)

    def on_finish(self, seq: Sequence) -> None:
        self.within.on_finish(seq)


def wfq_fairness_bound(max_num_seqs: int, max_len: int, max_num_batched_tokens: int,
                       w_min: float) -> float:
    """The bound B on ``|S_a / w_a - S_b / w_b|`` for backlogged tenants under WFQ (derived in the
    module docstring): ``(max_num_seqs * max_len + max_num_batched_tokens) / w_min``."""
    if w_min <= 0:
        raise ConfigError(f"the smallest tenant weight must be positive, got {w_min}")
    return (max_num_seqs * max_len + max_num_batched_tokens) / w_min


def sjf_wfq(tenants: Tenants, aging: float = 0.0) -> WFQ:
    """WFQ across tenants, SJF (with aging) within each tenant."""
    return WFQ(tenants, within=SJF(aging))


def make_policy(name: str, tenants: Tenants | None = None, aging: float = 0.0) -> Policy:
    """A policy by name: "fcfs", "sjf", "wfq", "sjf+wfq" or "static"."""
    if name in ("wfq", "sjf+wfq") and tenants is None:
        raise ConfigError(f"policy {name!r} needs a Tenants table")
    makers = {"fcfs": FCFS, "sjf": lambda: SJF(aging), "wfq": lambda: WFQ(tenants),
              "sjf+wfq": lambda: sjf_wfq(tenants, aging), "static": Static}
    if name not in makers:
        raise ConfigError(f"unknown policy {name!r}; known: {sorted(makers)}")
    return makers[name]()
