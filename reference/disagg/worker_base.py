"""What the prefill and the decode worker share: their load report and their goodbye."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reference.disagg import messages
from reference.disagg.frames import Kind
from reference.engine.params import SamplingParams
from reference.engine.sampling import sample
from reference.model.llama import Chunk
from reference.sched import WFQ, Tenants


class WorkerBase:
    """A worker has ``link``, ``scheduler``, ``block_manager``, ``streams`` and ``counters``, and
    runs its steps on the model runner the engines use (``reference/engine/model_runner.py``; its
    ``cache`` is the runner's)."""

    link: Any
    model: Any
    runner: Any
    cache: Any
    clock: Callable[[], float]
    scheduler: Any
    block_manager: Any
    streams: dict
    counters: dict[str, int]

    def inflight_tokens(self) -> int:
        raise NotImplementedError

    @staticmethod
    def fair_queuing() -> WFQ:
        """The workers' policy: weighted fair queuing across tenants, each tenant weighted as its
        REQUESTs say (``tenant_of``), first come first served inside a tenant (with one tenant:
        plain FCFS)."""
        return WFQ(Tenants({}, {}))

    def tenant_of(self, body: dict) -> dict:
        """A REQUEST's tenant fields as ``Sequence`` arguments (revision 0 REQUESTs have none: the
        default tenant, no salt), the tenant's weight noted for the scheduler's fair queuing."""
        tenant = body.get("tenant", "default")
        tenants = self.scheduler.policy.tenants
        tenants.plan_of[tenant] = tenant  # one plan per tenant, of the tenant's weight
        tenants.plan_weights[tenant] = float(body.get("weight", 1.0))
        return {"tenant": tenant, "cache_salt": body.get("cache_salt")}

    @staticmethod
    def sampling_of(body: dict) -> SamplingParams:
        """A REQUEST's sampling parameters (revision 2; absent: greedy), its seed always set."""
        if "temperature" not in body:
            return SamplingParams(seed=0)
        return SamplingParams(temperature=body["temperature"], top_k=body["top_k"],
                              top_p=body["top_p"], seed=body["seed"])

    @staticmethod
    def sample(logits: Any, params: SamplingParams, position: int) -> int:
        """The token at ``position`` of a sequence: the engine's own sampling
        (``reference/engine/sampling.py``), whose random number depends on (seed, position) only, so
        it is the token a colocated engine picks."""
        return sample(logits, params, params.seed or 0, position)

    def run_step(
        self, on_layer: Callable[[Any], Callable[[int], None]] | None = None
    ) -> tuple[Any, list] | None:
        """The engine loop's step up to the logits: schedule, copy-on-write copies, one forward
        pass.
        ``on_layer(batch)`` gives the model's per-layer hook. Returns (batch, logits), or None if
        idle."""
        batch = self.scheduler.schedule(self.clock())
        if not batch.entries:
            return None
        self.runner.copy_blocks(batch.block_copies)
        chunks = [Chunk(e.token_ids, e.start, e.block_table,
                        wants_logits=e.needs_sample) for e in batch.entries]
        hook = on_layer(batch) if on_layer is not None else None
        return batch, self.runner.forward(chunks, on_layer=hook)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def heartbeat(self) -> None:
        """Tell the coordinator this worker is alive, and how loaded (it routes by this)."""
        self.link.send(Kind.HEARTBEAT, 0, messages.dump(Kind.HEARTBEAT, {
            "free_blocks": self.block_manager.num_free_blocks,
            "inflight_tokens": self.inflight_tokens()}))

    def bye(self) -> dict:
        """The BYE body: final counters, and what is still held (all zero after a clean run)."""
        live = len(self.scheduler.waiting) + len(self.scheduler.running)
        return {"free_blocks": self.block_manager.num_free_blocks,
                "total_blocks": self.block_manager.num_blocks,
                "live_streams": len(self.streams), "live_sequences": live,
                "counters": dict(self.counters)}
