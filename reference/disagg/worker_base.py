"""What the prefill and the decode worker share: their load report and their goodbye."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from reference.disagg import messages
from reference.disagg.frames import Kind
from reference.engine.params import SamplingParams, SamplingParamsError
from reference.engine.request import Logprob
from reference.engine.sampling import log_softmax, logprob_of, sample
from reference.model.llama import Chunk
from reference.sched import WFQ, RequestError, Tenants


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
    # the checkpoint (make_worker sets it): a grammar's tokenizer comes from it
    model_spec: str | None = None

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
        """A REQUEST's sampling parameters, its seed always set: temperature, top_k, top_p and seed
        (revision 2; absent: greedy), the penalties, min_p, logit bias, grammar and logprobs
        (revision 3; absent: none). Raises ``RequestError`` on a combination the engine refuses."""
        fields: dict[str, Any] = {"seed": 0}
        if "temperature" in body:
            fields.update({k: body[k] for k in messages.SAMPLING})
        names = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "grammar",
                 "logprobs", "prompt_logprobs")
        fields.update({k: body[k] for k in names if k in body})
        if "logit_bias" in body:
            fields["logit_bias"] = {int(t): float(b) for t, b in body["logit_bias"]}
        try:
            return SamplingParams(**fields)
        except SamplingParamsError as e:
            raise RequestError(f"sampling parameters: {e}") from None

    def check_grammar(self, params: SamplingParams) -> None:
        """Refuse (``RequestError``) a REQUEST whose grammar this worker cannot follow."""
        if params.grammar is not None:
            self.constraint(params.grammar, ())

    def constraint(self, text: str, tokens: Sequence[int]) -> Any:
        """A grammar's matcher after ``tokens`` (the request's output so far), over this worker's
        tokenizer (loaded from ``model_spec`` on the first grammar) and vocabulary."""
        from reference.engine import grammar

        vocab = self.model.config.vocab_size
        try:
            if getattr(self, "_grammar_tokenizer", None) is None:
                from reference.model.tokenizer import load_tokenizer

                if self.model_spec is None:
                    raise grammar.GrammarError("this worker was not told its checkpoint's "
                                               "tokenizer")
                tokenizer = load_tokenizer(self.model_spec)
                self._grammar_tokenizer = grammar.grammar_tokenizer(tokenizer, vocab)
            return grammar.Constraint(text, self._grammar_tokenizer, vocab, tokens)
        except grammar.GrammarError as e:
            raise RequestError(f"grammar: {e}") from None

    def pick(self, st: Any, seq: Any, logits: Any) -> tuple[int, Logprob | None]:
        """The next token of ``seq`` (stream ``st``: its ``params``, ``generated`` count and grammar
        ``constraint``) and its logprob if asked: the engine's own sampling
        (``reference/engine/sampling.py``), whose random number depends on (seed, position) only,
        and whose penalties and grammar see the prompt and output the colocated engine sees (after a
        migration the prompt's last ``generated`` tokens are output), so it is the token a colocated
        engine picks."""
        params: SamplingParams = st.params
        n = seq.num_prompt_tokens
        prompt = seq.prompt_token_ids[:n - st.generated]
        output = list(seq.prompt_token_ids[n - st.generated:]) + list(seq.output_token_ids)
        allowed = None
        if params.grammar is not None:
            if st.constraint is None:
                st.constraint = self.constraint(params.grammar, output)
            allowed = st.constraint.allowed()
        token = sample(logits, params, params.seed or 0, seq.num_tokens, prompt, output, allowed)
        if st.constraint is not None:
            st.constraint.advance(token)
        lp = None
        if params.logprobs is not None:
            lp = logprob_of(log_softmax(logits), token, params.logprobs)
        return token, lp

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
        chunks = [Chunk(e.token_ids, e.start, e.block_table, wants_logits=e.needs_sample,
                        all_logits=_wants_prompt_rows(e)) for e in batch.entries]
        hook = on_layer(batch) if on_layer is not None else None
        logits = self.runner.forward(chunks, on_layer=hook)
        last = []
        for e, ch, lg in zip(batch.entries, chunks, logits, strict=True):
            if ch.all_logits:  # the prompt's logprobs (revision 3), kept on the stream until sent
                st, prompt = e.seq.request, e.seq.prompt_token_ids
                for r, row in enumerate(lg):
                    target = e.start + r + 1
                    if target < len(prompt) and target not in st.prompt_lps:
                        st.prompt_lps[target] = logprob_of(log_softmax(row), prompt[target],
                                                           st.params.prompt_logprobs)
                lg = lg[-1]
            last.append(lg)
        return batch, last

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


def logprob_fields(lp: Logprob | None) -> dict[str, Any]:
    """A token's logprob as a DONE or TOKEN carries it (revision 3): nothing when not asked."""
    if lp is None:
        return {}
    return {"logprob": lp.logprob, "top": [x for t, v in lp.top for x in (t, v)]}


def logprob_from(body: dict, token: int) -> Logprob | None:
    """The Logprob a DONE or TOKEN body carries for ``token`` (None: it carries none)."""
    if "logprob" not in body:
        return None
    top = body.get("top", [])
    pairs = zip(top[::2], top[1::2], strict=True)
    return Logprob(token, float(body["logprob"]), tuple((int(t), float(v)) for t, v in pairs))


def _wants_prompt_rows(e: Any) -> bool:
    """Whether a scheduled chunk computes prompt rows whose logprobs its stream wants (the row at
    position i gives the logprob of prompt token i + 1)."""
    st = e.seq.request
    return (st is not None and st.params.prompt_logprobs is not None
            and e.start < e.seq.num_prompt_tokens - 1)


def prompt_logprob_fields(st: Any, prompt_len: int) -> dict[str, Any]:
    """The prompt's logprobs as a DONE or TOKEN carries them (revision 3), once every position
    1..prompt_len-1 has one: flat, per position [logprob, id, logprob, ...] (nothing when not asked
    or not all computed here)."""
    if st.params.prompt_logprobs is None or len(st.prompt_lps) < prompt_len - 1:
        return {}
    flat: list[float] = []
    for i in range(1, prompt_len):
        lp = st.prompt_lps[i]
        flat.append(lp.logprob)
        for t, v in lp.top:
            flat += [t, v]
    return {"prompt_logprobs": flat}


def prompt_logprobs_from(body: dict, prompt: Sequence[int],
                         k: int) -> tuple[Logprob | None, ...] | None:
    """The prompt's logprobs a DONE or TOKEN body carries (the first None), checked against the
    prompt's length and ``k`` alternatives (None: it carries none, or not for this prompt)."""
    flat = body.get("prompt_logprobs")
    width = 1 + 2 * k
    if flat is None or len(flat) != (len(prompt) - 1) * width:
        return None
    out: list[Logprob | None] = [None]
    for i in range(1, len(prompt)):
        row = flat[(i - 1) * width:i * width]
        ids = row[1::2]
        if any(float(t) != int(t) or t < 0 for t in ids):
            return None
        pairs = zip(ids, row[2::2], strict=True)
        out.append(Logprob(prompt[i], float(row[0]), tuple((int(t), float(v)) for t, v in pairs)))
    return tuple(out)
