"""What a weight tensor is, from its name: attention q/k/v/o, MLP gate/up/down, embedding, norm.

Knows three naming schemes: Hugging Face Llama (``model.layers.0.mlp.gate_proj.weight``),
Hugging Face BERT (``encoder.layer.0.intermediate.dense.weight``) and GGUF
(``blk.0.ffn_gate.weight``). Experiments group their numbers by these kinds; the codec's container
uses them to decide what to compress.
"""

from __future__ import annotations

import re

# (pattern, kind), first match wins; patterns are searched in the full tensor name
_RULES: list[tuple[str, str]] = [
    (r"(norm|LayerNorm|ln_\w+)\.(weight|bias)$", "norm"),
    (r"\.bias$", "bias"),
    (r"(q_proj|attn_q|self\.query)\.weight$", "attn_q"),
    (r"(k_proj|attn_k|self\.key)\.weight$", "attn_k"),
    (r"(v_proj|attn_v|self\.value)\.weight$", "attn_v"),
    (r"(o_proj|attn_output|attention\.output\.dense)\.weight$", "attn_o"),
    (r"(gate_proj|ffn_gate|w1)\.weight$", "mlp_gate"),
    (r"(up_proj|ffn_up|w3|intermediate\.dense)\.weight$", "mlp_up"),
    (r"(down_proj|ffn_down|w2|\d+\.output\.dense)\.weight$", "mlp_down"),
    (r"(embed_tokens|token_embd|word_embeddings|position_embeddings|token_type_embeddings|wte|wpe)"
     r"\.weight$",
     "embedding"),
    (r"(^|\.)(lm_head|output)\.weight$", "lm_head"),
]
KINDS = ["attn_q", "attn_k", "attn_v", "attn_o", "mlp_gate", "mlp_up", "mlp_down",
         "embedding", "lm_head", "norm", "bias", "other"]
MLP_KINDS = ("mlp_gate", "mlp_up", "mlp_down")
ATTENTION_KINDS = ("attn_q", "attn_k", "attn_v", "attn_o")


def tensor_kind(name: str) -> str:
    """The kind of a tensor (one of KINDS) from its name; 'other' when no rule matches."""
    for pattern, kind in _RULES:
        if re.search(pattern, name):
            return kind
    return "other"
