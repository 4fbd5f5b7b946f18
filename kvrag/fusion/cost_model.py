"""``auto``'s cost model: per candidate method, what it computes, how fast it runs relative to ``full``, its KL.

A cost model is fitted on one machine kind (:func:`kvrag.calibration.machine_kind`) in one compute dtype, from a
``kvrag bench`` summary (:func:`fit_cost_model`, ``kvrag bench fit-auto``) or by ``kvrag calibrate``
(:mod:`kvrag.calibrate`). Per candidate it holds the mean :class:`~kvrag.fusion.stats.MethodStats` (recomputed
states, attention pairs, scoring pass; a repairer's FLOPs per context token), the measured overhead factor (TTFT
ratio / analytic FLOP share, see :mod:`kvrag.fusion.cost`; median and p90 over requests) and the KL to ``full``.
``kvrag calibrate`` also stores the absolute speed of a full prefill (``seconds_per_flop``, with the torch threads
and model shape it was measured with), which ``auto``'s online correction (:mod:`kvrag.fusion.online`) needs.

Which cost model ``auto`` uses: ``auto:costs=FILE`` if given; else the one ``kvrag calibrate`` wrote into
``$KVRAG_HOME/calibration/`` for this machine kind and dtype; else the shipped ``kvrag/data/auto_cost.json``
(fitted on an AVX2-only CPU in float32).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from kvrag.calibration import (
    CALIBRATION_FORMAT,
    CalibrationRecord,
    CandidateRecord,
    CostModelRecord,
    ModelCostRecord,
)
from kvrag.errors import ConfigError
from kvrag.fusion.cost import ModelCost
from kvrag.fusion.stats import MethodStats
from kvrag.jsontypes import JSONValue, as_object

SHIPPED_COST_MODEL = Path(__file__).resolve().parent.parent / "data" / "auto_cost.json"
COST_FORMAT = "kvrag-auto-cost"
COST_VERSION = 2
"""Version 2 adds the machine kind, dtype, torch threads and full-prefill speed, and moves the repairer's FLOPs
per token out of the stats (version 1 files are read too)."""


@dataclasses.dataclass
class Candidate:
    """One method ``auto`` may run.

    Attributes:
        spec: the method spec (``"hybrid:r=0.015"``).
        kl: its mean KL(full || method) on the fitting requests (``full``: 0).
        ttft_ratio: its TTFT / full's TTFT (of the medians).
        flop_share: its analytic FLOPs / full's, mean over the fitting requests.
        overhead: ``ttft_ratio / flop_share``; overhead_p90: the p90 of the per-request overheads.
        stats: its mean statistics (what :meth:`kvrag.fusion.cost.ModelCost.share` reads).
        repairer_flops_per_token: a learned repairer's FLOPs per context token (they scale with the context).
    """

    spec: str
    kl: float
    ttft_ratio: float
    flop_share: float
    overhead: float
    overhead_p90: float
    stats: MethodStats
    repairer_flops_per_token: float | None = None

    def request_stats(self, tc: int) -> MethodStats:
        """The mean stats with the repairer's FLOPs scaled to a context of ``tc`` tokens."""
        if not self.repairer_flops_per_token:
            return self.stats
        return dataclasses.replace(self.stats, repairer_flops=self.repairer_flops_per_token * tc)

    def to_dict(self) -> CandidateRecord:
        d: CandidateRecord = {"spec": self.spec, "kl": self.kl, "ttft_ratio": self.ttft_ratio,
                             "flop_share": self.flop_share, "overhead": self.overhead,
                             "overhead_p90": self.overhead_p90, "stats": self.stats.to_dict()}
        if self.repairer_flops_per_token:
            d["repairer_flops_per_token"] = self.repairer_flops_per_token
        return d

    @classmethod
    def from_dict(cls, spec: str, d: CandidateRecord) -> Candidate:
        raw = dict(d.get("stats") or {})
        old = raw.pop("repairer_flops_per_token", None)  # version 1
        per_token = d.get("repairer_flops_per_token", old if isinstance(old, int | float) else None)
        over = float(d["overhead"])
        return cls(spec=str(d.get("spec", spec)), kl=float(d["kl"]), ttft_ratio=float(d["ttft_ratio"]),
                   flop_share=float(d["flop_share"]), overhead=over,
                   overhead_p90=float(d.get("overhead_p90") or over),  # fitted before the p90: the median
                   stats=MethodStats.from_dict(raw), repairer_flops_per_token=per_token)


