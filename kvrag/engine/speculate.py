"""Exact speculative decoding from the prompt (prompt lookup): drafts copied from the retrieved chunks.

RAG answers copy spans of their context -- names, dates, phrases of a retrieved passage. Prompt lookup (the
``prompt_lookup_num_tokens`` candidate generator of transformers, vLLM's ``ngram`` proposer) drafts the next
tokens by finding the answer's last n-gram earlier in the prompt (or in the answer so far) and proposing the
tokens that followed it there; no draft model is needed, and the chunks are already tokenized.

:class:`PromptLookup` keeps, per n-gram size, a dict from each n-gram to the position right after its latest
occurrence that has a continuation, so a draft costs a few dict lookups whatever the prompt's length, and each
generated token updates the dicts in O(n).

The runner (:mod:`kvrag.engine.runner`) feeds each greedy row its next input plus its draft in one forward
(:func:`kvrag.kv.batched.verify_step`), takes the model's greedy choice at every fed position, keeps the drafted
tokens up to the first one greedy decoding would not have chosen, and adds the model's own choice after them
(one token more than the draft matched). The tokens are those of plain greedy decoding: each choice is the argmax
of the logits after exactly the tokens plain decoding would have fed. Positions past the accepted tokens are
rolled back by not advancing the request's length. Sampling requests are not drafted for.
"""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kvrag.errors import ConfigError

if TYPE_CHECKING:
    from kvrag.engine.generate import DecodeState
    from kvrag.engine.results import SpecStats
    from kvrag.kv.batched import Row


