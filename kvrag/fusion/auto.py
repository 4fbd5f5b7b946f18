"""``auto``: pick the fusion method per request from its shape, under a TTFT budget (kvrag).

A cost model (:mod:`kvrag.fusion.cost_model`) holds, per candidate method, what it computed on its fitting requests
(mean :class:`~kvrag.fusion.stats.MethodStats`: recomputed states, attention pairs, scoring pass, repairer FLOPs per
token), its measured overhead factor (TTFT ratio / analytic FLOP share, see :mod:`kvrag.fusion.cost`) and its KL to
``full``. For a request with context length Tc and suffix S, every candidate's TTFT ratio is predicted as
``FLOP share(stats, Tc, S) * overhead * correction``, where ``overhead`` is by default the p90 over the fitted
requests of each request's TTFT ratio over its own FLOP share (``margin='p90'``: the budget holds on about 9 of 10
requests like those it was fitted on; ``margin='p50'`` uses the ratio of median TTFTs, which lets a choice land
above the budget on about half of the requests), and ``correction`` is what this
process measured (:mod:`kvrag.fusion.online`: per candidate and context-length bucket, the smoothed ratio of
achieved to predicted TTFT; 1 until measured). ``auto`` runs the lowest-KL candidate predicted within the budget
(the fastest one when none is), logs the choice, and reports it in its stats (``auto_choice``,
``auto_predicted_ttft_ratio``, ``auto_budget``, ``auto_margin``, ``auto_chunks``, ``auto_correction``).

The cost model is chosen per machine kind and dtype (:func:`kvrag.calibration.machine_kind`): ``auto:costs=FILE``,
else the one ``kvrag calibrate`` wrote for this kind and dtype, else the shipped one (fitted on an AVX2-only CPU in
float32; ``auto`` warns once when it runs elsewhere with it).

With ``agree=X`` ``auto`` keeps answers instead: it escalates one request's repair through a ladder of levels
(by default CacheRepair, then ``full``) until the first decode step is confident enough for an answer-agreement rate of
``X`` with ``full`` (:mod:`kvrag.fusion.escalate`), with the budget, when given, as a cap on the predicted TTFT.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import torch

from kvrag.calibration import load_calibration, machine_kind
from kvrag.errors import ConfigError
from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, Observation, register, shared_method
from kvrag.fusion.cost import ModelCost
from kvrag.fusion.cost_model import SHIPPED_COST_MODEL, CostModel, fit_cost_model, load_cost_model
from kvrag.fusion.escalate import (
    DEFAULT_LEVELS,
    Ladder,
    agree_table,
    level_spec,
    load_table,
    parse_levels,
    thresholds_for,
)
from kvrag.fusion.online import OnlineCosts, online_costs
from kvrag.fusion.recompute import check_choice, check_ratio
from kvrag.kv import pieces

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

_WARNED: set[tuple[str, str, str]] = set()
_WARNED_LOCK = threading.Lock()
_NO_REPAIRER: set[str] = set()  # model fingerprints found without a repairer: not searched for again, warned once


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One candidate's prediction for a request: ``ratio`` = base * correction (TTFT / full TTFT)."""

    spec: str
    ratio: float
    kl: float
    base: float
    correction: float = 1.0


def dtype_label(dtype: torch.dtype) -> str:
    """'float32' for torch.float32 (the names cost models and calibrations use)."""
    return str(dtype).removeprefix("torch.")


