"""Log-probabilities in the OpenAI response shapes, from the engine's ``Logprob`` records.

The engine reports the model's raw log-probabilities (the log-softmax of the logits, before logit
bias, penalties, temperature and cuts: vLLM's default "raw_logprobs"), per generated token and, with
``echo``, per prompt token (the first prompt token has none: ``null``, as vLLM answers). Here they
become:

- completions: ``{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{text: logprob}],
  "text_offset": [...]}``, the alternatives' dict holding the ``logprobs`` most likely tokens and the
  chosen one;
- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]}``, ``top_logprobs`` the ``top_logprobs`` most likely tokens.

A token's text is its UTF-8 bytes decoded (a piece of a character shows as U+FFFD), its bytes those
of the byte-level BPE vocabulary entry.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from reference.engine.request import Logprob

FLOOR = -9999.0  # what a logprob of -inf is reported as (vLLM's choice: JSON has no infinity)

Entry = tuple[int, Logprob | None]  # a token and its logprob record (None: the first prompt token)


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a vocabulary entry uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Each token's text and bytes, computed once per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        got = self.cache.get(token_id)
        if got is None:
            got = self.cache[token_id] = self._compute(token_id)
        return got

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        entry = self.tokenizer.backend.id_to_token(token_id) if hasattr(self.tokenizer, "backend") else None
        table = _byte_of_char()
        if entry is not None and all(c in table for c in entry):
            raw = bytes(table[c] for c in entry)
            return raw.decode("utf-8", "replace"), raw
        text = self.tokenizer.decode([token_id])  # not byte-level BPE: the decoded text
        return text, text.encode("utf-8")


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(entries: Sequence[Entry], text: TokenText, offset: int = 0) -> dict[str, Any]:
    """The completions shape of ``entries``; text offsets start at ``offset``."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in entries:
        s = text(token)[0]
        out["tokens"].append(s)
        out["text_offset"].append(offset)
        offset += len(s)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(lp.logprob))
        top = {text(t)[0]: _value(v) for t, v in lp.top}
        top.setdefault(s, _value(lp.logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(entries: Sequence[Entry], text: TokenText) -> dict[str, Any]:
    """The chat shape of ``entries`` (generated tokens: each has a record)."""
    content = []
    for token, lp in entries:
        assert lp is not None
        content.append({**_chat_token(token, lp.logprob, text),
                        "top_logprobs": [_chat_token(t, v, text) for t, v in lp.top]})
    return {"content": content}


def _chat_token(token: int, logprob: float, text: TokenText) -> dict[str, Any]:
    s, raw = text(token)
    return {"token": s, "logprob": _value(logprob), "bytes": list(raw)}
