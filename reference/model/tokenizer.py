"""The checkpoint's own tokenizer and chat template.

A GGUF file of a byte-level BPE model (``tokenizer.ggml.model == "gpt2"``) carries the vocabulary,
the merge list, the ids of special tokens, a pre-tokenizer name and a Jinja chat template; we build
a ``tokenizers`` BPE from them. A Hugging Face folder carries ``tokenizer.json`` (and the template
in ``tokenizer_config.json``). The pre-tokenizer splits text before BPE: GPT-2's regex on bytes,
with digits split one by one for SmolLM ("smollm"), or Llama 3's regex ("llama-bpe").
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from reference import jsonsafe
from reference.model.carried import carried_entry, no_model_error
from reference.model.config import ConfigError
from reference.model.gguf_io import GGUFFile
from reference.model.weights import WeightSource, open_weights

LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CONTROL = 3  # GGUF token_type of control (special) tokens


class TokenizerError(ConfigError):
    """The checkpoint's tokenizer or chat template is missing or unusable."""


class Tokenizer:
    def __init__(self, backend: Any, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, eos_token_ids: Sequence[int] = ()):
        self.backend = backend  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_token_ids = tuple(eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) are
        recognised."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """Render a conversation with the checkpoint's Jinja template (as transformers does)."""
        if not self.chat_template:
            raise TokenizerError("this checkpoint has no chat template")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TokenizerError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


def load_tokenizer(source: str | Path | WeightSource = "smollm2") -> Tokenizer:
    """The tokenizer of a packaged model, a GGUF file, a Hugging Face checkpoint folder or a
    container."""
    src = source if isinstance(source, WeightSource) else open_weights(source)
    gguf = [f for f in src.files if isinstance(f, GGUFFile)]
    if gguf:
        return _from_gguf(gguf[0].metadata(), str(gguf[0].path))
    carried = carried_entry(src)  # an Unweight container carries its checkpoint's tokenizer
    if carried is not None:
        entry, where = carried
        return (
            _from_gguf(entry["gguf"], where)
            if entry["kind"] == "gguf"
            else _from_hf_files(entry["files"], where)
        )
    missing = no_model_error(src)
    if missing is not None:
        raise TokenizerError(str(missing))
    folder = Path(src.label)
    return _from_hf_folder(folder if folder.is_dir() else folder.parent)


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(
            "the tokenizer needs the 'tokenizers' package: pip install tokenizers"
        ) from None
    return tokenizers


def _from_gguf(meta: dict[str, Any], where: str) -> Tokenizer:
    tk = _tokenizers()
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(f"{where}: tokenizer model {kind!r} is not supported (only byte-level "
                             "BPE 'gpt2')")
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list):
        raise TokenizerError(f"{where}: tokenizer vocabulary or merges missing")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tk.Tokenizer(tk.models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                         byte_fallback=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        backend.pre_tokenizer = tk.pre_tokenizers.Sequence(
            [tk.pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "llama-bpe":
        split = tk.pre_tokenizers.Split(tk.Regex(LLAMA3_REGEX), behavior="isolated")
        backend.pre_tokenizer = tk.pre_tokenizers.Sequence(
            [split, tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in ("default", "gpt2"):
        backend.pre_tokenizer = byte_level
    else:
        raise TokenizerError(f"{where}: pre-tokenizer {pre!r} is not supported (smollm, llama-bpe, "
                             "gpt2)")
    backend.decoder = tk.decoders.ByteLevel()
    special = [tk.AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types, strict=False) if kind == CONTROL]
    backend.add_special_tokens(special)

    def name(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if isinstance(i, int) and 0 <= i < len(tokens) else None

    eos = meta.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(backend, meta.get("tokenizer.chat_template"),
                     name("tokenizer.ggml.bos_token_id"),
                     name("tokenizer.ggml.eos_token_id"), () if eos is None else (int(eos),))


def _from_hf_folder(folder: Path) -> Tokenizer:
    if not (folder / "tokenizer.json").is_file():
        raise TokenizerError(f"{folder}: no tokenizer.json")
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    return _from_hf_files({n: (folder / n).read_text() for n in names if (folder / n).is_file()},
                          str(folder))


def _from_hf_files(files: dict[str, str], where: str) -> Tokenizer:
    """From the texts of a Hugging Face checkpoint's tokenizer files (a folder's, or a
    container's)."""
    tk = _tokenizers()
    if "tokenizer.json" not in files:
        raise TokenizerError(f"{where}: no tokenizer.json")
    try:
        backend = tk.Tokenizer.from_str(files["tokenizer.json"])
        config: dict[str, Any] = jsonsafe.loads(files.get("tokenizer_config.json", "{}"),
                                                what="tokenizer_config.json")
    except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on a malformed file
        raise TokenizerError(f"{where}: unreadable tokenizer files ({e})") from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{where}: tokenizer_config.json must hold a JSON object")

    def token(key: str) -> str | None:
        t = config.get(key)
        return t.get("content") if isinstance(t, dict) else t

    eos = token("eos_token")
    eos_id = backend.token_to_id(eos) if eos else None
    template = config.get("chat_template")
    if template is None:
        template = files.get("chat_template.jinja")
    return Tokenizer(backend, template, token("bos_token"), eos,
                     () if eos_id is None else (eos_id,))
