"""A prepared GGUF folder names transformers' generic tokenizer class only where it tokenizes alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvrag import prepared_tokenizer
from kvrag.prepared_tokenizer import GENERIC_CLASS, behaviour, use_generic_class


def _gemma_tokenizer():  # noqa: ANN202  # transformers' GemmaTokenizer: rebuilds its backend from Python copies
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzTFQC?:.,", "▁t", "he", "▁the", "▁c", "ap"]
    tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "c"), ("a", "p")]
    return GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)


def _saved(tmp_path: Path):  # noqa: ANN202
    tok = _gemma_tokenizer()
    tok.save_pretrained(tmp_path)
    return tok


def test_a_rebuilding_class_is_switched_to_the_generic_one_that_tokenizes_alike(tmp_path: Path) -> None:
    tok = _saved(tmp_path)
    assert isinstance(tok._merges, list) and tok._merges  # the Python copy the generic class does not keep
    assert use_generic_class(tmp_path, tok)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == GENERIC_CLASS
    generic = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert type(generic).__name__ == GENERIC_CLASS
    assert getattr(generic, "_merges", None) is None
    assert behaviour(generic) == behaviour(tok)
    assert generic.padding_side == tok.padding_side == "left"  # the model's class's default, written for the generic
    text = "The capital? Unseen: ü 🎉 <mask>"
    assert generic(text).input_ids == tok(text).input_ids


def test_a_difference_keeps_the_models_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = _saved(tmp_path)
    before = (tmp_path / "tokenizer_config.json").read_bytes()
    real = prepared_tokenizer.behaviour
    monkeypatch.setattr(prepared_tokenizer, "behaviour",
                        lambda t: {**real(t), "length": -1} if type(t).__name__ == GENERIC_CLASS else real(t))
    assert not use_generic_class(tmp_path, tok)
    assert (tmp_path / "tokenizer_config.json").read_bytes() == before
    assert type(AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)).__name__ == "GemmaTokenizer"


def test_a_generic_or_unreadable_tokenizer_is_left_alone(tmp_path: Path) -> None:
    tok = _saved(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")  # the generic class cannot load it: nothing switched
    before = (tmp_path / "tokenizer_config.json").read_bytes()
    assert not use_generic_class(tmp_path, tok)
    assert (tmp_path / "tokenizer_config.json").read_bytes() == before
    generic_dir = tmp_path / "generic"
    _saved(generic_dir)
    assert use_generic_class(generic_dir, tok)
    generic = AutoTokenizer.from_pretrained(generic_dir, local_files_only=True)
    again = (generic_dir / "tokenizer_config.json").read_bytes()
    assert not use_generic_class(generic_dir, generic)  # already the generic class
    assert (generic_dir / "tokenizer_config.json").read_bytes() == again
