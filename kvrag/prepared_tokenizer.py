"""The tokenizer class a prepared GGUF folder names: transformers' generic one where it tokenizes alike.

transformers builds a GGUF file's tokenizer with the model's own class. Some of those classes (Gemma's, among
others) rebuild the Rust backend from a Python copy of the vocabulary and merges at every load and keep that copy,
which for a large vocabulary outweighs the backend itself (measured: docs/results/epyc/gguf_resident.md). The
generic class (``TokenizersBackend``) loads ``tokenizer.json`` as it is and keeps nothing else.
:func:`use_generic_class` switches a prepared folder to it only after checking, on probe texts, that it gives the
same ids, decoded texts, special tokens and rendered chat prompts as the model's class; otherwise the folder keeps
the model's class.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

GENERIC_CLASS = "TokenizersBackend"
"""transformers' tokenizer class for a ``tokenizer.json`` used as it is."""

PROBE_TEXTS = (
    "The capital of France is",
    "  Leading spaces,\ttabs\nand\n\nblank lines   ",
    "Ünïcödé, emoji 🎉🚀, 中文, 日本語, русский, العربية",
    "Numbers 1234567890, 3.14159, -42, 1e-9; code: def f(x): return x**2  # ok",
    "Question: who wrote it?\nAnswer:",
)


def _probes(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The probe texts, the special tokens on their own and inside text."""
    special = sorted({str(t) for t in tokenizer.all_special_tokens})
    added = sorted(str(t) for t in tokenizer.get_added_vocab())[:64]
    return [*PROBE_TEXTS, *special, *added, " ".join(f"x{t}y" for t in special[:16])]


def _chat(tokenizer: PreTrainedTokenizerBase) -> object:
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Who?"}]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001  # a template's own error: compared as such
        return f"{type(e).__name__}: {e}"


def behaviour(tokenizer: PreTrainedTokenizerBase) -> dict[str, object]:
    """What decides the token ids and texts kvrag gets from ``tokenizer``, on :data:`PROBE_TEXTS` and the special
    and added tokens: ids with and without special tokens, decoded texts, special tokens and ids, length, chat, and
    the padding and truncation sides (a batch's layout for code that pads)."""
    texts = _probes(tokenizer)
    ids = [tokenizer(t).input_ids for t in texts]
    return {
        "ids": ids,
        "plain": [tokenizer(t, add_special_tokens=False).input_ids for t in texts],
        "decoded": [tokenizer.decode(i) for i in ids],
        "decoded_skip": [tokenizer.decode(i, skip_special_tokens=True) for i in ids],
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "special_ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id],
        "length": len(tokenizer),
        "chat": _chat(tokenizer),
        "sides": [tokenizer.padding_side, tokenizer.truncation_side],
    }


def use_generic_class(folder: Path, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Make ``folder`` (a tokenizer saved by ``tokenizer.save_pretrained``) name :data:`GENERIC_CLASS` when the
    generic class loads it with ``tokenizer``'s :func:`behaviour`; returns whether it does. Left as it was for a
    slow tokenizer, a tokenizer already of that class, or any difference."""
    path = folder / "tokenizer_config.json"
    if not tokenizer.is_fast or type(tokenizer).__name__ == GENERIC_CLASS or not path.is_file():
        return False
    from transformers import AutoTokenizer

    original = path.read_text()
    config = json.loads(original)
    config["tokenizer_class"] = GENERIC_CLASS
    config["padding_side"], config["truncation_side"] = tokenizer.padding_side, tokenizer.truncation_side  # class defaults
    path.write_text(json.dumps(config, indent=2, sort_keys=True))
    try:
        generic = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        same = type(generic).__name__ == GENERIC_CLASS and behaviour(generic) == behaviour(tokenizer)
    except (OSError, ValueError, TypeError, KeyError) as e:
        log.info("the generic tokenizer class cannot load %s (%s); keeping %s", folder, e, type(tokenizer).__name__)
        same = False
    if not same:
        path.write_text(original)
    return same


__all__ = ["GENERIC_CLASS", "PROBE_TEXTS", "behaviour", "use_generic_class"]