@dataclasses.dataclass
class CostModel:
    """A fitted cost model (see the module docstring).

    Attributes:
        candidates: spec -> :class:`Candidate` (``full`` included: the always-exact fallback).
        machine_kind / dtype: what it was fitted on (None: not recorded).
        seconds_per_flop: a full prefill's seconds per analytic FLOP on that machine and dtype, with
            ``torch_threads`` threads, for a model of shape ``model_cost`` (None: not measured).
        source: where it was fitted from; path: the file it was read from.
        info: what the file records of the fitting (hardware, git sha, request count, model), written back as it is.
    """

    candidates: dict[str, Candidate]
    machine_kind: str | None = None
    dtype: str | None = None
    seconds_per_flop: float | None = None
    torch_threads: int | None = None
    model_cost: ModelCost | None = None
    source: str = ""
    path: str | None = None
    info: CostModelRecord = dataclasses.field(default_factory=lambda: CostModelRecord())

    def fitted_for(self, machine_kind: str, dtype: str) -> bool:
        """Whether this cost model was fitted on ``machine_kind`` in ``dtype`` (unrecorded: no)."""
        return self.machine_kind == machine_kind and self.dtype == dtype

    def speed_for(self, machine_kind: str, dtype: str, threads: int, model_cost: ModelCost) -> float | None:
        """``seconds_per_flop`` when it was measured for exactly this machine kind, dtype, thread count and model
        shape; else None (a speed measured elsewhere would scale every correction wrongly)."""
        if self.seconds_per_flop and self.fitted_for(machine_kind, dtype) and self.torch_threads == threads \
                and self.model_cost == model_cost:
            return self.seconds_per_flop
        return None

    def to_dict(self) -> CostModelRecord:
        d: CostModelRecord = {**self.info, "format": COST_FORMAT, "version": COST_VERSION, "source": self.source,
                              "machine_kind": self.machine_kind, "dtype": self.dtype,
                              "methods": {s: c.to_dict() for s, c in self.candidates.items()}}
        if self.seconds_per_flop:
            mc = self.model_cost
            d.update({"seconds_per_flop": self.seconds_per_flop, "torch_threads": self.torch_threads,
                      "model_cost": ModelCostRecord(num_layers=mc.num_layers, state_flops=mc.state_flops,
                                                    pair_flops=mc.pair_flops, head_flops=mc.head_flops)
                      if mc else None})
        return d

    @classmethod
    def from_dict(cls, d: CostModelRecord, path: str | None = None) -> CostModel:
        where = path or "the cost model"
        if d.get("format") != COST_FORMAT or not d.get("methods"):
            msg = f"{where} is not a kvrag auto cost model (format {COST_FORMAT} with a 'methods' table)"
            raise ConfigError(msg)
        try:
            cands = {spec: Candidate.from_dict(spec, m) for spec, m in d["methods"].items()}
        except (KeyError, TypeError, ValueError) as e:
            msg = f"{where}: a method entry lacks kl / ttft_ratio / flop_share / overhead ({e})"
            raise ConfigError(msg) from e
        mc = d.get("model_cost")
        info = CostModelRecord()
        if "hardware" in d:
            info["hardware"] = d["hardware"]
        if "git_sha" in d:
            info["git_sha"] = d["git_sha"]
        if "n_requests" in d:
            info["n_requests"] = d["n_requests"]
        if "model" in d:
            info["model"] = d["model"]
        return cls(candidates=cands, machine_kind=d.get("machine_kind"), dtype=d.get("dtype"),
                   seconds_per_flop=d.get("seconds_per_flop"), torch_threads=d.get("torch_threads"),
                   model_cost=ModelCost(**mc) if mc else None, source=str(d.get("source") or ""), path=path,
                   info=info)


def load_cost_model(path: str | Path | None = None, dtype: str | None = None) -> CostModel:
    """Read a cost-model JSON (default: the shipped one), or the cost model of a ``kvrag calibrate`` file for
    ``dtype`` (needed when the file holds several dtypes)."""
    p = Path(path) if path else SHIPPED_COST_MODEL
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError as e:
        msg = (f"auto: no cost model at {p}; write one for this machine with `kvrag calibrate`, or fit one from a "
               "benchmark run with `kvrag bench fit-auto runs/bench/X/summary.json --out FILE` and pass "
               "auto:costs=FILE")
        raise ConfigError(msg) from e
    except ValueError as e:
        msg = f"{p} is not valid JSON ({e}); refit it or pass another auto:costs=FILE"
        raise ConfigError(msg) from e
    if (data.get("format") if isinstance(data, dict) else None) == CALIBRATION_FORMAT:
        data = _calibrated(data, dtype, p)
    return CostModel.from_dict(data, str(p))


