"""Pure planning: split a prompt into [text | cached chunk]* + suffix and lay out global positions.

No tensors and no model here, so the splitting rules are unit-testable on their own. Registered chunks are found
by exact substring search of their rendered text (never fuzzy); their stored token ids are spliced in.

Token alignment: a BPE tokenizer may tokenize a piece alone differently from the same characters inside the whole
prompt (e.g. ``"\n\n"`` is one token alone but two before a word). Given the ids of the whole prompt string, the
planner makes the plan's ids *equal* to them: every non-chunk segment takes its ids from the whole tokenization,
and a chunk is spliced only where its stored ids occur there verbatim; a chunk that does not (its boundary tokens
merge with the neighbouring text) is prefilled as ordinary text and counted as not found, which lowers the hit
rate instead of silently changing the prompt the model sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from kvrag.errors import ConfigError

Tokenize = Callable[[str], list[int]]


@dataclasses.dataclass(frozen=True)
class TextPiece:
    """A piece of the prompt string: ``chunk`` pieces are registered chunk texts found verbatim."""

    kind: str  # 'prefix' | 'chunk' | 'text' | 'suffix'
    text: str


@dataclasses.dataclass(frozen=True)
class PlannedSegment:
    """A piece with its token ids and global start position."""

    kind: str
    text: str
    token_ids: tuple[int, ...]
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The layout of one request.

    Attributes:
        context: prefix/chunk/text segments, positions 0..context_len-1.
        suffix: the tail after the last chunk, prefilled after repair.
        registered: number of registered chunk texts offered; found: how many were found in the prompt.
    """

    context: tuple[PlannedSegment, ...]
    suffix: PlannedSegment
    registered: int
    found: int

    @property
    def context_len(self) -> int:
        return self.context[-1].end if self.context else 0

    @property
    def total_len(self) -> int:
        return self.suffix.end

    @property
    def chunk_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.context if s.kind == "chunk")


def split_prompt(prompt: str, chunk_texts: Sequence[str]) -> tuple[list[TextPiece], int]:
    """Split ``prompt`` around verbatim occurrences of ``chunk_texts``.

    Longer chunks are matched first; each registered text claims its first occurrence that does not overlap an
    already claimed span. Text before the first chunk is the 'prefix', text after the last chunk is the
    'suffix', text between chunks is 'text'. With no chunk found the whole prompt is one prefix + empty suffix
    handled by the caller (everything is prefilled normally).

    Returns:
        (pieces, number of registered chunks found).
    """
    spans: list[tuple[int, int]] = []
    uniq = sorted({t for t in chunk_texts if t and t.strip()}, key=len, reverse=True)
    for text in uniq:
        pos = prompt.find(text)
        while pos >= 0:
            end = pos + len(text)
            if all(end <= s or pos >= e for s, e in spans):
                spans.append((pos, end))
                break
            pos = prompt.find(text, pos + 1)
    spans.sort()
    pieces: list[TextPiece] = []
    cur = 0
    for i, (s, e) in enumerate(spans):
        if s > cur:
            pieces.append(TextPiece("prefix" if i == 0 else "text", prompt[cur:s]))
        pieces.append(TextPiece("chunk", prompt[s:e]))
        cur = e
    pieces.append(TextPiece("suffix", prompt[cur:]))
    return pieces, len(spans)


def find_ids(haystack: Sequence[int], needle: Sequence[int], start: int = 0) -> int | None:
    """First index ``j >= start`` with ``haystack[j:j+len(needle)] == needle`` (None if there is none)."""
    n = len(needle)
    if n == 0:
        return None
    first = needle[0]
    hay = list(haystack)
    nee = list(needle)
    j = start
    last = len(hay) - n
    while j <= last:
        try:
            j = hay.index(first, j, last + 1)
        except ValueError:
            return None
        if hay[j : j + n] == nee:
            return j
        j += 1
    return None


