"""Payloads of the control frames: small JSON objects, each checked against a fixed schema.

A peer's JSON is parsed with ``jsonsafe.loads`` (no pickle, no object hooks, at most 4 levels
deep) and then every field is checked: present, of the right type, in range, and no field that
the schema does not name. What fails raises ``MessageError`` naming the frame kind and the field.
The KV payload is binary (``wire.py``).

Revisions 1 to 3 of the protocol (``REVISION``, PROTOCOL.md section 3.1) added fields that a
message may leave out (``OPTIONAL``): a REQUEST's tenant, cache salt and scheduling weight, and a
HELLO's revision (1); a REQUEST's sampling parameters (2); a REQUEST's penalties, logit bias,
min-p, grammar, logprobs and ``generated`` count, and the logprobs of a DONE's first token and of
a TOKEN (3). Absent, they mean what revision 0 meant (tenant "default", no salt, weight 1;
revision 0; greedy; none of the revision 3 adjustments, no logprobs).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from reference import jsonsafe
from reference.disagg.frames import Kind

REVISION = 3  # the control payloads' revision this side speaks (PROTOCOL.md section 3.1)
MAX_TOKENS_IN_MESSAGE = 1 << 20
U32 = (1 << 32) - 1


class MessageError(ValueError):
    """A control payload that does not follow its schema."""


Check = Callable[[Any], bool]


def integer(lo: int = 0, hi: int = U32) -> Check:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def text(max_len: int = 256) -> Check:
    return lambda v: isinstance(v, str) and len(v) <= max_len


def number(lo: float, hi: float) -> Check:
    """A finite int or float in (lo, hi]."""
    return lambda v: (
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and lo < v <= hi
    )


def closed(lo: float, hi: float) -> Check:
    """A finite int or float in [lo, hi]."""
    return lambda v: (
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        and lo <= v <= hi
    )


def logprob(v: Any) -> bool:
    """A log-probability: a finite number <= 0."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v <= 0


def top_pairs(v: Any) -> bool:
    """The most likely alternatives, flat: [id, logprob, id, logprob, ...] (at most 1024 pairs)."""
    return (isinstance(v, list) and len(v) % 2 == 0 and len(v) <= 2048
            and all(integer()(t) and logprob(lp) for t, lp in zip(v[::2], v[1::2], strict=True)))


def flat_numbers(v: Any) -> bool:
    """A flat list of finite numbers (a prompt's logprobs: worker_base.prompt_logprob_fields)."""
    return (isinstance(v, list) and len(v) <= MAX_TOKENS_IN_MESSAGE * 8
            and all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                    for x in v))


def bias_pairs(v: Any) -> bool:
    """A logit bias: [[token id, bias in [-100, 100]], ...] (at most 65536 pairs)."""
    return (isinstance(v, list) and len(v) <= 1 << 16
            and all(isinstance(x, list) and len(x) == 2 and integer()(x[0])
                    and closed(-100, 100)(x[1]) for x in v))


def integers(lo: int = 0, hi: int = U32, max_len: int = MAX_TOKENS_IN_MESSAGE) -> Check:
    one = integer(lo, hi)
    return lambda v: isinstance(v, list) and len(v) <= max_len and all(one(x) for x in v)


def hex_keys(nbytes: int = 16) -> Check:
    def check(v: Any) -> bool:
        return (
            isinstance(v, list)
            and len(v) <= MAX_TOKENS_IN_MESSAGE
            and all(
                isinstance(x, str)
                and len(x) == 2 * nbytes
                and all(c in "0123456789abcdef" for c in x)
                for x in v
            )
        )
    return check


def one_of(*values: Any) -> Check:
    return lambda v: isinstance(v, str) and v in values


def optional(check: Check) -> Check:
    return lambda v: v is None or check(v)


def counters(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and len(v) <= 64
        and all(
            isinstance(k, str) and len(k) <= 64 and integer(0, 1 << 62)(x) for k, x in v.items()
        )
    )


LAYOUT = {"num_layers": integer(1, 4096), "num_kv_heads": integer(1, 4096),
          "head_dim": integer(1, 65536),
          "block_size": integer(1, 65536), "wire": one_of("fp32", "bf16", "fp8"),
          "scale_rule": one_of("none", "pow2-per-block-head")}


def layout_check(v: Any) -> bool:
    return isinstance(v, dict) and set(v) == set(LAYOUT) and all(LAYOUT[k](v[k]) for k in LAYOUT)


def hex_text(max_len: int) -> Check:
    return lambda v: (isinstance(v, str) and 0 < len(v) <= max_len and len(v) % 2 == 0
                      and all(c in "0123456789abcdef" for c in v))


# MANIFEST kv_source (the NIXL carrier, PROTOCOL.md section 4.1): the prefill worker's NIXL agent
KV_SOURCE = {"agent": text(128), "metadata": hex_text(1 << 17), "addr": integer(1, (1 << 64) - 1),
             "size": integer(1, (1 << 40))}


def kv_source_check(v: Any) -> bool:
    return (isinstance(v, dict) and set(v) == set(KV_SOURCE)
            and all(KV_SOURCE[k](v[k]) for k in KV_SOURCE))