def _calibrated(cal: CalibrationRecord, dtype: str | None, p: Path) -> CostModelRecord:
    """The cost model of a calibration file for ``dtype`` (or its only one)."""
    models = {d: m for d, c in (cal.get("dtypes") or {}).items() if (m := c.get("cost_model"))}
    if dtype in models:
        return models[dtype].copy()
    if dtype is None and len(models) == 1:
        return next(iter(models.values())).copy()
    msg = f"{p} is a kvrag calibration with cost models for {sorted(models) or 'no dtype'}, not for {dtype}"
    raise ConfigError(msg)


def _number(v: JSONValue) -> float | None:
    """A summary's number field (missing or not a number: None)."""
    return v if isinstance(v, int | float) else None


def fit_cost_model(summary: Mapping[str, JSONValue], *, source: str = "", machine_kind: str | None = None,
                   dtype: str | None = None) -> CostModelRecord:
    """A cost model (its JSON form) from a ``kvrag bench`` summary: per method its mean stats, overhead and KL.

    Methods without a measured TTFT ratio, FLOP share or KL (e.g. a run without ``full``) are left out, and so is
    ``auto`` (a choice among the candidates); ``full`` itself is kept (KL 0, FLOP share 1) as the always-exact
    fallback.

    Args:
        summary: the bench's ``summary.json``.
        source: where it came from (recorded).
        machine_kind / dtype: what the benchmark ran on (:func:`kvrag.calibration.machine_kind`, e.g.
            'cpu-avx2', and 'float32'); default: the summary's ``machine`` record (``kind``, ``dtype``; what
            ``kvrag bench`` writes), else ``hardware.machine_kind`` and ``dtype`` (or ``config.dtype``).
    """
    hw, machine = as_object(summary.get("hardware")), as_object(summary.get("machine"))
    kind = machine_kind or machine.get("kind") or hw.get("machine_kind")
    dt = dtype or machine.get("dtype") or summary.get("dtype") or as_object(summary.get("config")).get("dtype")
    if not kind or not dt:
        msg = ("the summary does not record the machine kind and dtype it was measured on; pass them "
               "(kvrag bench fit-auto --machine-kind cpu-avx2 --dtype float32; see kvrag.calibration.machine_kind)")
        raise ConfigError(msg)
    cands: dict[str, Candidate] = {}
    for label, entry in as_object(summary.get("methods")).items():
        if label.split(":")[0] == "auto":  # a choice among the candidates, never one itself
            continue
        m = as_object(entry)
        ratio, share, kl = _number(m.get("ttft_ratio")), _number(m.get("flop_share")), _number(m.get("kl"))
        if ratio is None or not share or kl is None:
            continue
        mean = MethodStats.from_dict(as_object(m.get("method_stats_mean")))
        stats = MethodStats(recomputed_fraction=mean.recomputed_fraction,
                            attention_edges_ratio=mean.attention_edges_ratio,
                            attention_computed_ratio=mean.attention_computed_ratio,
                            score_edges_ratio=mean.score_edges_ratio)
        # repairer FLOPs scale with the context: store them per context token (repaired / repaired_fraction = Tc)
        part = mean.repair or MethodStats()
        rtok, rfrac = mean.repaired_tokens or part.repaired_tokens, mean.repaired_fraction or part.repaired_fraction
        per_token = mean.repairer_flops / (rtok / rfrac) if mean.repairer_flops and rtok and rfrac else None
        over = ratio / share
        cands[label] = Candidate(spec=label, kl=kl, ttft_ratio=ratio, flop_share=share, overhead=over,
                                 overhead_p90=_number(m.get("overhead_p90")) or over, stats=stats,
                                 repairer_flops_per_token=per_token)
    if not cands:
        msg = "the summary has no method with a TTFT ratio, FLOP share and KL (run kvrag bench with full among --methods)"
        raise ConfigError(msg)
    n = summary.get("n_requests")
    info: CostModelRecord = {"hardware": summary.get("hardware"), "git_sha": summary.get("git_sha"),
                             "n_requests": n if isinstance(n, int) else None}
    return CostModel(cands, machine_kind=str(kind), dtype=str(dt).removeprefix("torch."), source=source,
                     info=info).to_dict()


__all__ = ["COST_FORMAT", "SHIPPED_COST_MODEL", "Candidate", "CostModel", "fit_cost_model", "load_cost_model"]