def align_to_whole(
    pieces: Sequence[tuple[TextPiece, tuple[int, ...]]],
    whole: Sequence[int],
    decode: Callable[[Sequence[int]], str] | None = None,
) -> list[tuple[TextPiece, tuple[int, ...]]]:
    """Re-derive (piece, ids) so that the concatenated ids equal ``whole`` (see the module docstring).

    Chunks are matched in order, each at the first occurrence of its ids after the previous match; the ids between
    matches become one 'prefix'/'text' piece and the rest the 'suffix'. A matched chunk's ids are its own ids, so
    splicing its cache is exact for the prompt as tokenized.
    """
    whole = tuple(whole)
    out: list[tuple[TextPiece, tuple[int, ...]]] = []
    start = 0
    pending: list[str] = []

    def flush(end: int, kind: str) -> None:
        ids = whole[start:end]
        if ids or kind == "suffix":
            text = decode(ids) if decode is not None else "".join(pending)
            out.append((TextPiece(kind, text), ids))

    for piece, ids in pieces:
        j = find_ids(whole, ids, start) if piece.kind == "chunk" else None
        if j is None:
            pending.append(piece.text)
            continue
        flush(j, "prefix" if not out else "text")
        out.append((piece, ids))
        start = j + len(ids)
        pending = []
    flush(len(whole), "suffix")
    return out


def plan_pieces(pieces: Sequence[TextPiece], tokenize: Tokenize, token_ids_of: Callable[[str], Sequence[int]] | None = None,
                registered: int | None = None, whole: Sequence[int] | None = None,
                decode: Callable[[Sequence[int]], str] | None = None) -> Plan:
    """Tokenize pieces (chunks through ``token_ids_of`` when given: the stored, fixed ids) and assign positions.

    Args:
        whole: the ids of the whole prompt string (``tokenize("".join(texts))``); when given, the plan's ids are
            made equal to them (:func:`align_to_whole`). Without it each piece is tokenized alone.
        decode: ids -> text, for the text of re-derived segments (else the pieces' own text is joined).

    Raises:
        ConfigError: the suffix is empty (there must be something after the last chunk to prefill).
    """
    tokenized: list[tuple[TextPiece, tuple[int, ...]]] = []
    for p in pieces:
        if p.kind == "chunk":
            ids = tuple(token_ids_of(p.text)) if token_ids_of is not None else tuple(tokenize(p.text))
        else:
            ids = tuple(tokenize(p.text)) if p.text else ()
        tokenized.append((p, ids))
    if whole is not None and tuple(t for _, ids in tokenized for t in ids) != tuple(whole):
        tokenized = align_to_whole(tokenized, whole, decode)
    segs: list[PlannedSegment] = []
    pos = 0
    found = 0
    for p, ids in tokenized:
        if p.kind == "chunk":
            found += 1
        if not ids and p.kind != "suffix":
            continue
        segs.append(PlannedSegment(p.kind, p.text, ids, pos))
        pos += len(ids)
    if not segs or segs[-1].kind != "suffix":
        segs.append(PlannedSegment("suffix", "", (), pos))
    suffix = segs[-1]
    if not suffix.token_ids:
        # Move the last context token(s) into the suffix: the model needs at least one query token to predict.
        if not segs[:-1]:
            msg = "the prompt is empty: nothing to prefill; pass a non-empty prompt or question"
            raise ConfigError(msg)
        last = segs[-2]
        if last.kind == "chunk":
            msg = ("the prompt ends with a cached chunk; kvrag needs some text after the last chunk (the question "
                   "or the generation prompt of the chat template) to prefill")
            raise ConfigError(msg)
        segs = segs[:-2] + [PlannedSegment("suffix", last.text, last.token_ids, last.start)]
        suffix = segs[-1]
    context = tuple(s for s in segs[:-1])
    return Plan(context=context, suffix=suffix, registered=registered if registered is not None else found, found=found)


def plan_prompt(prompt: str, chunk_texts: Sequence[str], tokenize: Tokenize,
                token_ids_of: Callable[[str], Sequence[int]] | None = None, *, align: bool = True,
                decode: Callable[[Sequence[int]], str] | None = None) -> Plan:
    """Split + plan in one step (see :func:`split_prompt` and :func:`plan_pieces`).

    With ``align`` (default) the plan's ids equal ``tokenize(prompt)``.
    """
    pieces, _ = split_prompt(prompt, chunk_texts)
    return plan_pieces(pieces, tokenize, token_ids_of, registered=len({t for t in chunk_texts if t and t.strip()}),
                       whole=tokenize(prompt) if align else None, decode=decode)
