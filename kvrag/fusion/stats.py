"""``MethodStats``: what a fusion method computed on one request (``FusionOutput.stats``, ``Stats.method_stats``).

Every method fills the fields that apply to it and leaves the others None (not reported). :meth:`MethodStats.to_dict`
gives the JSON form results and adapters store -- only the reported fields, under the same keys the methods used
to write (``recomputed_fraction``, ``attention_computed_ratio``, ``repair_repaired_tokens``, ``auto_choice``, ...),
so results of different versions stay comparable -- and :meth:`MethodStats.from_dict` reads it back.

The cost model (:mod:`kvrag.fusion.cost`) and ``auto`` read these attributes; nothing reads method statistics by
string key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from kvrag.jsontypes import JSONObject, JSONValue

REPAIR_PREFIX = "repair_"
"""Key prefix of the CacheRepair step's statistics inside ``hybrid``'s (``repair_repaired_tokens``, ...)."""


@dataclasses.dataclass
class MethodStats:
    """Statistics of one fusion on one request. None means "not reported by this method".

    Ratios use the causal attention pairs of a full prefill of the context at every layer (``L Tc (Tc+1) / 2``) as
    denominator; fractions of states use ``L * Tc``.

    Attributes:
        recomputed_fraction: recomputed (layer, token) states / (L * Tc): 1.0 for ``full``, 0.0 for ``stale``.
        recomputed_per_layer: recomputed tokens at each layer.
        context_fraction: |context the targets attended to| / Tc (1.0 with the full causal prefix).
        attention_edges_ratio: useful (unmasked) attention pairs of the recompute / full-prefill pairs.
        attention_computed_ratio: pairs the kernels evaluated, masked ones included (what costs time), same
            denominator.
        score_edges_ratio: pairs of the query-scoring pass (RelaxKV, ProphetKV), same denominator.
        suffix_folded: the question suffix was prefilled inside the recompute (the engine skipped its own pass).
        selected: targets chosen (EPIC's first-k tokens, ProphetKV's / CacheBlend's selection).
        candidates: positions that could have been chosen.
        anchors_per_layer: RelaxKV's anchors per layer (k).
        union_fraction: |anchor union U| / Tc (RelaxKV).
        sink_in_context: position 0 was in the recompute's context (RelaxKV).
        repaired_tokens: tokens a learned repairer rewrote (CacheRepair).
        repaired_fraction: repaired tokens / Tc.
        exact_lead_tokens: exact leading tokens the repairer read as context but did not rewrite.
        repairer_parameters: parameters of the repairer network.
        repairer_flops: FLOPs of the repairer's forward on this request.
        score_s / recompute_s / repair_s / fusion_s: seconds of the scoring pass, the selective recompute, the
            repairer's forward, and the whole repair step (CacheRepair).
        repair: ``hybrid``'s CacheRepair step (serialized flat with the ``repair_`` prefix, without its
            recomputed fraction, which is 0; its repairer FLOPs are the top-level ``repairer_flops``).
        auto_choice: the method ``auto`` ran.
        auto_predicted_ttft_ratio: its predicted TTFT / full TTFT (corrected by what this process measured).
        auto_budget / auto_margin: ``auto``'s budget and margin.
        auto_chunks: chunk spans of the request.
        auto_correction: the measured correction applied to the cost model's prediction (1.0: none yet).
        auto_agree: the agreement target of ``auto:agree=...``.
        auto_levels: the ladder levels ``auto:agree`` ran, in order (0: CacheRepair, 1: full).
        auto_confidences: the first decode step's top-1 probability after each of them.
        auto_reason: why the ladder stopped where it did.
        extra: statistics of methods registered outside kvrag (merged into the JSON form as they are).
    """

    recomputed_fraction: float = 0.0
    recomputed_per_layer: list[int] | None = None
    context_fraction: float | None = None
    attention_edges_ratio: float | None = None
    attention_computed_ratio: float | None = None
    score_edges_ratio: float | None = None
    suffix_folded: bool | None = None
    selected: int | None = None
    candidates: int | None = None
    anchors_per_layer: int | None = None
    union_fraction: float | None = None
    sink_in_context: bool | None = None
    repaired_tokens: int | None = None
    repaired_fraction: float | None = None
    exact_lead_tokens: int | None = None
    repairer_parameters: int | None = None
    repairer_flops: float | None = None
    score_s: float | None = None
    recompute_s: float | None = None
    repair_s: float | None = None
    fusion_s: float | None = None
    repair: MethodStats | None = None
    auto_choice: str | None = None
    auto_predicted_ttft_ratio: float | None = None
    auto_budget: float | None = None
    auto_margin: str | None = None
    auto_chunks: int | None = None
    auto_correction: float | None = None
    auto_agree: float | None = None
    auto_levels: list[float] | None = None
    auto_confidences: list[float] | None = None
    auto_reason: str | None = None
    extra: JSONObject = dataclasses.field(default_factory=dict)

    def to_dict(self) -> JSONObject:
        """The reported fields as a JSON-serializable dict (None fields left out; ``repair`` flattened with the
        ``repair_`` prefix, without its recomputed fraction; ``extra`` merged)."""
        out: JSONObject = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "extra" or v is None:
                continue
            if f.name == "repair":
                inner = v.to_dict()
                inner.pop("recomputed_fraction")
                out.update({REPAIR_PREFIX + k: x for k, x in inner.items()})
            else:
                out[f.name] = list(v) if isinstance(v, list) else v
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, JSONValue] | None) -> MethodStats:
        """Read :meth:`to_dict`'s form back (e.g. a results JSON, or a bench summary's mean stats, whose integer
        fields are then means). ``repair_*`` keys that are not fields of their own go to ``repair``; unknown keys
        to ``extra``."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "repair"}
        kwargs: dict[str, Any] = {}  # checked by the dataclass's fields only
        repair: JSONObject = {}
        extra: JSONObject = {}
        for k, v in (data or {}).items():
            if k in names:
                kwargs[k] = v
            elif k.startswith(REPAIR_PREFIX) and k[len(REPAIR_PREFIX):] in names:
                repair[k[len(REPAIR_PREFIX):]] = v
            else:
                extra[k] = v
        if kwargs.get("recomputed_fraction") is None:
            kwargs.pop("recomputed_fraction", None)
        return cls(**kwargs, repair=cls.from_dict(repair) if repair else None, extra=extra)


__all__ = ["REPAIR_PREFIX", "MethodStats"]
