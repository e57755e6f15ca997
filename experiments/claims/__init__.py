"""Every claim of paper/claims.md: its id, what it says, and the article's number.

This package also holds one module per claim (``u1_entropy.py``, ``e9_fair_queuing.py``, ...), each
defining ``EXPERIMENT``; the runner finds them by their place here. Helpers they share live one
level up, in ``experiments/``.

The reproduction table has one row per entry here, implemented or not. The article's numbers are
quoted as text (they are the articles' words, not our measurements).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Claim:
    id: str
    topic: str
    article: str  # the article's number, as the article states it


CLAIMS: list[Claim] = [
    Claim("U1", "BF16 exponent entropy in trained weights", "exponent ~2.6 bits of 8; sign, mantissa ~incompressible"),
    Claim("U2", "Unweight format: palette-16 + Huffman exponents, verbatim rows", "format described (rows of 64)"),
    Claim("U3", "Compression ratio", "1.44x on MLP weights; up to 22% smaller model (~13% gate/up only)"),
    Claim("U4", "On-chip decode fused into the matmul", "lossless; palette form 30-40% slower than BF16 on H100"),
    Claim("E1", "Continuous batching vs static batching", "lower TTFT and ITL"),
    Claim("E2", "Paged KV cache", "less fragmentation, better long-context efficiency"),
    Claim("E3", "Prefill compute-bound, decode memory-bound", "qualitative"),
    Claim("E4", "Prefill/decode disaggregation", "p90 ITL ~100 ms -> 20-30 ms"),
    Claim("E5", "Cluster utilization with disaggregation", "~40% higher GPU utilization; prefill >= 85% compute"),
    Claim("E6", "Layer-wise KV streaming", "lower TTFT than bulk transfer"),
    Claim("E7", "fp8 KV on the wire", "half the bytes"),
    Claim("E8", "Shared system-prompt KV (deterministic keys)", "cuts TTFT"),
    Claim("E9", "SJF + weighted fair queuing", "paid plans get lower latency"),
    Claim("E10", "Infire vs vLLM-based setup", "+20% tokens/s, much lower CPU load"),
    Claim("R1", "Tiered edge/regional/central routing", "~60% of requests end at the edge"),
    Claim("R2", "Non-uniform pipeline parallelism", "layers split by each GPU's memory and compute"),
    Claim("R3", "Data localisation (GDPR/PIPL)", "never served outside the allowed region"),
    Claim("R4", "TTFT by infrastructure", "cloud 350-800 ms, multi-region 150-400 ms, edge 80-200 ms"),
]

CLAIM_IDS = [c.id for c in CLAIMS]


def claim(claim_id: str) -> Claim:
    for c in CLAIMS:
        if c.id == claim_id:
            return c
    raise KeyError(f"unknown claim {claim_id!r}; known: {', '.join(CLAIM_IDS)}")
