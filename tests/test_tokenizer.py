"""SmolLM2's tokenizer from its GGUF file, against transformers' reading of the same file."""

from __future__ import annotations

import functools
import os

import pytest

from reference.model.tokenizer import Tokenizer, TokenizerError
from reference.model.weights import packaged_path
from reference.workload import iter_sharegpt
from tests.smollm import smollm2_tokenizer

TEXTS = ["Hello world, how are you?", "  leading spaces\n\nand\ttabs  ", "naïve café — 日本語 🤖 emoji",
         "<|im_start|>user\nHi<|im_end|>\n", "def f(x):\n    return x**2", "it's we'll they've I'M"]


@functools.cache
def hf_tokenizer():
    from transformers import AutoTokenizer

    os.environ["HF_HUB_OFFLINE"] = "1"
    gguf = packaged_path("smollm2")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def test_same_ids_as_transformers_on_text_without_digits():
    """transformers' GGUF reader drops SmolLM's digit pre-split ('smollm' pre-tokenizer in llama.cpp,
    Digits(individual_digits) in the original tokenizer.json), so texts with digits can differ there
    (e.g. whitespace before a digit); we follow the original tokenizer and compare digit-free texts."""
    texts = TEXTS + [c.prompt for c in iter_sharegpt(limit=60) if not any(ch.isdigit() for ch in c.prompt)]
    ours, hf = smollm2_tokenizer(), hf_tokenizer()
    for text in texts:
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text[:60]


def test_digits_are_split_one_by_one_and_decoding_round_trips():
    tok = smollm2_tokenizer()
    assert [tok.decode([t]) for t in tok.encode("x 2024\n\n45")] == ["x", " ", "2", "0", "2", "4", "\n\n", "4", "5"]
    for text in TEXTS + [c.prompt for c in iter_sharegpt(limit=30)]:
        assert tok.decode(tok.encode(text)) == text


def test_chat_template_matches_transformers():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ours = smollm2_tokenizer().apply_chat_template(messages)
    assert ours == hf_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert smollm2_tokenizer().encode_chat(messages)[0] == 1  # <|im_start|> is one special token


def test_missing_template_is_a_clear_error():
    tok = smollm2_tokenizer()
    bare = Tokenizer(tok.backend, None, None, None)
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_tokenizer_from_a_hugging_face_folder(tmp_path):
    """tokenizer.json + tokenizer_config.json (as transformers saves them) load the same tokenizer."""
    from reference.model.tokenizer import _from_hf_folder

    hf_tokenizer().save_pretrained(tmp_path)
    tok = _from_hf_folder(tmp_path)
    text = "Hello world, how are you?"
    assert tok.encode(text) == hf_tokenizer()(text, add_special_tokens=False)["input_ids"]
    assert tok.eos_token_ids == (2,)
    messages = [{"role": "user", "content": "Hi!"}]
    assert tok.apply_chat_template(messages) == smollm2_tokenizer().apply_chat_template(messages)