SCHEMAS: dict[Kind, dict[str, Check]] = {
    Kind.HELLO: {
        "role": one_of("prefill", "decode"),
        "node": integer(1, 65535),
        "model_digest": text(64),
        "layout": layout_check,
        "num_blocks": integer(1, U32),
        "pid": integer(0, U32),
        "vocab_size": integer(1, U32),
        "max_context": integer(1, U32),
        "eos_token_ids": integers(max_len=64),
        "revision": integer(0, 255),
    },
    Kind.REQUEST: {
        "id": text(),
        "prompt": integers(),
        "max_tokens": integer(1, U32),
        "eos_token_ids": integers(max_len=64),
        "tenant": text(),
        "cache_salt": optional(text()),
        "weight": number(0.0, 1e6),
        "temperature": number(0.0, 1e6),
        "top_k": integer(0, U32),
        "top_p": number(0.0, 1.0),
        "seed": integer(0, (1 << 63) - 1),
        # revision 3
        "generated": integer(0, U32),  # the prompt's last tokens that are the request's own output
        "presence_penalty": closed(-2, 2),
        "frequency_penalty": closed(-2, 2),
        "repetition_penalty": number(0, 100),
        "min_p": closed(0, 1),
        "logit_bias": bias_pairs,
        "grammar": lambda v: isinstance(v, str) and 0 < len(v) <= 1 << 22,
        "logprobs": integer(0, 1024),
        "prompt_logprobs": integer(0, 1024),
    },
    Kind.MANIFEST: {
        "id": text(),
        "prompt_len": integer(1, U32),
        "prefix_keys": hex_keys(),
        "model_digest": text(64),
        "layout": layout_check,
        "kv_source": kv_source_check,
    },
    Kind.DONE: {"first_token": integer(), "kv_frames": integer(), "kv_digest": text(64),
                # revision 3, when asked for
                "logprob": logprob, "top": top_pairs, "prompt_logprobs": flat_numbers},
    Kind.ABORT: {"reason": text(512), "action": one_of("cancel", "recompute", "refused")},
    Kind.ACK: {"of": one_of("manifest", "done"), "cached_tokens": integer()},
    Kind.HEARTBEAT: {"free_blocks": integer(), "inflight_tokens": integer()},
    Kind.TOKEN: {"index": integer(), "token": integer(), "cpu_us": integer(0, 1 << 62),
                 # revision 3, when asked for
                 "logprob": logprob, "top": top_pairs, "prompt_logprobs": flat_numbers},
    Kind.FINISH: {
        "id": text(),
        "output": integers(),
        "finish_reason": one_of("stop", "length", "abort", "error"),
        "error": optional(text(1024)),
        "recomputed": integer(0, 1),
    },
    Kind.SHUTDOWN: {},
    Kind.BYE: {
        "free_blocks": integer(),
        "total_blocks": integer(),
        "live_streams": integer(),
        "live_sequences": integer(),
        "counters": counters,
    },
}

# fields of revision 1 that a payload may leave out (a revision-0 peer never sends them)
OPTIONAL: dict[Kind, frozenset[str]] = {
    Kind.HELLO: frozenset({"revision"}),
    Kind.REQUEST: frozenset(
        {"tenant", "cache_salt", "weight", "temperature", "top_k", "top_p", "seed", "generated",
         "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
         "grammar", "logprobs", "prompt_logprobs"}
    ),
    Kind.DONE: frozenset({"logprob", "top", "prompt_logprobs"}),
    Kind.TOKEN: frozenset({"logprob", "top", "prompt_logprobs"}),
    # sent only by a prefill worker on the NIXL carrier (PROTOCOL.md section 4.1)
    Kind.MANIFEST: frozenset({"kv_source"}),
}
# revision 2: present together or not at all (greedy)
SAMPLING = ("temperature", "top_k", "top_p", "seed")
# revision 3: what a REQUEST may carry beyond (a worker of revision < 3 is never sent them)
REVISION_3 = ("generated", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
              "logit_bias", "grammar", "logprobs", "prompt_logprobs")


def dump(kind: Kind, body: dict[str, Any]) -> bytes:
    """The payload of a control frame (checked here too, so a bug never sends what a peer
    refuses)."""
    check(kind, body)
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def load(kind: Kind, payload: bytes) -> dict[str, Any]:
    """Parse and check a control payload of ``kind``."""
    try:
        body = jsonsafe.loads(payload, max_depth=4, what=f"{kind.name} payload")
    except jsonsafe.JsonError as e:
        raise MessageError(str(e)) from None
    check(kind, body)
    return body


def check(kind: Kind, body: Any) -> None:
    schema = SCHEMAS.get(kind)
    if schema is None:
        raise MessageError(f"{kind.name} frames carry no JSON payload")
    if not isinstance(body, dict):
        raise MessageError(f"{kind.name} payload must be a JSON object")
    extra, missing = (
        set(body) - set(schema),
        set(schema) - set(body) - OPTIONAL.get(kind, frozenset()),
    )
    if extra or missing:
        raise MessageError(f"{kind.name} payload: unexpected fields {sorted(extra)}, missing "
                           f"{sorted(missing)}")
    for name, ok in schema.items():
        if name in body and not ok(body[name]):
            raise MessageError(f"{kind.name} payload: field {name!r} has a bad value "
                               f"{str(body[name])[:80]!r}")
    if kind is Kind.REQUEST and 0 < sum(name in body for name in SAMPLING) < len(SAMPLING):
        raise MessageError(f"REQUEST payload: the sampling fields {list(SAMPLING)} come all "
                           "together or not at all")
