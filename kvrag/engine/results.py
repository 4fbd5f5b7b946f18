"""Typed per-request results: :class:`Timings` and :class:`Stats` (``Response.timings`` / ``Response.stats``).

Both are dataclasses with ``to_dict()`` for JSON; they also read like the mappings they replace
(``stats["hit_rate"]``, ``timings.get("ttft_s")``, ``dict(timings)``), so existing callers keep working. The fusion
method's own statistics are a typed :class:`~kvrag.fusion.stats.MethodStats` (``stats.method_stats``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvrag.fusion.stats import MethodStats
from kvrag.jsontypes import JSONObject, JSONValue

if TYPE_CHECKING:
    import torch

    from kvrag.engine.lease import Lease
    from kvrag.engine.planner import Plan
    from kvrag.fusion.base import FusionMethod


class _Fields(Mapping[str, object]):
    """Read-only mapping view over a dataclass's fields (dataclass subclasses only)."""

    def __getitem__(self, key: str) -> object:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    @classmethod
    def _names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    def to_dict(self) -> JSONObject:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


@dataclasses.dataclass
class Timings(_Fields):
    """Where one request's time went (seconds). TTFT = fetch + misses + assemble + repair + suffix prefill (+ the
    first token's sampling); ``ttft_s`` is None until the first token."""

    fetch_s: float = 0.0
    compute_misses_s: float = 0.0
    assemble_s: float = 0.0
    repair_s: float = 0.0
    suffix_prefill_s: float = 0.0
    ttft_s: float | None = None
    decode_s: float = 0.0
    total_s: float = 0.0


@dataclasses.dataclass
class SpecStats(_Fields):
    """One request's decoding: forwards it took part in, tokens drafted from the prompt and how many of them the
    model's greedy choices confirmed (:mod:`kvrag.engine.speculate`). Tokens generated = ``accepted_tokens`` +
    ``decode_forwards`` + 1 (the first token comes from the prepare's logits), less one when the answer ended
    inside a verified draft."""

    decode_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclasses.dataclass
class Stats(_Fields):
    """What one request reused and computed.

    Attributes:
        context_tokens / suffix_tokens / chunk_tokens: prompt token counts (context = everything before the
            suffix; chunk = registered chunks found in it).
        chunks_registered / chunks_found / inexact_chunks: registered chunk texts, how many occur in the prompt,
            and how many of those were spliced with ids that differ at a boundary from the whole-prompt ids.
        chunk_hits / chunk_misses / other_hits / other_misses: store hits and misses of chunk and of other
            (prefix / in-between text) segments.
        reused_tokens: tokens whose KV was reused: from the store or from a kept conversation; 0 where the whole
            prompt was recomputed (``full``, and ``auto`` escalated to it: nothing reused reached the answer), and
            without the tokens a selective method recomputed at every layer (``relaxkv:r=1``: the prefix only).
        conversation_tokens: tokens whose KV came from an earlier answered request that this prompt continues
            (:mod:`kvrag.engine.conversation`; then only the rest of the prompt was prefilled).
        hit_rate: chunk hits / chunks registered.
        method_stats: the fusion method's own statistics (recomputed fractions, attention pairs, timings, ...;
            ``to_dict()`` gives the JSON form under the key ``method_stats``).
        generated_tokens: tokens decoded (set when the stream ends).
        decode_forwards / drafted_tokens / accepted_tokens: the decode forwards this request took part in and its
            speculative drafts (:class:`SpecStats`; set when the stream ends).
    """

    context_tokens: int = 0
    suffix_tokens: int = 0
    chunk_tokens: int = 0
    chunks_registered: int = 0
    chunks_found: int = 0
    inexact_chunks: int = 0
    chunk_hits: int = 0
    chunk_misses: int = 0
    other_hits: int = 0
    other_misses: int = 0
    reused_tokens: int = 0
    conversation_tokens: int = 0
    hit_rate: float = 0.0
    method_stats: MethodStats = dataclasses.field(default_factory=MethodStats)
    generated_tokens: int | None = None
    decode_forwards: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    finish_reason: str | None = None
    """``"stop"`` (EOS or a stop string) or ``"length"`` (``max_new_tokens``); set when the stream ends."""

    def to_dict(self) -> JSONObject:
        """JSON form: every field, ``method_stats`` as :meth:`MethodStats.to_dict` writes it."""
        return {f.name: self.method_stats.to_dict() if f.name == "method_stats" else getattr(self, f.name)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, JSONValue]) -> Stats:
        """Read :meth:`to_dict`'s form back (unknown keys are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"method_stats"}
        fields: dict[str, Any] = {k: v for k, v in data.items() if k in names}  # checked by the dataclass only
        method = data.get("method_stats")
        return cls(**fields, method_stats=MethodStats.from_dict(method if isinstance(method, dict) else None))


@dataclasses.dataclass
class Response:
    """One answer with its timings (seconds) and reuse statistics."""

    text: str
    token_ids: list[int]
    method: str
    timings: Timings
    stats: Stats
    chunk_keys: list[str]

    @property
    def ttft_s(self) -> float:
        return float(self.timings.ttft_s or 0.0)

    def to_dict(self) -> JSONObject:
        return {"text": self.text, "token_ids": list(self.token_ids), "method": self.method,
                "timings": self.timings.to_dict(), "stats": self.stats.to_dict(), "chunk_keys": list(self.chunk_keys)}


@dataclasses.dataclass
class Prepared:
    """A request after repair and suffix prefill, ready to decode (``token_ids`` fills as it streams)."""

    plan: Plan
    method: FusionMethod
    cache: Any  # a transformers Cache; None once the stream no longer needs its prompt buffer
    last_logits: torch.Tensor
    timings: Timings
    stats: Stats
    chunk_keys: list[str]
    t0: float
    token_ids: list[int] = dataclasses.field(default_factory=list)
    kv_lease: Lease | None = dataclasses.field(default=None, repr=False, compare=False)
    """The request's share of the engine's KV memory bound (:mod:`kvrag.engine.admission`), given back when its
    stream ends or this object is garbage-collected."""
    moved_from: object | None = dataclasses.field(default=None, repr=False, compare=False)
    """The kept request whose history this one moved behind its passages (:mod:`kvrag.engine.relocate`): this
    request's own kept entry replaces it."""

    def __post_init__(self) -> None:
        if self.kv_lease is not None:
            weakref.finalize(self, self.kv_lease.release)


__all__ = ["Prepared", "Response", "SpecStats", "Stats", "Timings"]
