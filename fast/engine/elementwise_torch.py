"""The element-wise steps of the fast model in plain torch: RMSNorm and RoPE, as the reference computes them.

``model.py`` runs these lines wherever the C ops of ``fused_c.py`` do not apply, and ``fused_c.py`` checks on a
probe that its C norm gives their bits (a leaf module, so that neither imports the other).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, per row (float32, as the reference)."""
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by per-token tables [tokens, head_dim] (the reference's rule).

    The reference computes ``x * cos + [-x2, x1] * sin`` (x1, x2 the halves of x). With ``signed_sin =
    [-sin1, sin2]`` (``signed``) that is ``x * cos + [x2, x1] * signed_sin``: the same products (negation
    is exact), in three torch calls instead of six.
    """
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin[:, None, :]


def signed(sin: torch.Tensor) -> torch.Tensor:
    """The sine table with its first half negated (what ``apply_rope`` takes)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
