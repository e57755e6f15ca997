"""Structured output: the tokens a request may sample next, from a grammar (llguidance).

A request whose ``SamplingParams.grammar`` is set samples only tokens its grammar allows: before
each draw the logits of every other token are set to -inf (greedy too), so the answer is a prefix
of a sentence of the grammar; once the sentence is complete only the end-of-sequence token is
allowed and the answer ends there. The grammar is llguidance's grammar text (what
``json_schema_grammar``, ``lark_grammar`` and ``regex_grammar`` make); llguidance walks it over the
tokenizer's vocabulary (a token is allowed when its bytes can continue the sentence).

The matcher's state is a function of the grammar and the tokens sampled so far: a worker that did
not sample the earlier tokens (a decode worker after its prefill worker, a migrated request)
rebuilds it by feeding them (``Constraint(…, tokens=…)``). The log-probabilities reported stay the
model's raw ones (sampling.py): the mask changes which token is drawn, not what the model said.

llguidance is an optional extra: ``pip install -e '.[structured]'``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from reference.engine.params import SamplingParamsError

# compact JSON: one space after ',' and ':', no other whitespace (a small model given free
# whitespace may spend its tokens on newlines)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(SamplingParamsError):
    """A grammar or schema the grammar engine refuses, or no grammar engine installed."""


def need_llguidance() -> Any:
    """The llguidance module, or a ``GrammarError`` saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output (response_format, tools, grammar) needs llguidance: "
                           "pip install -e '.[structured]'") from None
    return llguidance


def json_schema_grammar(schema: Any) -> str:
    """The grammar of JSON documents that match ``schema`` (a JSON Schema object), compact."""
    if not isinstance(schema, dict | bool):
        raise GrammarError("a JSON schema must be an object (or true/false)")
    g = need_llguidance()
    try:
        return g.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"JSON schema: {e}") from None


def json_object_grammar() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def lark_grammar(text: str) -> str:
    """A grammar written in llguidance's Lark dialect (``%json {…}`` embeds a JSON schema)."""
    return need_llguidance().LLMatcher.grammar_from_lark(text)


def regex_grammar(pattern: str) -> str:
    """Text matching a regular expression (Rust's regex syntax)."""
    return need_llguidance().LLMatcher.grammar_from_regex(pattern)


def grammar_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of ``tokenizer`` (a ``reference.model.tokenizer.Tokenizer``) over a model
    vocabulary of ``vocab_size`` logits, built once per tokenizer (it takes ~0.2 s)."""
    cached = getattr(tokenizer, "_grammar_tokenizers", None)
    if cached is None:
        cached = {}
        tokenizer._grammar_tokenizers = cached
    if vocab_size not in cached:
        g = need_llguidance()
        if not tokenizer.eos_token_ids:
            raise GrammarError("structured output needs the tokenizer's end-of-sequence token, and "
                               "this checkpoint names none")
        try:
            cached[vocab_size] = g.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                               eos_token=list(tokenizer.eos_token_ids))
        except Exception as e:  # noqa: BLE001 -- the Rust side raises a bare error on an odd vocabulary
            raise GrammarError(f"the grammar engine cannot read this tokenizer: {e}") from None
    return cached[vocab_size]


def check(grammar: str, ll_tokenizer: Any) -> None:
    """Refuse a grammar the engine cannot follow, naming the problem (an unknown ``$ref``, an
    unsupported keyword, a malformed Lark rule)."""
    g = need_llguidance()
    try:
        error = g.LLMatcher.validate_grammar(grammar, ll_tokenizer)
    except Exception as e:  # noqa: BLE001 -- malformed grammar JSON raises
        error = str(e)
    if error:
        raise GrammarError(f"the grammar is refused: {error}")


class Constraint:
    """One request's place in its grammar: which tokens may come next, advanced token by token."""

    def __init__(self, grammar: str, ll_tokenizer: Any, vocab_size: int,
                 tokens: Sequence[int] = ()) -> None:
        g = need_llguidance()
        self.vocab_size = vocab_size
        self.eos = tuple(ll_tokenizer.eos_tokens)
        self.matcher = g.LLMatcher(ll_tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar is refused: {self.matcher.get_error()}")
        for t in tokens:  # the tokens sampled before this worker took the request
            self.advance(t)

    def allowed(self) -> np.ndarray:
        """A bool per token of the vocabulary: True where the grammar allows it next. A matcher in
        an error state (it cannot happen through ``sample``, which draws allowed tokens only)
        allows the end-of-sequence token alone, so the answer ends."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if len(mask) < self.vocab_size:
            mask = np.concatenate([mask, np.zeros(self.vocab_size - len(mask), dtype=bool)])
        if not mask.any():
            mask[[t for t in self.eos if t < self.vocab_size]] = True
        return mask

    def advance(self, token: int) -> None:
        """Take the sampled token (the matcher ignores it once the grammar has ended)."""
        if not self.matcher.is_stopped():
            self.matcher.consume_token(int(token))

    @property
    def complete(self) -> bool:
        """Whether the tokens so far make a whole sentence of the grammar."""
        return self.matcher.is_accepting() or self.matcher.is_stopped()
