"""kvrag.fingerprint: model, weights and tokenizer identities (what cache keys and repairers are tied to)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kvrag import fingerprint
from kvrag.fingerprint import model_fingerprint, tokenizer_fingerprint, weights_fingerprint
from kvrag_testing.tiny import CHAT_TEMPLATE, tiny_model, tiny_tokenizer


def test_model_fingerprint_stable_across_builds() -> None:
    assert tiny_model("qwen2", seed=3).fingerprint == tiny_model("qwen2", seed=3).fingerprint
    assert tiny_model("qwen2", seed=3).fingerprint != tiny_model("qwen2", seed=4).fingerprint
    assert tiny_model("llama").fingerprint != tiny_model("mistral").fingerprint  # same weights, other architecture


def test_model_fingerprint_changes_with_one_weight() -> None:
    lm = tiny_model("llama")
    before = model_fingerprint(lm.model, torch.float32)
    assert before == lm.fingerprint and len(before) == 64
    w = lm.model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        w[17, 5] = torch.nextafter(w[17, 5], torch.tensor(1.0))  # one ulp, one element, not a sampled one
    assert model_fingerprint(lm.model, torch.float32) != before
    with torch.no_grad():
        w[17, 5] = torch.nextafter(w[17, 5], torch.tensor(-1.0))
    assert model_fingerprint(lm.model, torch.float32) == before


def test_model_fingerprint_changes_with_swapped_rows() -> None:
    lm = tiny_model("llama")
    before = lm.fingerprint
    w = lm.model.model.embed_tokens.weight
    with torch.no_grad():
        w[[0, 1]] = w[[1, 0]].clone()  # same multiset of values: caught by the strided sample
    assert model_fingerprint(lm.model) != before


def test_model_fingerprint_changes_with_dtype() -> None:
    lm = tiny_model("qwen3")
    assert model_fingerprint(lm.model, torch.bfloat16) != model_fingerprint(lm.model, torch.float32)
    bf = tiny_model("qwen3", dtype=torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf.fingerprint != lm.fingerprint


def test_model_fingerprint_ignores_bookkeeping() -> None:
    lm = tiny_model("llama")
    lm.model.config._name_or_path = "/somewhere/else"
    lm.model.config.use_cache = False
    assert model_fingerprint(lm.model, torch.float32) == lm.fingerprint
    lm.model.config.rms_norm_eps = 1e-3  # changes what the network computes
    assert model_fingerprint(lm.model, torch.float32) != lm.fingerprint


def test_tokenizer_fingerprint() -> None:
    a, b = tiny_tokenizer(), tiny_tokenizer()
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    other = tiny_tokenizer(chat_template=CHAT_TEMPLATE.replace("assistant", "model"))
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(a)
    assert tokenizer_fingerprint(tiny_tokenizer(chat_template=None)) != tokenizer_fingerprint(a)
    b.add_tokens(["<extra>"])
    assert tokenizer_fingerprint(b) != tokenizer_fingerprint(a)
    c = tiny_tokenizer()
    c.backend_tokenizer.enable_truncation(16)  # runtime setting, does not change token ids of a chunk
    assert tokenizer_fingerprint(c) == tokenizer_fingerprint(a)


def test_tokenizer_fingerprint_memo_is_the_digest_and_follows_the_files(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A prepared folder keeps its tokenizer's digest (a 262K-token vocabulary is not serialized on every load); the
    memo answers only for a tokenizer loaded from that folder, as its files and runtime state are."""
    tiny_tokenizer().save_pretrained(tmp_path)
    memo = tmp_path / "weights_digests.json"
    load = lambda: AutoTokenizer.from_pretrained(str(tmp_path))  # noqa: E731
    truth = tokenizer_fingerprint(load())
    assert tokenizer_fingerprint(load(), memo) == truth  # computed, then kept
    assert [k for k in json.loads(memo.read_text()) if k.startswith("tokenizer-fp")]
    calls: list[object] = []
    real = fingerprint._tokenizer_digest
    monkeypatch.setattr(fingerprint, "_tokenizer_digest", lambda t: calls.append(t) or real(t))
    assert tokenizer_fingerprint(load(), memo) == truth and calls == []  # from the memo
    changed = load()
    changed.chat_template = "{{ messages }}"  # runtime state is in the key
    assert tokenizer_fingerprint(changed, memo) == tokenizer_fingerprint(changed) != truth
    grown = load()
    grown.add_tokens(["<extra>"])
    assert tokenizer_fingerprint(grown, memo) == tokenizer_fingerprint(grown) != truth
    # an edited file (another vocabulary written in its place) is digested again
    tiny_tokenizer(vocab_size=200).save_pretrained(tmp_path)
    os.utime(tmp_path / "tokenizer.json", ns=(1, 1))
    edited = load()
    assert tokenizer_fingerprint(edited, memo) == tokenizer_fingerprint(edited) != truth
    # a tokenizer from another folder never reads this memo
    other = tmp_path / "other"
    tiny_tokenizer().save_pretrained(other)
    calls.clear()
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(other)), memo) == truth and len(calls) == 1


def test_weights_fingerprint_is_dtype_independent() -> None:
    lm = tiny_model("qwen2", seed=3)
    bf = tiny_model("qwen2", seed=3, dtype=torch.bfloat16)
    assert weights_fingerprint(lm.model) == weights_fingerprint(bf.model)
    assert weights_fingerprint(lm.model) != weights_fingerprint(tiny_model("qwen2", seed=4).model)
