"""Planner: pure splitting and layout (no model)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrag.engine.planner import TextPiece, plan_pieces, plan_prompt, split_prompt
from kvrag.errors import ConfigError


def tok(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_split_finds_chunks_in_order() -> None:
    prompt = "SYS A-chunk mid B-chunk Q?"
    pieces, found = split_prompt(prompt, ["B-chunk", "A-chunk", "missing"])
    assert found == 2
    assert [p.kind for p in pieces] == ["prefix", "chunk", "text", "chunk", "suffix"]
    assert [p.text for p in pieces] == ["SYS ", "A-chunk", " mid ", "B-chunk", " Q?"]
    assert "".join(p.text for p in pieces) == prompt


def test_longer_chunk_claims_first_and_no_overlap() -> None:
    pieces, found = split_prompt("xx abcdef yy abc zz", ["abc", "abcdef"])
    assert found == 2
    assert [p.text for p in pieces if p.kind == "chunk"] == ["abcdef", "abc"]


def test_duplicate_registration_counts_once_and_empty_ignored() -> None:
    plan = plan_prompt("pre CHUNK post", ["CHUNK", "CHUNK", "", "   "], tok)
    assert plan.registered == 1 and plan.found == 1


def test_positions_are_contiguous() -> None:
    plan = plan_prompt("pre C1 and C2 suffix", ["C1", "C2"], tok)
    pos = 0
    for s in (*plan.context, plan.suffix):
        assert s.start == pos
        pos = s.end
    assert plan.total_len == len("pre C1 and C2 suffix")
    assert plan.chunk_tokens == 4


def test_stored_ids_are_spliced_not_retokenized() -> None:
    plan = plan_prompt("pre CHUNK post", ["CHUNK"], tok, token_ids_of=lambda t: [7, 7], align=False)
    chunk = [s for s in plan.context if s.kind == "chunk"][0]
    assert chunk.token_ids == (7, 7)


def test_a_chunk_ending_the_prompt_is_prefilled_as_its_suffix() -> None:
    # a served prompt is searched for every registered text: one that ends it (a chat template's generation
    # prompt registered as a "passage") must not make every request fail
    plan = plan_prompt("pre CHUNK", ["CHUNK"], tok)
    assert plan.found == 0 and plan.registered == 1 and plan.context_len + len(plan.suffix.token_ids) == len(
        tok("pre CHUNK")) and plan.suffix.token_ids
    nested = plan_prompt("pre\nassistant\n", ["\nassistant\n", "assistant\n"], tok)  # one ends the other
    assert nested.found == 0 and nested.registered == 2 and nested.suffix.token_ids
    both = plan_prompt("x A pre B", ["A", "B"], tok)
    assert both.found == 1 and [s.text for s in both.context if s.kind == "chunk"] == ["A"]
    with pytest.raises(ConfigError, match="after the last chunk"):  # explicit parts still say so
        plan_pieces([TextPiece("prefix", "pre "), TextPiece("chunk", "CHUNK")], tok)


def test_text_at_the_prompts_start_is_its_prefix_never_a_chunk() -> None:
    """A registered text that starts the prompt (a client registered the chat template's "<|im_start|>system\n",
    which starts every chat) was spliced at position 0: its cache, computed after the chunk prefix, holds no
    attention sink, and every later answer of the server came out empty or garbled."""
    plan = plan_prompt("HEAD body. Question?", ["HEAD", "body."], tok)
    assert plan.found == 1 and [(s.kind, s.text) for s in plan.context][0] == ("prefix", "HEAD ")
    assert [s.text for s in plan.context if s.kind == "chunk"] == ["body."]
    again = plan_prompt("HEAD x HEAD y?", ["HEAD"], tok)  # a later occurrence is still found
    assert again.found == 1 and [s.start for s in again.context if s.kind == "chunk"] == [len(tok("HEAD x "))]
    parts = plan_pieces([TextPiece("prefix", ""), TextPiece("chunk", "HEAD"), TextPiece("suffix", " q?")], tok)
    assert parts.context[0].kind == "chunk"  # plan_pieces as given; the engine's plan_parts moves it (tested there)


def test_no_chunk_moves_text_to_suffix() -> None:
    plan = plan_prompt("just a prompt", [], tok)
    assert plan.context == () and plan.suffix.text == "just a prompt" and plan.found == 0


def test_empty_prompt_refused() -> None:
    with pytest.raises(ConfigError, match="empty"):
        plan_pieces([], tok)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.text(alphabet="abcXYZ ", min_size=1, max_size=6), min_size=0, max_size=4),
    st.lists(st.text(alphabet="abcXYZ ", min_size=0, max_size=8), min_size=1, max_size=6),
)
def test_split_reassembles_exactly(chunks: list[str], fillers: list[str]) -> None:
    prompt = "".join(f + (chunks[i] if i < len(chunks) else "") for i, f in enumerate(fillers))
    pieces, found = split_prompt(prompt, chunks)
    assert "".join(p.text for p in pieces) == prompt
    assert sum(p.kind == "chunk" for p in pieces) == found
    for p in pieces:
        if p.kind == "chunk":
            assert p.text in chunks


# ------------------------------------------------------------------ alignment with the whole-prompt tokenization


def merging_tok(text: str) -> list[int]:
    """A context-dependent toy tokenizer: 'ab' is one token (1000), ' b' too (1001: like BPE's leading-space
    merge, e.g. a passage after indentation), everything else one token per character, and a run of two newlines is
    one token (2000) only at the very end of the text (like byte-level BPE's trailing-whitespace rule)."""
    out: list[int] = []
    i = 0
    while i < len(text):
        if text.startswith("ab", i):
            out.append(1000)
            i += 2
        elif text.startswith(" b", i):
            out.append(1001)
            i += 2
        elif text.startswith("\n\n", i) and i + 2 == len(text):
            out.append(2000)
            i += 2
        else:
            out.append(ord(text[i]))
            i += 1
    return out


def test_alignment_makes_plan_ids_equal_the_whole_tokenization() -> None:
    prompt = "sys: CHUNK-1\n\nCHUNK-2\n\nQ?"
    plan = plan_prompt(prompt, ["CHUNK-1", "CHUNK-2"], merging_tok)
    ids = [t for s in (*plan.context, plan.suffix) for t in s.token_ids]
    assert ids == merging_tok(prompt)
    assert plan.found == 2  # both chunks still splice: their own ids occur verbatim
    unaligned = plan_prompt(prompt, ["CHUNK-1", "CHUNK-2"], merging_tok, align=False)
    assert [t for s in (*unaligned.context, unaligned.suffix) for t in s.token_ids] != ids


def test_chunk_whose_boundary_merges() -> None:
    # alone "bcd" -> [b, c, d]; after "x " the ' b' merge swallows its first character
    strict = plan_prompt("x bcd tail", ["bcd"], merging_tok, strict=True)  # prefilled as text
    assert strict.found == 0 and strict.registered == 1 and strict.inexact_chunks == 0
    assert [t for s in (*strict.context, strict.suffix) for t in s.token_ids] == merging_tok("x bcd tail")
    loose = plan_prompt("x bcd tail", ["bcd"], merging_tok)  # default: spliced with its own ids, reported
    assert loose.found == 1 and loose.inexact_chunks == 1
    assert [t for s in (*loose.context, loose.suffix) for t in s.token_ids] == merging_tok("x ") + merging_tok(
        "bcd") + merging_tok(" tail")


def test_a_chunk_is_never_claimed_inside_a_word() -> None:
    """A one-word chunk ("on") claimed its first occurrence, inside "only": spliced mid-word with its own ids. It
    now claims the first occurrence that cuts no word, or none."""
    prompt = "Answer only with one word.\n\nContext: on\n\nQ?"
    pieces, found = split_prompt(prompt, ["on"])
    assert found == 1 and [p.text for p in pieces if p.kind == "chunk"] == ["on"]
    assert "".join(p.text for p in pieces[:2]) == "Answer only with one word.\n\nContext: on"
    assert split_prompt("Answer only with one word.", ["on"])[1] == 0
    assert split_prompt("on the way, on", ["on"])[1] == 1 and split_prompt("(on)", ["on"])[1] == 1
    assert split_prompt("x\n\nPassage one.\n\nQ", ["\n\nPassage one."])[1] == 1  # punctuation ends are fine
    assert split_prompt("以下是文章東京是日本的首都。問題", ["東京是日本的首都。"])[1] == 1  # no spaces to tell words by


def test_exact_holds_named_chunks_to_the_strict_rule() -> None:
    # "bcd" merges with its neighbour, "CHUNK" does not: only the texts named in exact are held to exact splicing
    prompt = "x bcd CHUNK\n\nQ?"
    loose = plan_prompt(prompt, ["bcd", "CHUNK"], merging_tok)
    assert (loose.found, loose.inexact_chunks) == (2, 1)
    held = plan_prompt(prompt, ["bcd", "CHUNK"], merging_tok, exact={"bcd"})
    assert (held.found, held.registered, held.inexact_chunks) == (1, 1, 0)  # offered by content, not spliced
    assert [s.text for s in held.context if s.kind == "chunk"] == ["CHUNK"]
    assert list(held.token_ids) == merging_tok(prompt)
    both = plan_prompt(prompt, ["bcd", "CHUNK"], merging_tok, exact={"bcd", "CHUNK"})
    assert (both.found, both.inexact_chunks) == (1, 0)  # an exact chunk is spliced as before


@settings(max_examples=200, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="ab\n c", min_size=1, max_size=8), min_size=1, max_size=4),
    fillers=st.lists(st.text(alphabet="ab\n x", max_size=5), min_size=5, max_size=5),
)
def test_aligned_plan_always_equals_whole_tokenization(chunks: list[str], fillers: list[str]) -> None:
    prompt = fillers[0] + "".join(c + f for c, f in zip(chunks, fillers[1:], strict=False)) + "?END"
    plan = plan_prompt(prompt, chunks, merging_tok, strict=True)
    assert plan.inexact_chunks == 0
    assert [t for s in (*plan.context, plan.suffix) for t in s.token_ids] == merging_tok(prompt)
    loose = plan_prompt(prompt, chunks, merging_tok)
    assert loose.found >= plan.found
    if loose.inexact_chunks == 0:  # then nothing was spliced loosely and the ids are the prompt's
        assert [t for s in (*loose.context, loose.suffix) for t in s.token_ids] == merging_tok(prompt)
    pos = 0
    for s in (*plan.context, plan.suffix):
        assert s.start == pos
        pos = s.end
    for s in plan.context:  # a spliced chunk carries exactly its own ids
        if s.kind == "chunk":
            assert list(s.token_ids) == merging_tok(s.text)


def test_prompt_tokenized_plan_is_what_full_prefills() -> None:
    """``Plan.as_prompt_tokenized``: the prompt's own ids, nothing spliced (``full``'s input), the suffix length
    kept; a plan whose ids already are the prompt's is returned as it is."""
    loose = plan_prompt("x bcd tail", ["bcd"], merging_tok)
    assert loose.inexact_chunks == 1 and list(loose.token_ids) != merging_tok("x bcd tail")
    whole = loose.as_prompt_tokenized()
    assert list(whole.token_ids) == merging_tok("x bcd tail")
    assert whole.inexact_chunks == 0 and whole.found == loose.found and whole.registered == loose.registered
    assert all(s.kind != "chunk" for s in whole.context)
    assert len(whole.suffix.token_ids) == len(loose.suffix.token_ids) and whole.suffix.start == whole.context_len
    exact = plan_prompt("sys: CHUNK-1\n\nCHUNK-2\n\nQ?", ["CHUNK-1", "CHUNK-2"], merging_tok)
    assert exact.inexact_chunks == 0 and exact.as_prompt_tokenized() is exact
