"""The JSON documents of repairer training: a corpus group, the pair cache's manifest, the normalization statistics,
the conditioning and the training summary a repairer's ``repair_config.json`` records."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

from kvrag.jsontypes import JSONObject

if TYPE_CHECKING:
    import torch


class DocumentGroup(TypedDict, total=False):
    """One group of a training corpus (a line of its JSONL): passages about one subject, their titles, its id."""

    id: str
    passages: list[str]
    titles: list[str]


class PairManifest(TypedDict, total=False):
    """What a pair cache's examples depend on (its ``manifest.json``; :meth:`PairBuilder.identity`)."""

    format_version: int
    model_fingerprint: str
    kv_shape: list[int]
    prefix_ids: list[int]
    lead_ids: list[int] | None
    lead_kinds: list[str]
    exact_lead: bool
    renderer: str
    max_tokens: int
    max_chunks: int
    min_chunks: int
    cache_dtype: str


class NormStats(TypedDict):
    """:func:`kvrag.repair.pairs.compute_stats`: the RMS scales ([L, 2, H_kv, D]) and what they pool."""

    sigma_stale: torch.Tensor
    sigma_delta: torch.Tensor
    tokens: int
    documents: int


StatsMeta = TypedDict("StatsMeta", {
    "tokens": int,
    "documents": int,
    "model_fingerprint": str,
    "seconds": float,
    "from": str,  # statistics taken over from the repairer a run continues: its directory
}, total=False)
"""What the normalization statistics were computed from (``stats.safetensors``' metadata)."""


class Conditioning(TypedDict, total=False):
    """What a repairer is trained with (``conditioning`` of its ``repair_config.json``, checked at load)."""

    chunk_prefix: str
    chunk_prefix_ids: list[int]
    chunk_format: str
    chunk_styles: dict[str, dict[str, str]]
    lead_kinds: list[str]
    exact_lead: bool
    target_dtype: str


class InitFrom(TypedDict, total=False):
    """The repairer a training run continued (``init_from`` of its summary; ``init_from`` again for its own)."""

    directory: str
    steps: int | None
    samples: int | None
    tokens: int | None
    wall_s: float | None
    weights_sha256: str | None
    final_eval_nmse: float | None
    final_eval_step: int | None
    init_from: InitFrom


class CurveRow(TypedDict, total=False):
    """A line of a run's ``curve.jsonl``: a ``train`` row (the loss and throughput since the last one) or an
    ``eval`` row (:func:`kvrag.repair.evaluate.evaluate`'s metrics; the region RMSEs beside these keys)."""

    kind: str
    step: int
    lr: float
    loss: float
    grad_norm: float
    tokens: int
    samples: int
    epoch: float
    wall_s: float
    data_s: float
    compute_s: float
    train_tok_per_s: float
    docs_per_s: float
    nmse: float
    nmse_stale: float
    eval_docs: int


class RepairerTarget(TypedDict, total=False):
    """The model a repairer was trained for (``target`` of its ``repair_config.json``)."""

    model_fingerprint: str
    model_name: str
    weights_fingerprint: str


class RepairerConfig(TypedDict, total=False):
    """A repairer's ``repair_config.json`` (:meth:`kvrag.repair.model.RepairModel.save_pretrained`)."""

    format: str
    format_version: int
    kvrag_version: str
    architecture: dict[str, int | float | str]
    num_parameters: int
    target: RepairerTarget
    normalization: JSONObject
    weights: dict[str, str]
    training: TrainingSummary
    conditioning: Conditioning


class TrainingSummary(TypedDict, total=False):
    """A training run's summary (:meth:`RepairTrainer.summary`; ``training`` of the repairer's config)."""

    data: str
    train_documents: int
    eval_documents: int
    steps: int
    samples: int
    tokens: int
    epochs: float
    wall_s: float
    stats: StatsMeta
    init_from: InitFrom
    final_eval: JSONObject | None
    config: JSONObject


__all__ = ["Conditioning", "CurveRow", "DocumentGroup", "InitFrom", "NormStats", "PairManifest", "RepairerConfig",
           "RepairerTarget", "StatsMeta", "TrainingSummary"]
