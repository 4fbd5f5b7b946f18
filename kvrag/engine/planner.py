"""Pure planning: split a prompt into [text | cached chunk]* + suffix and lay out global positions.

No tensors and no model here, so the splitting rules are unit-testable on their own. Registered chunks are found
by exact substring search of their rendered text (never fuzzy); their stored token ids are spliced in, so the
joined prompt is never re-tokenized.
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


def plan_pieces(pieces: Sequence[TextPiece], tokenize: Tokenize, token_ids_of: Callable[[str], Sequence[int]] | None = None,
                registered: int | None = None) -> Plan:
    """Tokenize pieces (chunks through ``token_ids_of`` when given: the stored, fixed ids) and assign positions.

    Raises:
        ConfigError: the suffix is empty (there must be something after the last chunk to prefill).
    """
    segs: list[PlannedSegment] = []
    pos = 0
    found = 0
    for p in pieces:
        if p.kind == "chunk":
            found += 1
            ids = tuple(token_ids_of(p.text)) if token_ids_of is not None else tuple(tokenize(p.text))
        else:
            ids = tuple(tokenize(p.text)) if p.text else ()
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
                token_ids_of: Callable[[str], Sequence[int]] | None = None) -> Plan:
    """Split + plan in one step (see :func:`split_prompt` and :func:`plan_pieces`)."""
    pieces, _ = split_prompt(prompt, chunk_texts)
    return plan_pieces(pieces, tokenize, token_ids_of, registered=len({t for t in chunk_texts if t and t.strip()}))
