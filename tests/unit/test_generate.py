"""Per-request decoding state: incremental detokenization, multi-byte characters, stop strings, EOS."""

from __future__ import annotations

import random

import pytest
import torch

from kvrag.config import GenerationConfig
from kvrag.engine.generate import DecodeState, IncrementalDetokenizer
from kvrag_testing.tiny import tiny_tokenizer

EOS = 4  # <|im_end|> of the tiny tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def byte_tok():
    """A byte-level tokenizer with one token per byte (all 256), so a multi-byte character spans several ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def _incremental(tokenizer, ids: list[int]) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(tokenizer)
    parts = [d.push(i) for i in ids]
    return parts, "".join(parts) + d.flush()


def test_incremental_text_equals_whole_decode_on_random_ids(tok, byte_tok) -> None:
    rng = random.Random(0)
    for tokenizer in (tok, byte_tok):
        for _ in range(200):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
            assert _incremental(tokenizer, ids)[1] == tokenizer.decode(ids, skip_special_tokens=True)


def test_multibyte_characters_are_emitted_whole(byte_tok) -> None:
    text = "a日本🙂é b"
    ids = byte_tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())  # one id per byte
    parts, whole = _incremental(byte_tok, ids)
    assert whole == text
    assert all("\ufffd" not in p for p in parts)
    assert [p for p in parts if p] == ["a", "日", "本", "🙂", "é", " ", "b"]


def test_incomplete_character_at_the_end_is_flushed(byte_tok) -> None:
    ids = byte_tok("ok🙂", add_special_tokens=False)["input_ids"][:-1]  # the emoji's last byte missing
    parts, whole = _incremental(byte_tok, ids)
    assert "".join(parts) == "ok" and whole == byte_tok.decode(ids) and whole.endswith("\ufffd")


def _one_hot(t: int, v: int) -> torch.Tensor:
    x = torch.full((v,), -10.0)
    x[t] = 10.0
    return x


def _run(tokenizer, ids: list[int], cfg: GenerationConfig) -> tuple[str, list[int], list[str]]:
    """Drive a DecodeState with logits that pick ``ids`` in turn; the answer, tokens kept and deltas."""
    st = DecodeState(tokenizer, cfg, [EOS])
    deltas, toks = [], []
    for t in ids:
        for tid, delta in st.advance(_one_hot(t, len(tokenizer))):
            if tid >= 0:
                toks.append(tid)
            deltas.append(delta)
        if st.finished:
            break
    return "".join(deltas), toks, deltas


def test_stop_strings_cut_across_token_boundaries(tok) -> None:
    text = "Paris is the capital of France. Berlin is"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for stop in ("capital", "l of Fr", ". B", "is", "zzz"):
        got, _, deltas = _run(tok, ids, GenerationConfig(max_new_tokens=100, stop=(stop,)))
        whole = tok.decode(ids)
        assert got == (whole[: whole.find(stop)] if stop in whole else whole)
        shown = ""
        for d in deltas:  # nothing shown is ever taken back, and no prefix of the stop is shown before it ends
            shown += d
            assert stop not in shown


def test_eos_ends_and_is_not_returned_and_held_back_text_is_flushed(tok) -> None:
    ids = tok("the capital", add_special_tokens=False)["input_ids"]
    got, toks, _ = _run(tok, [*ids, EOS, *ids], GenerationConfig(max_new_tokens=100, stop=("capitals",)))
    assert got == "the capital" and toks == ids  # "capital" was held back (a prefix of the stop), then flushed


def test_max_new_tokens_and_seeded_sampling(tok) -> None:
    ids = tok("the quick brown fox jumps", add_special_tokens=False)["input_ids"]
    got, toks, _ = _run(tok, ids, GenerationConfig(max_new_tokens=3))
    assert toks == ids[:3] and got == tok.decode(ids[:3])
    cfg = GenerationConfig(max_new_tokens=50, do_sample=True, temperature=0.9, top_k=20, top_p=0.9, seed=7)
    logits = torch.randn(40, len(tok), generator=torch.Generator().manual_seed(1))
    runs = []
    for _ in range(2):
        st = DecodeState(tok, cfg, [])
        runs.append([t for row in logits for t, _ in st.advance(row) if t >= 0])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_the_smallest_top_p_is_greedy_also_between_tied_tokens() -> None:
    """Two tokens with exactly equal largest logits (it happens in bfloat16): top_p -> 0 keeps the one argmax
    (greedy, ``model.generate``) picks, the lower index, in a large vocabulary where an unstable sort often puts the
    other first."""
    from kvrag.engine.generate import select_token

    gen = torch.Generator().manual_seed(0)
    cfg = GenerationConfig(max_new_tokens=1, do_sample=True, temperature=1.0, top_p=1e-6)
    for seed in range(20):
        x = torch.randn(49152, generator=torch.Generator().manual_seed(seed))
        i, j = sorted(random.Random(seed).sample(range(49152), 2))
        x[i] = x[j] = 10.0
        assert select_token(x.clone(), cfg, gen) == int(torch.argmax(x)) == i
