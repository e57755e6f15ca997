"""The quick run's cuts and the work they stopped doing twice: what each keeps is checked here."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from experiments.claims.u3_ratio import PEERS, QUICK_SECOND, breakdown, summarize
from experiments.report import load_results
from experiments.unweight.codec_peers import METHODS
from reference.bf16 import field_stats, float32_to_bf16


def _tensors(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [float32_to_bf16((rng.standard_normal(shape) * scale).astype(np.float32))
            for shape, scale in (((64, 96), 0.02), ((128, 64), 0.05), ((48, 128), 1.0))]


@pytest.mark.parametrize("method", [*PEERS, "zstd19"])
def test_a_tensors_size_does_not_depend_on_what_else_was_coded_with_it(method: str) -> None:
    """U3 reads the zstd-19 sample's other sizes from the full pass instead of coding the sample again."""
    ts = _tensors()
    together = METHODS[method](ts)
    assert together.ok
    assert [METHODS[method]([t]).sizes[0] for t in ts] == together.sizes


def test_the_breakdown_of_an_encoded_tensor_equals_encoding_it_again() -> None:
    t = _tensors(1)[1]
    ct = METHODS["unweight"]([t]).compressed[0]
    assert breakdown(t, ct, field_stats(t).exponent_entropy) == breakdown(t)


def test_quick_u3_keeps_on_smollm2_what_its_table_cell_reads() -> None:
    """The cell of the stored (all-codec) U3 record is the same when SmolLM2 ran QUICK_SECOND only."""
    record = load_results()["U3"]
    smol = copy.deepcopy(record["measured"]["models"][1])
    assert smol["weights"] == "smollm2"
    for key in ("whole_model", "mlp", *(f"per_kind.{k}" for k in smol["per_kind"])):
        part = smol[key] if "." not in key else smol["per_kind"][key.split(".", 1)[1]]
        for method in set(PEERS) - set(QUICK_SECOND):
            part.pop(method)
    quick = {**record, "measured": {**record["measured"], "models": [record["measured"]["models"][0], smol]}}
    assert summarize(quick) == summarize(record)
    assert set(QUICK_SECOND) < set(PEERS)