@dataclasses.dataclass(frozen=True)
class SpeculationConfig:
    """How prompt-lookup drafting runs.

    Attributes:
        max_draft: most drafted tokens per request and step (0 turns speculation off).
        max_ngram / min_ngram: the longest and shortest suffix of the answer that is looked up (longest first).
        max_step_tokens: most tokens one verify forward feeds over all its rows (inputs plus drafts): small
            forwards keep decode-sized products on the quantized weights and the step's cost near one token's.
        max_batch: drafts only while at most this many requests decode (vLLM's ``speculative_disable_by_batch_size``):
            one request's step reads the weights for one row, so verifying a few drafted rows costs little beside
            it; a batch's step already multiplies a row per request, and each drafted row adds to a product that is
            no longer bound by the weights' bytes.
    """

    max_draft: int = 3
    max_ngram: int = 3
    min_ngram: int = 2
    max_step_tokens: int = 16
    max_batch: int = 8

    def __post_init__(self) -> None:
        if self.max_draft < 0:
            raise ConfigError(f"speculative max_draft must be >= 0 tokens, got {self.max_draft}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            msg = f"speculative n-gram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}"
            raise ConfigError(msg)
        if self.max_step_tokens < 1:
            raise ConfigError(f"speculative max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if self.max_batch < 1:
            raise ConfigError(f"speculative max_batch must be >= 1 request, got {self.max_batch}")

    @property
    def enabled(self) -> bool:
        return self.max_draft > 0


class PromptLookup:
    """Drafts for one request: the tokens that followed the latest earlier occurrence of its last n-gram.

    Args:
        prompt_ids: the request's prompt token ids (context and question).
        max_ngram / min_ngram: n-gram sizes tried, longest first.
    """

    BACKOFF_CAP = 16
    """Most steps a request waits before drafting again after its drafts kept being rejected."""

    def __init__(self, prompt_ids: Sequence[int], max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.ids: list[int] = [int(t) for t in prompt_ids]
        self.misses = 0  # verify steps in a row whose whole draft was rejected
        self.wait = 0  # steps left before the next draft
        self.sizes = tuple(range(max_ngram, min_ngram - 1, -1))
        self.next_of: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        ids = self.ids
        for n in self.sizes:
            table = self.next_of[n]
            for end in range(n, len(ids)):  # the n-gram ids[end - n:end] is followed by ids[end]
                table[tuple(ids[end - n : end])] = end

    def push(self, token: int) -> None:
        """Append a generated token (the n-grams ending just before it now have a continuation)."""
        self.ids.append(int(token))
        end = len(self.ids) - 1
        for n in self.sizes:
            if end >= n:
                self.next_of[n][tuple(self.ids[end - n : end])] = end

    def feedback(self, drafted: int, accepted: int) -> None:
        """What the last verify kept of a draft. A verify forward costs more than a plain step (each drafted position
        is a row of every product and its own attention), so a request whose drafts keep failing -- an answer that
        does not copy its context -- stops drafting for 2, 4, ... up to :data:`BACKOFF_CAP` steps, and drafts again
        at once after an accepted token."""
        if not drafted:
            return
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= 2:
            self.wait = min(self.BACKOFF_CAP, 2 ** (self.misses - 1))

    def draft(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matching suffix n-gram's latest occurrence ([] if none, or
        while backing off after rejected drafts)."""
        if self.wait > 0:
            self.wait -= 1
            return []
        if k <= 0:
            return []
        ids = self.ids
        for n in self.sizes:
            if len(ids) < n:
                continue
            at = self.next_of[n].get(tuple(ids[len(ids) - n :]))
            if at is not None:
                return ids[at : at + k]
        return []


class Speculating(Protocol):
    """What drafting and acceptance read and write of a running request (the runner's
    :class:`~kvrag.engine.handle.Handle`, which imports this module)."""

    state: DecodeState | None
    """Its decoding state; set to None when choosing its tokens failed."""

    @property
    def row(self) -> Row | None: ...

    @property
    def drafter(self) -> PromptLookup | None: ...

    @property
    def items(self) -> queue.SimpleQueue[tuple[int, str] | BaseException]: ...

    @property
    def spec(self) -> SpecStats: ...


def _decoding(h: Speculating) -> tuple[DecodeState, Row]:
    if h.state is None or h.row is None:
        raise ValueError("speculative decoding needs a decoding request (its state and batch row are set)")
    return h.state, h.row


def draft_rows(rows: Sequence[Speculating], spec: SpeculationConfig) -> list[list[int]] | None:
    """Each running request's draft for the next step (the runner's handles: ``drafter``, ``state``, ``row``),
    within the step's token budget; None when no row has one or more than ``spec.max_batch`` requests decode (the
    plain step runs then).

    A draft never runs past ``max_new_tokens`` (the model's choice after an accepted draft is one more token) nor
    past the request's KV buffer.
    """
    budget = spec.max_step_tokens - len(rows)
    if not spec.enabled or budget <= 0 or len(rows) > spec.max_batch:
        return None
    drafts: list[list[int]] = []
    for h in rows:
        d: list[int] = []
        if h.drafter is not None and budget > 0:
            state, row = _decoding(h)
            left = state.cfg.max_new_tokens - state.steps - 1  # tokens allowed after the next one
            room = row.buffer.capacity - row.length - 1
            d = h.drafter.draft(min(spec.max_draft, budget, left, room))
            budget -= len(d)
        drafts.append(d)
    return drafts if any(drafts) else None


def accept_row(h: Speculating, feed: Sequence[int], logits: torch.Tensor, greedy: Sequence[int], at: int) -> int:
    """Choose a request's tokens from a step's logits: ``feed`` (its input, then its draft) was fed at rows
    ``at ..`` of ``logits``; each position's choice is emitted until the answer ends or a choice differs from the
    next drafted token. Advances the request's length past the fed tokens that were kept (the roll-back of the
    rest) and its :class:`~kvrag.engine.results.SpecStats`; returns how many fed tokens were kept."""
    fed = 0
    state, row = _decoding(h)
    sample = state.cfg.do_sample
    try:
        for j in range(len(feed)):
            fed += 1
            for item in state.advance(logits[at + j], None if sample else greedy[at + j]):
                h.items.put(item)
            if state.finished:
                break
            if h.drafter is not None and state.last is not None:  # (set by a step that did not finish)
                h.drafter.push(state.last)
            if j + 1 < len(feed) and state.last != feed[j + 1]:
                break  # the model chose otherwise: the rest of the draft is dropped
    except Exception as e:  # noqa: BLE001 - this request's consumer gets it
        h.items.put(e)
        h.state = None
    if h.drafter is not None:
        h.drafter.feedback(len(feed) - 1, fed - 1)
    row.length += fed  # K/V written past the kept tokens are overwritten by later steps
    h.spec.decode_forwards += 1
    h.spec.drafted_tokens += len(feed) - 1
    h.spec.accepted_tokens += fed - 1
    return fed


__all__ = ["PromptLookup", "Speculating", "SpeculationConfig", "accept_row", "draft_rows"]
