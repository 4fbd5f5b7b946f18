"""Pure planning: split a prompt into [text | cached chunk]* + suffix and lay out global positions.

No tensors and no model here, so the splitting rules are unit-testable on their own. Registered chunks are found
by exact substring search of their rendered text (never fuzzy); their stored token ids are spliced in.

Token alignment: a BPE tokenizer may tokenize a piece alone differently from the same characters inside the whole
prompt (e.g. ``"\n\n"`` is one token alone but two before a word). Given the ids of the whole prompt string, the
planner makes the plan's ids follow them: every non-chunk segment takes its ids from the whole tokenization and
a chunk splices exactly where its stored ids occur there verbatim, so for prompts built from
:func:`kvrag.prompting.render_passage` passages the plan's ids *equal* ``tokenize(prompt)``. A chunk whose ids do
not occur (its boundary token merges with the neighbouring text, e.g. a passage placed after indentation) is
spliced anyway with its own ids and counted in ``Plan.inexact_chunks`` (the field's usual practice: reuse wins
over one boundary token), or with ``strict`` prefilled as text and not counted as found. ``exact`` names chunk
texts held to the strict rule whatever ``strict`` says (a framework adapter's chunks found by content alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from kvrag.errors import ConfigError

if TYPE_CHECKING:
    from kvrag.kv.chunk import ChunkKV

Tokenize = Callable[[str], list[int]]


@dataclasses.dataclass(frozen=True)
class TextPiece:
    """A piece of the prompt string: ``chunk`` pieces are registered chunk texts found verbatim."""

    kind: str  # 'prefix' | 'chunk' | 'text' | 'suffix'
    text: str


@dataclasses.dataclass(frozen=True)
class PlannedSegment:
    """A piece with its token ids and global start position (kind: as :class:`TextPiece`, or 'kept': an earlier
    request's K/V moved to this position, :mod:`kvrag.engine.relocate`)."""

    kind: str
    text: str
    token_ids: tuple[int, ...]
    start: int
    key: str | None = dataclasses.field(default=None, compare=False)  # cache key when known (set by the engine)

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
        inexact_chunks: spliced chunks whose own tokenization differs from the prompt string's at a boundary (their
            ids are used anyway; 0 means the plan's ids equal the tokenized prompt).
        held: caches the caller already holds, by key (used instead of a store read; filled by the engine).
        prompt_ids: the prompt string's own tokenization when the plan was made from one (what ``full`` prefills:
            :meth:`as_prompt_tokenized`); None for plans built from pieces alone.
    """

    context: tuple[PlannedSegment, ...]
    suffix: PlannedSegment
    registered: int
    found: int
    inexact_chunks: int = 0
    held: Mapping[str, ChunkKV] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    prompt_ids: tuple[int, ...] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every id of the plan in order (context, then suffix): what a reuse method's KV stands for."""
        return tuple(t for s in (*self.context, self.suffix) for t in s.token_ids)

    def as_prompt_tokenized(self) -> Plan:
        """This plan over the prompt's own tokenization, with nothing spliced: what ``full`` prefills, so that it
        generates exactly what ``model.generate`` does on the prompt string even where a chunk's boundary falls
        inside a token (``inexact_chunks > 0``). The plan itself when its ids already are the prompt's (or it has
        no prompt ids). The suffix keeps its length (at most all ids but one); ``found`` and ``registered`` are
        kept, ``inexact_chunks`` is 0 (nothing is spliced)."""
        whole = self.prompt_ids
        if whole is None or not whole or self.token_ids == whole:
            return self
        n = max(1, min(len(self.suffix.token_ids), len(whole) - 1))
        cut = len(whole) - n
        context = (PlannedSegment("prefix", "", whole[:cut], 0),) if cut else ()
        return dataclasses.replace(self, context=context, suffix=PlannedSegment("suffix", "", whole[cut:], cut),
                                   inexact_chunks=0, held={})

    @property
    def context_len(self) -> int:
        return self.context[-1].end if self.context else 0

    @property
    def positions(self) -> int:
        """The most positions the prompt's K/V take: its ids, or the prompt's own tokenization when that is longer
        (a method that recomputes everything computes over it, :meth:`as_prompt_tokenized`)."""
        if self.inexact_chunks and self.prompt_ids is not None:
            return max(self.total_len, len(self.prompt_ids))
        return self.total_len

    @property
    def total_len(self) -> int:
        return self.suffix.end

    @property
    def chunk_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.context if s.kind == "chunk")


