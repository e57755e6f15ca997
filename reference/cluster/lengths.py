"""Request lengths from ShareGPT: (prompt tokens, answer tokens) of real first turns.

Counted with the SmolLM2 tokenizer (``reference.model.tokenizer``) on the packaged ShareGPT copy
(``reference.workload``). The simulator draws each request's lengths from this pool with its seeded
RNG, then truncates the prompt to the traffic's ``max_prompt`` and scales and caps the answer.
"""

from __future__ import annotations

import functools

import numpy as np


@functools.cache
def sharegpt_lengths(n: int = 2000) -> np.ndarray:
    """An (n, 2) int array: prompt and answer token counts of the first ``n`` ShareGPT
    conversations."""
    from reference.model.tokenizer import load_tokenizer
    from reference.workload import iter_sharegpt

    tok = load_tokenizer("smollm2")
    pairs = [(len(tok.encode(c.prompt)), len(tok.encode(c.answer))) for c in iter_sharegpt(limit=n)]
    out = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    out.setflags(write=False)
    return out