@register
class Auto(FusionMethod):
    """Per-request method choice under a TTFT budget (a fraction of ``full``'s TTFT), from a fitted cost model
    corrected by what this process measures.

    Parameters:
        budget: TTFT budget as a fraction of full prefill's, in (0, 1] (default 0.3; with ``agree``: a cap on the
            predicted TTFT of the escalation, default none).
        agree: target rate of answers equal to ``full``'s, in (0, 1]: escalate the repair per request until the
            first decode step is confident (:mod:`kvrag.fusion.escalate`); default none (pick by the budget).
        levels: the escalation ladder for ``agree``, '/'-separated recompute ratios (0: CacheRepair, between:
            ``hybrid:r``, 1: ``full``; default 0/1).
        checkpoint: the CacheRepair checkpoint the ladder, or a chosen ``cacherepair`` / ``hybrid``, uses
            (default: the shipped one for the model; without one the ladder starts from the stale cache and a
            choice by budget is among the training-free candidates).
        thresholds: a thresholds JSON for ``agree`` (``{"thresholds": {"0.9": [0.45], ...}}``, as
            ``kvrag_bench.fidelity_probe calibrate --write`` writes it; default: the shipped calibration for the
            model, else the default model's, :func:`kvrag.fusion.escalate.agree_table`).
        costs: a cost-model JSON, or a ``kvrag calibrate`` file (its cost model for the dtype auto runs in)
            (default: the calibrated one for this machine kind and dtype, else the shipped
            ``kvrag/data/auto_cost.json``).
        margin: 'p90' (default: each candidate's p90 per-request overhead, a margin against request-to-request
            noise) or 'p50' (the overhead of the median TTFTs, no margin).
        adapt: weight of a new measurement in the online correction, in [0, 1] (default 0.3; 0: no correction,
            the cost model's predictions as they are).
    """

    name = "auto"
    reads_canonical_keys = True  # it may choose cacherepair or hybrid
    params = {"budget": (float, None), "costs": (str, None), "margin": (str, "p90"), "adapt": (float, 0.3),
              "agree": (float, None), "levels": (str, None), "checkpoint": (str, None), "thresholds": (str, None)}
    budget: float  # None only with agree (no cap)
    costs: str | None
    margin: str
    adapt: float
    agree: float | None
    levels: str | None
    checkpoint: str | None
    thresholds: str | None

    def validate(self) -> None:
        self.cap: float | None = self.budget  # agree: the budget is a cap, none unless given
        if self.agree is None:
            self.budget = 0.3 if self.budget is None else self.budget
            if self.levels is not None or self.thresholds is not None:
                msg = f"method {self.name!r}: levels and thresholds belong to agree=...; pass agree too"
                raise ConfigError(msg)
        else:
            check_ratio(self.name, "agree", self.agree, "a target rate of answers equal to full's")
            self.ladder_levels = parse_levels(self.levels) if self.levels is not None else DEFAULT_LEVELS
            if self.thresholds is not None:
                load_table(self.thresholds)  # a bad file is an error here, not in a request
        if self.budget is not None:
            check_ratio(self.name, "budget", self.budget, "a fraction of full's TTFT")
        check_choice(self.name, "margin", self.margin, ("p90", "p50"))
        if not 0.0 <= self.adapt <= 1.0:
            msg = f"method {self.name!r}: adapt (weight of a new measurement) must be in [0, 1], got {self.adapt}"
            raise ConfigError(msg)
        self._models: dict[tuple[str, str] | None, CostModel] = {}
        self._lock = threading.Lock()

    def cost_model(self, kind: str | None = None, dtype: str | None = None) -> CostModel:
        """The cost model for a machine kind and dtype: ``costs=FILE``, else the calibrated one for (kind, dtype)
        (``kvrag calibrate``), else the shipped one. Without kind and dtype: ``costs=FILE`` or the shipped one."""
        key = (kind, dtype) if kind and dtype and not self.costs else None
        with self._lock:
            cm = self._models.get(key)
        if cm is not None:
            return cm
        if self.costs:
            cm = load_cost_model(self.costs, dtype)
        else:
            cal = load_calibration(kind) if key else None
            local = cal.cost_model(dtype) if cal is not None and dtype else None
            cm = CostModel.from_dict(local, cal.path) if cal is not None and local else load_cost_model()
        if key and not cm.fitted_for(*key):
            self._warn_foreign(cm, *key)
        with self._lock:
            return self._models.setdefault(key, cm)

    @staticmethod
    def _warn_foreign(cm: CostModel, kind: str, dtype: str) -> None:
        where = cm.path or str(SHIPPED_COST_MODEL)
        with _WARNED_LOCK:
            if (where, kind, dtype) in _WARNED:
                return
            _WARNED.add((where, kind, dtype))
        log.warning("auto: the cost model %s was fitted on %s in %s, but this runs on %s in %s; its TTFT "
                    "predictions may miss the budget until corrected by measurements. Run `kvrag calibrate` to "
                    "fit one for this machine.", where, cm.machine_kind or "an unrecorded machine",
                    cm.dtype or "an unrecorded dtype", kind, dtype)

    def predictions(self, model_config: PretrainedConfig, tc: int, s: int, cm: CostModel | None = None,
                    online: OnlineCosts | None = None, speed: float | None = None) -> list[Prediction]:
        """Every candidate's prediction for a request shape, fastest first (``online`` / ``speed``: the process's
        measurements and full's seconds per FLOP; without them, uncorrected)."""
        cm = cm or self.cost_model()
        cost = ModelCost.from_config(model_config)
        costs_id = _costs_id(cm)
        out = []
        for spec, c in cm.candidates.items():
            if spec.startswith("auto"):
                continue
            share = cost.share(c.request_stats(tc), tc, s, full=spec == "full")
            base = share * (c.overhead_p90 if self.margin == "p90" else c.overhead)
            corr = 1.0 if online is None or spec == "full" else online.correction(costs_id, spec, tc, speed)
            out.append(Prediction(spec, base * corr, c.kl, base, corr))
        return sorted(out, key=lambda p: p.ratio)

    def predict(self, model_config: PretrainedConfig, tc: int, s: int) -> list[tuple[str, float, float]]:
        """(spec, predicted TTFT ratio, KL) of every candidate (uncorrected), fastest first."""
        return [(p.spec, p.ratio, p.kl) for p in self.predictions(model_config, tc, s)]

    def pick(self, preds: list[Prediction]) -> Prediction:
        """The lowest-KL prediction within the budget, else the fastest."""
        within = [p for p in preds if p.ratio <= self.budget]
        return min(within, key=lambda p: (p.kl, p.ratio)) if within else preds[0]

    def choose(self, model_config: PretrainedConfig, tc: int, s: int) -> tuple[str, float]:
        """(spec, predicted ratio) ``auto`` picks for a request shape, uncorrected."""
        p = self.pick(self.predictions(model_config, tc, s))
        return p.spec, p.ratio

    def _context(self, model: PreTrainedModel, device: torch.device,
                 dtype: torch.dtype) -> tuple[CostModel, OnlineCosts | None, float | None, str, str]:
        kind, dt = machine_kind(device), dtype_label(dtype)
        cm = self.cost_model(kind, dt)
        if self.adapt <= 0:
            return cm, None, None, kind, dt
        online = online_costs(model)
        prior = cm.speed_for(kind, dt, torch.get_num_threads(), ModelCost.from_config(model.config))
        return cm, online, online.speed(prior), kind, dt

    def fuse(self, inp: FusionInput) -> FusionOutput:
        return pieces.run_whole(self.fuse_pieces(inp, pieces.WHOLE))  # type: ignore[no-any-return]

    def fuse_pieces(self, inp: FusionInput, pace: pieces.Pace) -> Generator[None, None, FusionOutput]:
        """The chosen method's pieces (:meth:`FusionMethod.fuse_pieces`), or the ladder's with ``agree``."""
        s = int(inp.suffix_ids.shape[0])
        if self.agree is not None and self.cap is None:  # the ladder without a TTFT cap reads no cost model
            return (yield from self._escalate(inp, pace, []))
        cm, online, speed, _, _ = self._context(inp.model, inp.keys.device, inp.keys.dtype)
        preds = self.predictions(inp.model.config, inp.context_len, s, cm, online, speed)
        if self.agree is not None:
            return (yield from self._escalate(inp, pace, preds))
        if not self._has_repairer(inp):  # a model without a repairer: only the training-free candidates
            preds = [q for q in preds if not q.spec.startswith(("cacherepair", "hybrid"))] or preds
        p = self.pick(preds)
        learned = p.spec.startswith(("cacherepair", "hybrid"))
        given = {"checkpoint": self.checkpoint} if self.checkpoint and learned else {}
        method = shared_method(p.spec, **given)  # the process's instance (a checkpoint loaded is not loaded again)
        chunks = sum(sp.kind == "chunk" for sp in inp.spans)
        log.info("auto: %s for %d context tokens in %d chunks (predicted TTFT %.2fx full, correction %.2f, "
                 "budget %.2f)", p.spec, inp.context_len, chunks, p.ratio, p.correction, self.budget)
        out = yield from method.fuse_pieces(inp, pace)
        out.stats = dataclasses.replace(out.stats, auto_choice=p.spec, auto_predicted_ttft_ratio=p.ratio,
                                        auto_budget=self.budget, auto_margin=self.margin, auto_chunks=chunks,
                                        auto_correction=p.correction)
        return out

    def _has_repairer(self, inp: FusionInput) -> bool:
        """Whether CacheRepair (and so ``hybrid``) can run for ``inp``'s model: an explicit ``checkpoint`` is
        trusted (a mismatch is an error there), else a shipped repairer must exist for the model."""
        if self.checkpoint:
            return True
        if inp.spec.model_fingerprint in _NO_REPAIRER:  # (a found one is memoized by CacheRepair itself)
            return False
        from kvrag.errors import KVRAGError
        from kvrag.fusion.cacherepair import CacheRepair

        repair = shared_method(CacheRepair())
        assert isinstance(repair, CacheRepair)
        try:
            repair.checkpoint_for(inp)
        except KVRAGError:
            with _WARNED_LOCK:
                if inp.spec.model_fingerprint not in _NO_REPAIRER:
                    _NO_REPAIRER.add(inp.spec.model_fingerprint)
                    log.warning("auto: no repairer for this model; choosing among the training-free candidates "
                                "only (train one with `kvrag train-repairer` and pass auto:checkpoint=DIR)")
            return False
        return True

    def ladder_allowed(self, preds: list[Prediction]) -> Callable[[str, list[str]], bool]:
        """Whether the ladder may run ``spec`` after the ``ran`` ones: their predicted TTFT ratios added up (a
        ``hybrid`` after CacheRepair pays only its recompute) within the budget. A spec the cost model does not
        hold is predicted at the budget's limit: allowed only without a cap."""
        ratio = {p.spec: p.ratio for p in preds}
        repair = ratio.get("cacherepair", 0.0)

        def cost(spec: str, after: list[str]) -> float | None:
            if spec == "full":
                return ratio.get("full", 1.0)
            if spec not in ratio:
                return None
            shared = repair if spec.startswith("hybrid") and after else 0.0
            return max(0.0, ratio[spec] - shared)

        def allowed(spec: str, ran: list[str]) -> bool:
            if self.cap is None:
                return True
            costs = [cost(s, ran[:i]) for i, s in enumerate([*ran, spec])]
            return None not in costs and sum(c for c in costs if c is not None) <= self.cap

        return allowed

    def _escalate(self, inp: FusionInput, pace: pieces.Pace,
                  preds: list[Prediction]) -> Generator[None, None, FusionOutput]:
        assert self.agree is not None
        levels = self.ladder_levels
        table = agree_table(inp.model, self.thresholds)
        ladder = Ladder(levels, thresholds_for(self.agree, len(levels), table), self.ladder_allowed(preds),
                        self.checkpoint)
        out = yield from ladder.run(inp, pace)
        chunks = sum(sp.kind == "chunk" for sp in inp.spans)
        st = out.stats
        log.info("auto: %s for %d context tokens in %d chunks after levels %s (first-token confidence %s; %s)",
                 st.auto_choice, inp.context_len, chunks, st.auto_levels,
                 [round(c, 3) for c in st.auto_confidences or []], st.auto_reason)
        out.stats = dataclasses.replace(st, auto_agree=self.agree, auto_budget=self.cap, auto_chunks=chunks)
        return out

    def kept_context_threshold(self, level: str | None, model: torch.nn.Module | None = None) -> float | None:
        """With ``agree``, a next turn over a context the ladder left below ``full`` re-checks the first token: the
        threshold of the level it was left at (a recomputing request would check its own first token there too).
        None: no ``agree``, the context is already ``full``'s, the ladder does not end at ``full``, or ``full`` is
        over the budget's cap."""
        if self.agree is None or level is None or level == "full" or (self.cap is not None and self.cap < 1.0):
            return None
        levels = self.ladder_levels
        if levels[-1] < 1.0 or len(levels) < 2:
            return None
        at = next((i for i, x in enumerate(levels[:-1]) if level in (level_spec(x, True), level_spec(x, False))), 0)
        return thresholds_for(self.agree, len(levels), agree_table(model, self.thresholds))[at]

    def observe(self, obs: Observation) -> None:
        """Learn from a request ``auto`` served: full's speed when it ran ``full``, else the chosen candidate's
        achieved / predicted TTFT (see :mod:`kvrag.fusion.online`). An escalation that ran several levels says
        nothing about one candidate's speed and is not learned from."""
        spec = obs.stats.auto_choice
        if spec is None or self.adapt <= 0 or len(obs.stats.auto_levels or [spec]) > 1:
            return
        if self.agree is not None and self.cap is None:  # its choices read no predictions (nor a cost model)
            return
        param = next(obs.model.parameters())
        cm, online, speed, _, _ = self._context(obs.model, param.device, param.dtype)
        cand = cm.candidates.get(spec)
        if online is None or cand is None:
            return
        tc, s = obs.context_tokens, obs.suffix_tokens
        cost = ModelCost.from_config(obs.model.config)
        full_flops = cost.full_prefill(tc, s)
        if spec == "full":
            online.observe_full(full_flops, obs.ttft_s, self.adapt)
            return
        base = cost.share(cand.request_stats(tc), tc, s) * cand.overhead  # the median prediction, no margin
        online.observe(_costs_id(cm), spec, tc, obs.ttft_s, full_flops * base, speed, self.adapt)


def _costs_id(cm: CostModel) -> str:
    return cm.path or f"<cost model {id(cm)}>"


__all__ = ["Auto", "Prediction", "fit_cost_model", "load_cost_model"]
