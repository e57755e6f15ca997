"""Shared, loaded-once SmolLM2 model and tokenizer for the engine tests (loading takes a few seconds).

Importing this module also limits BLAS to one thread: on a small shared machine a second BLAS thread
spin-waits for a busy core and makes the model ~10x slower.
"""

from __future__ import annotations

import functools

from threadpoolctl import threadpool_limits

from reference.model.llama import LlamaModel
from reference.model.tokenizer import Tokenizer, load_tokenizer

threadpool_limits(1, user_api="blas")


@functools.cache
def smollm2_model() -> LlamaModel:
    return LlamaModel.load("smollm2")


@functools.cache
def smollm2_tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")
