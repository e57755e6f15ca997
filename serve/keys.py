"""API keys: which tenant and plan each key belongs to, read from a TOML file.

The file has a ``[keys]`` table mapping each key to its tenant and plan, and an optional ``[plans]``
table giving each plan its weight for weighted fair queuing (default: paid 4, free 1)::

    [plans]
    paid = 4
    free = 1

    [keys]
    "sk-acme-1" = { tenant = "acme", plan = "paid" }
    "sk-bob-1"  = { tenant = "bob",  plan = "free" }

A tenant may have several keys, all on the same plan. Keys are looked up by their SHA-256 digest, so
the lookup takes the same time whatever the key shares with a real one.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from reference.sched import DEFAULT_PLAN_WEIGHTS, Tenants

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class KeysError(ValueError):
    """The keys file is missing or malformed; the message names the file and the entry."""


@dataclass(frozen=True)
class Client:
    """Who sent a request: its tenant and plan."""

    tenant: str
    plan: str


class KeyTable:
    """API key -> Client, and the Tenants table (plans and weights) the engine schedules with."""

    def __init__(self, keys: dict[str, Client], plan_weights: dict[str, float]) -> None:
        self._by_digest = {_digest(k): c for k, c in keys.items()}
        plan_of = {c.tenant: c.plan for c in keys.values()}
        self.tenants = Tenants(plan_of, plan_weights)

    def __len__(self) -> int:
        return len(self._by_digest)

    def lookup(self, key: str) -> Client | None:
        """The client of ``key``, or None for an unknown key."""
        return self._by_digest.get(_digest(key))

    @classmethod
    def load(cls, path: str | Path) -> KeyTable:
        """Read a keys file; KeysError names what is wrong."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise KeysError(f"{path}: cannot read the keys file: {e.strerror or e}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise KeysError(f"{path}: not valid TOML: {e}") from None
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: dict, where: str = "keys") -> KeyTable:
        unknown = set(data) - {"keys", "plans"}
        if unknown:
            raise KeysError(f"{where}: unknown table(s) {sorted(unknown)}; expected [keys] and optionally [plans]")
        plans = data.get("plans", DEFAULT_PLAN_WEIGHTS)
        if not isinstance(plans, dict) or not plans:
            raise KeysError(f"{where}: [plans] must map each plan name to a weight")
        for plan, weight in plans.items():
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) \
                    or weight <= 0:
                raise KeysError(f"{where}: plan {plan!r}: weight must be a number > 0, got {weight!r}")
        table = data.get("keys")
        if not isinstance(table, dict) or not table:
            raise KeysError(f"{where}: needs a [keys] table with at least one key")
        keys: dict[str, Client] = {}
        plan_of: dict[str, str] = {}
        for key, entry in table.items():
            label = f"{where}: key {key[:4]}...{key[-2:]}" if len(key) > 8 else f"{where}: key {key!r}"
            if not key.strip() or key != key.strip():
                raise KeysError(f"{label}: a key must be non-empty and have no surrounding spaces")
            if not isinstance(entry, dict) or set(entry) - {"tenant", "plan"}:
                raise KeysError(f"{label}: must be {{ tenant = \"...\", plan = \"...\" }}")
            tenant, plan = entry.get("tenant"), entry.get("plan")
            if not isinstance(tenant, str) or not tenant:
                raise KeysError(f"{label}: 'tenant' must be a non-empty string")
            if plan not in plans:
                raise KeysError(f"{label}: unknown plan {plan!r}; plans: {sorted(plans)}")
            if plan_of.setdefault(tenant, plan) != plan:
                raise KeysError(f"{label}: tenant {tenant!r} is on plan {plan_of[tenant]!r} under another key")
            keys[key] = Client(tenant, plan)
        return cls(keys, {p: float(w) for p, w in plans.items()})


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


# -- the command line ------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("API keys (see serve/keys.py)")
    g.add_argument("--api-keys", help="TOML file: [keys] key = { tenant = ..., plan = ... }, optional [plans]")
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="without --api-keys, allow binding to a non-loopback address")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Without keys, only a loopback ``--host`` (unless --allow-unauthenticated)."""
    if args.api_keys is None and args.host not in LOOPBACK and not args.allow_unauthenticated:
        p.error(f"--host {args.host} without --api-keys would serve anyone who can reach it; "
                "give --api-keys KEYS.toml, or --allow-unauthenticated if that is what you want")


def key_table(args: argparse.Namespace) -> KeyTable | None:
    """The keys of ``--api-keys`` (None: every request is accepted as tenant "default"); KeysError if bad."""
    return KeyTable.load(args.api_keys) if args.api_keys else None
