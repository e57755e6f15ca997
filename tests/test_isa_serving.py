"""Batch invariance and plain = compressed, served, on every instruction set this CPU can execute (issue 42).

For each ISA (``UNFIRE_CPU_ISA``: amx, avx512, avx2 or neon, whichever the CPU has), real processes serve SmolLM2
as a user starts them (``python -m serve``) and real chat prompts are sent with the official ``openai`` client,
greedy: the colocated fast server's answer to each prompt sent alone is the answer it gives while the prompts
arrive together (other rows in the same products), the answer of the disaggregated endpoint (one prefill and one
decode worker, compressed weights) under the same concurrent load, and that of a two-stage pipeline. On one machine
one product family serves every row count (fast/codec/matmul_c.py), so the bits of a row do not depend on the rows
beside it; the oneDNN products (``UNFIRE_TILE_MATMUL=0``) do not promise that.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from fast import cpu_isa  # noqa: E402
from tests.test_serve_disagg import Server  # noqa: E402

PROMPTS = ["What is rain made of?", "Name three colors of the rainbow.", "Why is the sky blue?",
           "Write one sentence about the sea."]
MAX_TOKENS = 16
ISAS = [name for name in cpu_isa.supported() if name != "scalar"]  # scalar: the conformance anchor, not a server


def ask(server: Server, prompt: str) -> str:
    out = server.client().chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MAX_TOKENS
    return out.choices[0].message.content


def together(server: Server) -> list[str]:
    """Every prompt at once (each on its own connection): the engine batches them in its steps."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: ask(server, p), PROMPTS))


def start(isa: str, *args: str) -> Server:
    return Server("--model", "smollm2", "--engine", "fast", "--served-model-name", "m", "--num-blocks", "256",
                  *args, env={"UNFIRE_CPU_ISA": isa}, timeout=300)


@pytest.mark.parametrize("isa", ISAS)
def test_answers_do_not_depend_on_the_batch_the_weights_or_the_topology(isa: str) -> None:
    server = start(isa)
    try:
        assert f"using {isa}" in "".join(server.lines)  # the server names the ISA it serves with
        alone = [ask(server, p) for p in PROMPTS]
        assert together(server) == alone
    finally:
        assert server.close() == 0
    for args in (("--compressed", "--prefill-workers", "1", "--decode-workers", "1"), ("--pipeline", "cpu:1,cpu:1")):
        server = start(isa, *args)
        try:
            assert together(server) == alone, f"{isa} {' '.join(args)}"
        finally:
            assert server.close() == 0


def test_an_isa_the_cpu_lacks_is_refused_at_start() -> None:
    lacking = [name for name in cpu_isa.ALL if name not in cpu_isa.supported()]
    with pytest.raises(AssertionError, match=f"UNFIRE_CPU_ISA='{lacking[0]}'.*cannot execute it"):
        start(lacking[0])
