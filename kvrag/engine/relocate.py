"""A kept conversation's history moved behind new passages: the next turn of a chat whose retrieved chunks changed.

A chat engine that retrieves again every turn (LlamaIndex ``condense_plus_context``, a LangChain history-aware
chain) sends turn ``k + 1`` as new passages, then the same history, the answer just given and a new message. The
kept conversation (:mod:`kvrag.engine.conversation`) no longer shares a prefix with it, but its tail -- everything
after the old passages up to the end of the kept prompt: the earlier user and assistant messages with their chat
template -- is the same ids at a new position. That is kvrag's own case, text reused at a new offset: the kept K/V
of the tail are taken out of the entry with RoPE removed (:meth:`kvrag.kv.rope.Rope.canonicalize`) and offered to
the request's method as one held context segment of kind ``kept`` (not a stored chunk), placed after the new
passages and repaired with them; the answer and the new message are prefilled as the suffix. A learned repairer
(CacheRepair, and so ``auto``'s first level and ``hybrid``'s repair) predicts how K/V computed *alone* change in
context, so it leaves a ``kept`` span as it is: these K/V were computed in context already, and its correction
moved them further from ``full``'s (measured with ``auto:agree``, the results file below); methods that recompute
chosen positions may still choose them.

The moved K/V were computed over the earlier turn's passages, not this turn's, so this is a reuse like a chunk's
and never used by a method that recomputes everything (``full``). Compared with the history's messages cached one
by one (``reuse_history``: each message computed alone), the moved block keeps what each message attended to in
the conversation -- the turns before it and the template around it -- and differs from a recomputation only by
the passages it saw. The measured next-token KL of both, against ``full`` and against the method with the history
prefilled: ``docs/results/epyc/chat_history_moved.md``.

Matching is on token ids only: the request's ids must hold the kept prompt's last ``length`` ids (at least
:data:`MIN_MOVED`, after the request's chunks) followed by the kept answer, whole -- the same history answered the
same way, whichever passages came before it. Because the moved K/V carry what the earlier passages contributed,
the whole answer is asked for, not just its first id: a request moves a kept history only when it holds the answer
that history was given (the client's own conversation), never when another conversation merely asked the same
question.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvrag.engine.planner import Plan, PlannedSegment, common_suffix
from kvrag.kv.chunk import ChunkKV

if TYPE_CHECKING:
    from kvrag.kv.rope import Rope
    from kvrag.kv.spec import KVSpec


MIN_MOVED = 16
"""The fewest kept ids worth moving: a shorter common tail is a chat template's header, not a history."""


class Kept(Protocol):
    """What a move reads of a kept request (:class:`kvrag.engine.conversation.Entry`)."""

    @property
    def ids(self) -> tuple[int, ...]: ...

    @property
    def prompt_len(self) -> int: ...

    @property
    def method(self) -> str: ...

    @property
    def keys(self) -> torch.Tensor: ...

    @property
    def values(self) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class Moved:
    """A kept request's prompt positions ``[old_start, old_start + length)`` (its prompt's last ``length`` ids)
    found again at ``new_start`` of a request."""

    entry: Kept
    old_start: int
    new_start: int
    length: int


def find_moved(entries: Iterable[Kept], ids: Sequence[int], context_len: int, method: str,
               min_length: int = MIN_MOVED) -> Moved | None:
    """The longest kept prompt tail that ``ids`` hold after their first ``context_len`` ids (the request's chunks
    and the text between them), followed by the kept answer's ids, all of them; None when no kept request of
    ``method`` has one of at least ``min_length`` ids. A tail that starts at the kept prompt's position 0 is a
    prefix hit, which :meth:`kvrag.engine.conversation.ConversationCache.match` handles; it is not a move."""
    ids = tuple(ids)
    lo = context_len + min_length  # the first end a block of min_length ids after the context can have
    if lo >= len(ids):
        return None
    arr = np.asarray(ids, dtype=np.int64)
    best: Moved | None = None
    for e in entries:
        if e.method != method or len(e.ids) <= e.prompt_len or e.prompt_len < min_length:
            continue
        kept, answer = e.ids[: e.prompt_len], e.ids[e.prompt_len:]
        # candidate ends: a position holding the answer's first id right after the kept prompt's last id
        hits = np.nonzero((arr[lo:] == answer[0]) & (arr[lo - 1:-1] == kept[-1]))[0] + lo
        for end in hits.tolist():
            if ids[end: end + len(answer)] != answer:
                continue
            n = min(common_suffix(kept, ids[:end]), end - context_len, e.prompt_len - 1)
            if n >= min_length and (best is None or n > best.length):
                best = Moved(e, e.prompt_len - n, end - n, n)
    return best


def moved_plan(plan: Plan, moved: Moved, rope: Rope, spec: KVSpec) -> Plan:
    """``plan`` with the moved ids as a held ``kept`` context segment: its suffix split into the ids before the
    block (a ``text`` segment, computed like text between chunks, or the ``prefix`` when the plan has no context),
    the block, and the rest (the new suffix). The block's cache is the kept keys at their kept positions with RoPE
    removed, and the kept values, in the store's dtype."""
    e, n = moved.entry, moved.length
    ids = plan.token_ids
    a, b = moved.new_start, moved.new_start + n
    if ids[a:b] != e.ids[moved.old_start: moved.old_start + n] or a < plan.context_len or b >= len(ids):
        raise ValueError("the moved block does not match the plan's ids after its context")
    pos = torch.arange(moved.old_start, moved.old_start + n)
    keys = rope.canonicalize(e.keys[:, :, moved.old_start: moved.old_start + n], pos)
    values = e.values[:, :, moved.old_start: moved.old_start + n]
    dt = spec.torch_dtype
    kv = ChunkKV(token_ids=torch.tensor(ids[a:b], dtype=torch.long), keys=keys.to("cpu", dt).contiguous(),
                 values=values.to("cpu", dt).contiguous(), spec=spec)
    key = f"conversation-moved:{id(e):x}:{moved.old_start}:{n}"
    context = list(plan.context)
    if a > plan.context_len:  # e.g. new passages pasted into the prompt, not offered as chunks
        kind = "text" if context else "prefix"  # from position 0: computed exactly, as a prefix is
        context.append(PlannedSegment(kind, "", ids[plan.context_len: a], plan.context_len))
    context.append(PlannedSegment("kept", "", ids[a:b], a, key=key))
    suffix = PlannedSegment("suffix", plan.suffix.text, ids[b:], b)
    return dataclasses.replace(plan, context=tuple(context), suffix=suffix, held={**plan.held, key: kv})


__all__ = ["MIN_MOVED", "Kept", "Moved", "find_moved", "moved_plan"]
