"""Tenants and plans: which plan each tenant is on, and each plan's weight for fair queuing."""

from __future__ import annotations

import math
from collections.abc import Mapping

from reference.sched.errors import ConfigError, UnknownTenantError

DEFAULT_PLAN_WEIGHTS: dict[str, float] = {"paid": 4.0, "free": 1.0}


class Tenants:
    """A tenant -> plan table and a plan -> weight table.

    ``Tenants({"acme": "paid", "bob": "free"})`` knows two tenants; any other tenant is an
    UnknownTenantError. With ``default_plan="free"`` every unlisted tenant is on that plan instead.
    ``Tenants.open()`` accepts any tenant, all on one plan of weight 1.
    """

    def __init__(self, plan_of: Mapping[str, str] | None = None,
                 plan_weights: Mapping[str, float] = DEFAULT_PLAN_WEIGHTS,
                 default_plan: str | None = None) -> None:
        for plan, weight in plan_weights.items():
            if not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
                raise ConfigError(f"plan {plan!r}: weight must be a finite number > 0, got "
                                  f"{weight!r}")
        self.plan_weights = dict(plan_weights)
        self.plan_of = dict(plan_of or {})
        self.default_plan = default_plan
        for tenant, plan in [*self.plan_of.items(), ("(default)", default_plan)]:
            if plan is not None and plan not in self.plan_weights:
                raise UnknownTenantError(f"tenant {tenant!r}: unknown plan {plan!r}; "
                                         f"known plans: {sorted(self.plan_weights)}")

    @classmethod
    def open(cls) -> Tenants:
        """Any tenant accepted, all with weight 1."""
        return cls({}, {"default": 1.0}, default_plan="default")

    def plan(self, tenant: str) -> str:
        """The tenant's plan; UnknownTenantError if the tenant is not known."""
        plan = self.plan_of.get(tenant, self.default_plan)
        if plan is None:
            raise UnknownTenantError(f"unknown tenant {tenant!r}; known tenants: "
                                     f"{sorted(self.plan_of)}")
        return plan

    def weight(self, tenant: str) -> float:
        """The tenant's weight (its plan's weight)."""
        return float(self.plan_weights[self.plan(tenant)])
