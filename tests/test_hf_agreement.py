"""Acceptance: our NumPy forward agrees with Hugging Face transformers loading the same GGUF file.

transformers dequantizes the Q4_1 GGUF to float32 and undoes llama.cpp's q/k permutation itself, so
it is an independent reading of the same file. Both run float32. Checked per prompt: the logits of
the whole prompt (max |ours - HF| / max |HF| < 1e-4) and 32 greedy tokens, token for token, not
stopping at the end token (ours decode step by step through the paged KV cache, HF with its own cache).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from reference.model.llama import Chunk
from reference.model.weights import packaged_path
from tests.smollm import smollm2_model, smollm2_tokenizer

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three prime numbers."}],
    [{"role": "user", "content": "Explain what a paged KV cache is, in one paragraph."}],
    [{"role": "user", "content": "Translate 'good morning' into German and Spanish."}],
]
NEW_TOKENS = 32


@functools.cache
def hf_model():
    from transformers import AutoModelForCausalLM

    os.environ["HF_HUB_OFFLINE"] = "1"
    gguf = packaged_path("smollm2")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


def ours_greedy(ids: list[int], n: int) -> list[int]:
    model = smollm2_model()
    cache = model.new_cache(num_blocks=(len(ids) + n) // 16 + 2, block_size=16)
    table = list(range(cache.num_blocks))
    out, tokens = [], list(ids)
    for _ in range(n):
        start = len(tokens) - 1 if out else 0
        logits = model.forward([Chunk(tokens[start:], start, table)], cache)[0]
        out.append(int(np.argmax(logits)))
        tokens.append(out[-1])
    return out


def hf_greedy(ids: list[int], n: int) -> list[int]:
    """HF greedy decoding with its own KV cache, past the end token too (as ``ours_greedy``)."""
    out, past, step = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            result = hf_model()(step, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def check_prompt(index: int) -> None:
    ids = smollm2_tokenizer().encode_chat(PROMPTS[index])
    with torch.no_grad():
        ref_logits = hf_model()(torch.tensor([ids])).logits[0].numpy()
    ref_tokens = hf_greedy(ids, NEW_TOKENS)
    ours = smollm2_model().forward_contiguous(ids)
    rel = np.abs(ours - ref_logits).max() / np.abs(ref_logits).max()
    print(f"prompt {index}: {len(ids)} tokens, max relative logit error {rel:.2e}")
    assert rel < 1e-4
    assert ours_greedy(ids, NEW_TOKENS) == ref_tokens


def test_first_prompt_agrees_with_transformers():
    check_prompt(0)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(1, len(PROMPTS)))
def test_other_prompts_agree_with_transformers(index):
    check_prompt(index)