def _in_word(c: str) -> bool:
    """A letter or digit of a script that spaces its words (Latin, Greek, Cyrillic, Armenian): elsewhere (CJK, Thai)
    text runs on without spaces, and no boundary can be told from the characters."""
    return c.isalnum() and ord(c) < 0x0590


def whole_words(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` cuts no word: at each end, the characters on the two sides are not both inside a
    word (:func:`_in_word`)."""
    return not ((start > 0 and _in_word(text[start - 1]) and _in_word(text[start]))
                or (end < len(text) and _in_word(text[end - 1]) and _in_word(text[end])))


def split_prompt(prompt: str, chunk_texts: Sequence[str]) -> tuple[list[TextPiece], int]:
    """Split ``prompt`` around verbatim occurrences of ``chunk_texts``.

    Longer chunks are matched first; each registered text claims its first occurrence that does not overlap an
    already claimed span and does not cut a word (:func:`whole_words`: a short text such as "on" inside "only" is
    the word's, not a chunk), past the prompt's first character: the prompt's first token is the attention sink
    every later token leans on, which only the leading text computed at position 0 holds (a chunk's cache follows
    the chunk prefix), so text at position 0 is the prompt's prefix, never a chunk. Text before the first chunk is
    the 'prefix', text after the last chunk is the 'suffix', text between chunks is 'text'. With no chunk found the
    whole prompt is one prefix + empty suffix handled by the caller (everything is prefilled normally).

    Returns:
        (pieces, number of registered chunks found).
    """
    spans: list[tuple[int, int]] = []
    uniq = sorted({t for t in chunk_texts if t and t.strip()}, key=len, reverse=True)
    for text in uniq:
        pos = prompt.find(text, 1)
        while pos >= 0:
            end = pos + len(text)
            if whole_words(prompt, pos, end) and all(end <= s or pos >= e for s, e in spans):
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
    hay = haystack if isinstance(haystack, tuple) else tuple(haystack)  # the planner passes tuples: no copy
    nee = tuple(needle)
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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id tuples (slice comparisons: C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common suffix of two id tuples."""
    return common_prefix(a[::-1], b[::-1])


def align_to_whole(
    pieces: Sequence[tuple[TextPiece, tuple[int, ...]]],
    whole: Sequence[int],
    decode: Callable[[Sequence[int]], str] | None = None,
    *,
    tokenize: Tokenize | None = None,
    strict: bool = True,
    exact: Collection[str] = (),
) -> list[tuple[TextPiece, tuple[int, ...], bool]]:
    """Re-derive (piece, ids, exact) so that the ids follow ``whole`` (see the module docstring).

    Chunks are matched in order, each at the first occurrence of its ids after the previous match; the ids between
    matches become one 'prefix'/'text' piece and the rest the 'suffix'. A matched chunk's ids are its own ids, so
    splicing its cache is exact for the prompt as tokenized.

    A chunk whose ids do not occur (a boundary token merges with the neighbouring text, e.g. a chunk placed after
    indentation) is, with ``strict``, left to the surrounding text (prefilled, not a hit). Without ``strict`` it is
    spliced anyway with its own ids, marked inexact (``exact=False``): the text before it is tokenized alone and
    the rest of the prompt is tokenized afresh from the chunk's end (``tokenize`` is required), so only the ids at
    that chunk's two boundaries differ from the whole-string tokenization. A chunk whose text is in ``exact`` is
    treated as with ``strict``.
    """
    if not strict and tokenize is None:
        raise ValueError("align_to_whole(strict=False) needs tokenize")
    rest = tuple(whole)  # ids of the prompt from the current resync point on
    out: list[tuple[TextPiece, tuple[int, ...], bool]] = []
    start = 0  # index into ``rest`` where the pending text begins
    pending: list[str] = []
    texts = [p.text for p, _ in pieces]

    def text_piece(ids: tuple[int, ...], kind: str) -> None:
        if ids or kind == "suffix":
            text = decode(ids) if decode is not None else "".join(pending)
            out.append((TextPiece(kind, text), ids, True))

    for i, (piece, ids) in enumerate(pieces):
        j = find_ids(rest, ids, start) if piece.kind == "chunk" else None
        if j is not None:
            text_piece(rest[start:j], "prefix" if not out else "text")
            out.append((piece, ids, True))
            start = j + len(ids)
        elif piece.kind == "chunk" and ids and not strict and piece.text not in exact:
            assert tokenize is not None
            before = "".join(pending)
            if before:
                out.append((TextPiece("prefix" if not out else "text", before), tuple(tokenize(before)), False))
            out.append((piece, ids, False))
            rest, start = tuple(tokenize("".join(texts[i + 1 :]))), 0  # resync after the chunk
        else:
            pending.append(piece.text)
            continue
        pending = []
    text_piece(rest[start:], "suffix")
    return out


def plan_pieces(pieces: Sequence[TextPiece], tokenize: Tokenize, token_ids_of: Callable[[str], Sequence[int]] | None = None,
                registered: int | None = None, whole: Sequence[int] | None = None,
                decode: Callable[[Sequence[int]], str] | None = None, strict: bool = False,
                exact: Collection[str] = ()) -> Plan:
    """Tokenize pieces (chunks through ``token_ids_of`` when given: the stored, fixed ids) and assign positions.

    Args:
        whole: the ids of the whole prompt string (``tokenize("".join(texts))``); when given, the plan's ids are
            made equal to them (:func:`align_to_whole`). Without it each piece is tokenized alone.
        decode: ids -> text, for the text of re-derived segments (else the pieces' own text is joined).
        strict: a chunk whose ids do not occur in ``whole`` is prefilled as text (True) or spliced with its own
            ids and counted in ``Plan.inexact_chunks`` (False, default: reuse wins over a boundary token).
        exact: chunk texts held to the ``strict`` rule whatever ``strict`` says.

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
    aligned: list[tuple[TextPiece, tuple[int, ...], bool]] = [(p, ids, True) for p, ids in tokenized]
    if whole is not None and tuple(t for _, ids in tokenized for t in ids) != tuple(whole):
        aligned = align_to_whole(tokenized, whole, decode, tokenize=tokenize, strict=strict, exact=exact)
    segs: list[PlannedSegment] = []
    pos = 0
    found = inexact = 0
    for p, ids, spliced_exactly in aligned:
        if p.kind == "chunk":
            found += 1
            inexact += not spliced_exactly
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
    return Plan(context=context, suffix=suffix, registered=registered if registered is not None else found, found=found,
                inexact_chunks=inexact, prompt_ids=tuple(whole) if whole is not None else None)


def plan_prompt(prompt: str, chunk_texts: Sequence[str], tokenize: Tokenize,
                token_ids_of: Callable[[str], Sequence[int]] | None = None, *, align: bool = True,
                strict: bool = False, decode: Callable[[Sequence[int]], str] | None = None,
                exact: Collection[str] = ()) -> Plan:
    """Split + plan in one step (see :func:`split_prompt` and :func:`plan_pieces`). A chunk text that ends the
    prompt is prefilled as its suffix (a prompt needs text after its last chunk), registered but not found.

    With ``align`` (default) the plan's ids follow ``tokenize(prompt)`` (equal to it unless a chunk is spliced
    inexactly, see ``strict``). ``exact``: chunk texts offered only because they occur in the prompt (a framework
    adapter's lookup by content), held to the strict rule; one that does not splice is not counted as registered.
    """
    pieces, _ = split_prompt(prompt, chunk_texts)
    offered_texts = list(chunk_texts)
    while (last := next((p for p in reversed(pieces) if p.text), None)) is not None and last.kind == "chunk":
        # nothing after it to prefill: that text is the suffix (and a shorter text it ends with, the same)
        offered_texts = [t for t in offered_texts if t != last.text]
        pieces, _ = split_prompt(prompt, offered_texts)
    offered = {t for t in chunk_texts if t and t.strip()}
    plan = plan_pieces(pieces, tokenize, token_ids_of, registered=len(offered),
                       whole=tokenize(prompt) if align else None, decode=decode, strict=strict, exact=exact)
    spliced = {s.text for s in plan.context if s.kind == "chunk"}
    unspliced = {t for t in offered & set(exact) if t not in spliced}
    return dataclasses.replace(plan, registered=plan.registered - len(unspliced)) if unspliced else plan
