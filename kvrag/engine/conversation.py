"""Conversations: the KV of answered requests, kept so that the next turn of a chat prefills only its new text.

A chat sends its whole history every turn: turn ``k + 1``'s prompt is turn ``k``'s prompt, its answer and a new
user message. After a request is answered its prompt's KV (the method's repaired context and the suffix prefill) is
kept in a :class:`ConversationCache` with the ids of the prompt and the answer. A later request of the same engine
(so the same model) and the same method whose ids start with a kept conversation's first prompt and at least one
token of its answer (the next turn, or a later turn edited or asked again) reuses the longest common prefix of the
kept prompt (at most all its ids but :data:`PREFILL_ROWS`) and prefills the rest -- the answer and the new message
(:func:`prepare_hit`), as llama.cpp's server does with a slot's ``cache_prompt`` and vLLM / SGLang with their
prefix caches. A repeated first prompt, or a new question over the same passages, is not a next turn: it is
computed afresh, so ``full`` on a prompt it has seen still equals ``model.generate`` on its ids, and a method that
repairs the context for the question repairs it for this one.

Exactness: the reused positions are the same computation the model did on the same ids, by the same model and
method, so a ``full`` request that reuses a prefix generates exactly what ``model.generate(ids,
past_key_values=<that prefix's KV>)`` does (tested), and, because every row of a prefill gets the same bits however
the prompt is split into forwards (:func:`kvrag.kv.aligned.aligned_attention`), exactly what a prefill of the
whole history gives. The answer's K/V are not reused: decode steps wrote them through the decode products (int4
weights, bf16 packed linears, kvrag's row attention), whose bits differ from a prefill's, so the next turn prefills
the answer again with its new message -- at least :data:`PREFILL_ROWS` tokens, which take the prefill's products.
For a reusing method the kept context is repaired for the earlier turn's question, as a chat server that keeps its
slot would hold it.

Bounds: at most ``max_entries`` kept requests and ``max_bytes`` of KV, least recently used leaving first; a request
whose KV extends a kept one replaces it (one entry per conversation). The bytes are counted in the engine's KV
bound (:attr:`kvrag.engine.lease.KVBudget.cached`): an entry is kept only when it fits beside the requests in
flight, and entries are given back, least recently used first, as soon as a request needs the room.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kvrag.engine.lease import KVBudget, Lease
from kvrag.engine.planner import Plan, common_prefix
from kvrag.engine.relocate import Moved, find_moved
from kvrag.engine.results import Prepared, Stats, Timings
from kvrag.fusion.base import FusionMethod
from kvrag.fusion.escalate import first_step_confidence
from kvrag.fusion.stats import MethodStats
from kvrag.kv import batched, hf_cache, linear, quant
from kvrag.kv.pieces import Pace, PrepareJob, SuffixPrefill, forward_pieces

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import Cache, PreTrainedModel

    from kvrag.engine.runner import Runner
    from kvrag.kv.spec import KVSpec

log = logging.getLogger(__name__)

SPARE_SHARE = 0.25
"""A request's own buffer is kept as it is (no copy) when the room past its prompt is at most this share of the
prompt: the answer's positions ride along in memory (and are counted); a larger buffer's prompt is copied out."""
PREFILL_ROWS = max(quant.MAX_ROWS, linear.MAX_ROWS) + 1
"""The fewest ids a next turn prefills when it can (the kept context still covered): a forward of fewer rows takes
the decode products (:data:`kvrag.kv.quant.MAX_ROWS` for quantized weights, :data:`kvrag.kv.linear.MAX_ROWS` for
bf16 packed linears), so its K/V would not be the bits of a prefill of the whole history."""


@dataclasses.dataclass(eq=False)
class Entry:
    """One answered request's KV: ``ids`` (its prompt's ``prompt_len``, then its answer's) and ``keys`` / ``values``
    [L, H_kv, prompt_len, D] (RoPE applied, positions 0..prompt_len-1) of the prompt, under ``method``;
    ``first``: the prompt length of the conversation's first answered request (a next turn continues past it);
    ``level``: what the method left the context at (``MethodStats.auto_choice``: ``auto:agree``'s ladder level;
    None for other methods)."""

    ids: tuple[int, ...]
    prompt_len: int
    first: int
    method: str
    keys: torch.Tensor
    values: torch.Tensor
    nbytes: int
    level: str | None = None


@dataclasses.dataclass(frozen=True)
class Hit:
    """A kept request whose first ``length`` positions a new request reuses."""

    entry: Entry
    length: int


class ConversationCache:
    """The answered requests' KV of one engine (see the module docstring). Thread-safe.

    Args:
        budget: the engine's KV bound, or a callable returning it (the runner's, which a fork replaces).
        max_bytes: most bytes kept (0: nothing is kept).
        max_entries: most requests kept.
    """

    def __init__(self, budget: KVBudget | Callable[[], KVBudget], max_bytes: int, max_entries: int) -> None:
        self._budget_of = budget if callable(budget) else (lambda: budget)
        self.max_bytes, self.max_entries = int(max_bytes), int(max_entries)
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()  # least recent first
        self._lock = threading.RLock()
        self._attached: KVBudget | None = None
        self.nbytes = 0
        self.counters: collections.Counter[str] = collections.Counter()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def _budget(self) -> KVBudget:
        """The bound the entries are counted in; a new one (after a fork) starts with no entries."""
        budget = self._budget_of()
        if budget is not self._attached:
            self._entries.clear()
            self.nbytes = 0
            budget.reclaimer = self.reclaim
            self._attached = budget
        return budget

    def match(self, ids: Sequence[int], method: str, min_length: int = 0, *, count: bool = True) -> Hit | None:
        """The kept conversation that ``ids`` continue (its first prompt and at least one token of its answer) with
        the longest common prefix, reused up to its prompt, all ids but :data:`PREFILL_ROWS` (or, where that would
        leave fewer than ``min_length``, all but the last) and at least ``min_length`` of them; None if there is
        none. ``count=False``: a miss is not counted (the caller looks again with other ids)."""
        if not self.enabled:
            return None
        ids = tuple(ids)
        best: Hit | None = None
        with self._lock:
            self._budget()
            for key, e in self._entries.items():
                if e.method != method or len(ids) <= e.first + 1 or ids[: e.first + 1] != e.ids[: e.first + 1]:
                    continue
                n = min(common_prefix(ids, e.ids), e.prompt_len, len(ids) - 1)
                if len(ids) - n < PREFILL_ROWS and len(ids) - PREFILL_ROWS >= max(1, min_length):
                    n = len(ids) - PREFILL_ROWS
                if n >= max(1, min_length) and (best is None or n > best.length):
                    best, best_key = Hit(e, n), key
            if best is not None or count:
                self.counters["hits" if best is not None else "misses"] += 1
            if best is not None:
                self._entries.move_to_end(best_key)
                self.counters["hit_tokens"] += best.length
        return best

    def match_moved(self, ids: Sequence[int], context_len: int, method: str) -> Moved | None:
        """The kept prompt tail that ``ids`` hold after their first ``context_len`` ids, followed by its answer
        (:func:`kvrag.engine.relocate.find_moved`: the history of a chat whose passages changed); None if none. The
        entry keeps its place in the LRU order: its conversation goes on in the entry this request's answer
        leaves, which replaces it (:meth:`keep`)."""
        if not self.enabled:
            return None
        with self._lock:
            self._budget()
            moved = find_moved(list(self._entries.values()), ids, context_len, method)
            if moved is not None:
                self.counters["moved_hits"] += 1
                self.counters["moved_tokens"] += moved.length
        return moved

    def keep(self, ids: Sequence[int], prompt_len: int, method: str, cache: Cache, level: str | None = None,
             replaces: object | None = None) -> bool:
        """Keep the prompt's KV of an answered request (``cache``: its transformers cache over at least the first
        ``prompt_len`` of ``ids``, its prompt; the rest of ``ids`` is its answer; ``level``: :attr:`Entry.level`;
        ``replaces``: the entry whose history the request moved (:meth:`match_moved`), dropped once this one is kept:
        the new entry holds that history too).
        Returns whether it was kept: not when there is no answer token, the cache is off, the entry alone is over
        ``max_bytes``, or it does not fit beside the requests in flight."""
        ids = tuple(ids)
        if not self.enabled or len(ids) <= prompt_len:
            return False
        buf, length = hf_cache.buffer_of(cache)
        if length < prompt_len:
            return False
        t = int(prompt_len)  # the answer's K/V (decode-written) is prefilled again by the next turn
        whole = buf.capacity - t <= SPARE_SHARE * t  # keep the request's buffer itself: no copy of the prompt
        budget = self._budget_of()
        nbytes = (buf.capacity if whole else t) * budget.bytes_per_token
        if nbytes > self.max_bytes:
            self.counters["too_large"] += 1
            return False
        with self._lock:
            for e in self._entries.values():
                if e.method == method and e.ids[: len(ids)] == ids:
                    return True  # already kept as part of a longer one
        keys, values = buf.keys[:, :, :t], buf.values[:, :, :t]
        if not whole:
            keys, values = keys.clone(), values.clone()
        entry = Entry(ids, t, t, method, keys, values, nbytes, level)
        with self._lock:
            budget = self._budget()
            for e in self._entries.values():  # a later turn of a kept conversation belongs to it
                if e.method == method and e.first < entry.first and common_prefix(ids, e.ids) > e.first:
                    entry.first = e.first
            for key in [k for k, e in self._entries.items() if e.method == method and ids[: len(e.ids)] == e.ids]:
                self._drop(key)  # the earlier turns of this conversation: the new entry covers them
            while self._entries and (self.nbytes + nbytes > self.max_bytes or len(self._entries) >= self.max_entries):
                self._drop(next(iter(self._entries)), "evicted")
            while not budget.hold(nbytes):
                if not self._entries:
                    self.counters["no_room"] += 1
                    return False
                self._drop(next(iter(self._entries)), "evicted")
            self._entries[id(entry)] = entry
            self.nbytes += nbytes
            self.counters["kept"] += 1
            if replaces is not None and self._entries.get(id(replaces)) is replaces:
                self._drop(id(replaces))  # the conversation goes on in this entry
        return True

    def reclaim(self, nbytes: int) -> None:
        """Give back at least ``nbytes`` (or everything), least recently used first: a request needs the room."""
        with self._lock:
            freed = 0
            while self._entries and freed < nbytes:
                freed += self._drop(next(iter(self._entries)), "reclaimed")

    def clear(self) -> None:
        with self._lock:
            while self._entries:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: int, why: str | None = None) -> int:
        e = self._entries.pop(key)
        self.nbytes -= e.nbytes
        if self._attached is not None:
            self._attached.unhold(e.nbytes)
        if why:
            self.counters[why] += 1
        return e.nbytes

    def stats(self) -> dict[str, int]:
        """Entries and bytes kept, the bound, and counters: ``hits`` / ``misses`` (lookups), ``hit_tokens``,
        ``moved_hits`` / ``moved_tokens`` (a kept history moved behind new passages, :meth:`match_moved`),
        ``kept``, ``evicted`` (LRU / ``max_bytes`` / ``max_entries``), ``reclaimed`` (a request needed the room),
        ``too_large`` / ``no_room`` (not kept)."""
        with self._lock:
            out = {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                   "max_entries": self.max_entries}
            out.update(self.counters)
        return out


def keep_answered(cache: ConversationCache, prepared: Prepared) -> bool:
    """Keep a streamed request's prompt KV with the ids of its prompt and answer. Never raises: a conversation that
    cannot be kept (e.g. no memory for the copy) is only not reused."""
    if not cache.enabled:
        return False
    try:
        plan_ids = prepared.plan.token_ids
        length = hf_cache.cache_length(prepared.cache)
        answered = length - len(plan_ids)
        if answered <= 0 or answered > len(prepared.token_ids):
            return False
        return cache.keep(plan_ids + tuple(prepared.token_ids[:answered]), len(plan_ids), repr(prepared.method),
                          prepared.cache, prepared.stats.method_stats.auto_choice, replaces=prepared.moved_from)
    except Exception:  # noqa: BLE001 - the answer is complete; only its reuse is lost
        log.warning("could not keep an answered request's KV for its next turn", exc_info=True)
        return False


class HitEngine(Protocol):
    """What :func:`prepare_hit` reads of the engine (:class:`kvrag.engine.engine.KVRAGEngine`)."""

    @property
    def spec(self) -> KVSpec: ...

    @property
    def model(self) -> PreTrainedModel: ...

    @property
    def runner(self) -> Runner: ...


def prepare_hit(engine: HitEngine, plan: Plan, m: FusionMethod, lease: Lease, hit: Hit,
                spliced: Plan | None = None) -> PrepareJob[Prepared]:
    """A request's prepare from a kept conversation (in the runner thread, in its turn): the kept KV's first
    ``hit.length`` positions copied into the request's buffer (:meth:`Lease.prompt_buffer`), then the rest of its
    ids prefilled -- the model's own forward for ``full`` (what ``model.generate`` runs after a given prefix cache),
    the runner's suffix prefill for a reusing method (as after its repair; the same bits, both through
    :func:`kvrag.kv.aligned.aligned_attention`). Nothing is fetched or repaired: the kept context was repaired by the
    same method when it was first answered.

    Where the method re-checks a kept context (:meth:`FusionMethod.kept_context_threshold`: ``auto:agree`` over a
    context its ladder left below ``full``), a first decode step less confident than the threshold is not answered
    from the kept context: the whole prompt is computed as ``full`` computes it (the ladder's last level), in the
    same buffer, and the conversation kept after this answer is ``full``'s.

    ``spliced``: the request's plan with its chunks spliced, when ``plan`` is its prompt's own tokenization (the hit
    continues a conversation kept over those ids); its chunks inside the reused prefix are counted as hits."""
    t0 = time.perf_counter()
    timings = Timings()
    ids = plan.token_ids
    n = hit.length
    rest = ids[n:]
    buf = lease.prompt_buffer(engine.spec, plan.positions, hit.entry.keys.dtype, engine.model.device)
    buf.keys[:, :, :n].copy_(hit.entry.keys[:, :, :n])
    buf.values[:, :, :n].copy_(hit.entry.values[:, :, :n])
    timings.assemble_s = time.perf_counter() - t0
    t = time.perf_counter()
    pace = Pace(engine.runner.piece_budget_s, engine.model.device, engine.runner.scheduler.preparing_cancelled)
    if m.reads_cache and engine.runner.parks_at_suffix:
        parked = time.perf_counter()
        last, timings.suffix_prefill_s = yield SuffixPrefill(batched.Row(buf, n), tuple(rest))
        t0 += time.perf_counter() - parked - timings.suffix_prefill_s  # waiting for other arrivals: like the turn
        cache = buf.as_cache(len(ids))
    else:
        logits, cache = yield from forward_pieces(engine.model, torch.tensor(rest, dtype=torch.long), buf.as_cache(n),
                                                  start=n, pace=pace)
        last = logits[-1]
        timings.suffix_prefill_s = time.perf_counter() - t - pace.paused_s
    chunked = spliced or plan  # the plan whose chunks the reused prefix holds
    level = hit.entry.level
    threshold = m.kept_context_threshold(level, engine.model)
    if threshold is not None:
        conf = first_step_confidence(last)
        if conf < threshold:  # unsure over the kept context: compute the prompt as full does, over its own ids
            t = time.perf_counter()
            paused = pace.paused_s
            plan = plan.as_prompt_tokenized()
            logits, cache = yield from forward_pieces(engine.model, torch.tensor(plan.token_ids, dtype=torch.long),
                                                      buf.as_cache(0), start=0, pace=pace)
            last = logits[-1]
            timings.repair_s = time.perf_counter() - t - (pace.paused_s - paused)
            reason = f"conversation hit: top-1 probability {conf:.3f} < {threshold:.3f} over the kept {level}"
            method_stats = MethodStats(recomputed_fraction=1.0, auto_choice="full", auto_confidences=[conf],
                                       auto_reason=reason)
            n = 0
        else:
            method_stats = MethodStats(auto_choice=level, auto_confidences=[conf],
                                       auto_reason=f"conversation hit: top-1 probability {conf:.3f} >= "
                                                   f"{threshold:.3f} over the kept {level}")
    else:
        method_stats = MethodStats(auto_choice=level)
    t0 += pace.paused_s
    chunks = sum(1 for s in chunked.context if s.kind == "chunk" and s.end <= n)
    stats = Stats(context_tokens=plan.context_len, suffix_tokens=len(plan.suffix.token_ids),
                  chunk_tokens=chunked.chunk_tokens, chunks_registered=plan.registered, chunks_found=plan.found,
                  inexact_chunks=chunked.inexact_chunks, chunk_hits=chunks, reused_tokens=n, conversation_tokens=n,
                  hit_rate=(chunks / plan.registered) if plan.registered else 0.0,
                  method_stats=method_stats)
    keys = [s.key for s in chunked.context if s.kind == "chunk" and s.key]
    return Prepared(plan, m, cache, last, timings, stats, keys, t0, kv_lease=lease)


__all__ = ["ConversationCache", "Entry", "Hit", "keep_answered", "prepare_hit"]
