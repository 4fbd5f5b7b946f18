"""``auto``: pick the fusion method per request from its shape, under a TTFT budget (kvrag).

A cost model fitted from benchmark results (:func:`fit_cost_model` on a ``kvrag bench`` ``summary.json``; the
shipped one is ``kvrag/data/auto_cost.json``) holds, per candidate method, what it computed on the benchmark's
requests (mean ``method_stats``: recomputed states, attention pairs, scoring pass, repairer FLOPs per token), its
measured overhead factor (TTFT ratio / analytic FLOP share, see :mod:`kvrag.fusion.cost`) and its measured KL to
``full``. For a request with context length Tc and suffix S, every candidate's TTFT ratio is predicted as
``FLOP share(stats, Tc, S) * overhead``, where ``overhead`` is by default the p90 over the fitted requests of each
request's TTFT ratio over its own FLOP share (``margin='p90'``: the budget holds on about 9 of 10 requests like those
it was fitted on; ``margin='p50'`` uses the ratio of median TTFTs, which put the last fit's choice at 0.27x for a
0.30 budget with request-to-request noise of up to 25%). ``auto`` runs the lowest-KL candidate predicted within the
budget (the fastest one when none is), logs the choice, and reports it in ``method_stats`` (``auto_choice``,
``auto_predicted_ttft_ratio``, ``auto_budget``, ``auto_margin``, ``auto_chunks``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from kvrag.errors import ConfigError
from kvrag.fusion.base import FusionInput, FusionMethod, FusionOutput, register, shared_method
from kvrag.fusion.recompute import check_choice, check_ratio

log = logging.getLogger(__name__)

SHIPPED_COST_MODEL = Path(__file__).resolve().parent.parent / "data" / "auto_cost.json"
_STAT_KEYS = ("recomputed_fraction", "attention_edges_ratio", "attention_computed_ratio", "score_edges_ratio")


def fit_cost_model(summary: dict[str, Any], *, source: str = "") -> dict[str, Any]:
    """A cost model from a ``kvrag bench`` summary: per method its mean stats, overhead and KL.

    Methods without a measured TTFT ratio, FLOP share or KL (e.g. a run without ``full``) are left out; ``full``
    itself is kept (KL 0, FLOP share 1) as the always-exact fallback.
    """
    methods: dict[str, Any] = {}
    for label, m in (summary.get("methods") or {}).items():
        ratio, share, kl = m.get("ttft_ratio"), m.get("flop_share"), m.get("kl")
        if ratio is None or not share or kl is None:
            continue
        ms = m.get("method_stats_mean") or {}
        stats = {k: v for k, v in ms.items() if k in _STAT_KEYS}
        # repairer FLOPs scale with the context: store them per context token (repaired / repaired_fraction = Tc)
        rflops, rtok, rfrac = (ms.get(k) for k in ("repairer_flops", "repaired_tokens", "repaired_fraction"))
        rtok, rfrac = rtok or ms.get("repair_repaired_tokens"), rfrac or ms.get("repair_repaired_fraction")
        if rflops and rtok and rfrac:
            stats["repairer_flops_per_token"] = rflops / (rtok / rfrac)
        over = ratio / share
        methods[label] = {"spec": label, "kl": kl, "ttft_ratio": ratio, "flop_share": share, "overhead": over,
                          "overhead_p90": m.get("overhead_p90") or over, "stats": stats}
    if not methods:
        msg = "the summary has no method with a TTFT ratio, FLOP share and KL (run kvrag bench with full among --methods)"
        raise ConfigError(msg)
    return {"format": "kvrag-auto-cost", "version": 1, "source": source,
            "hardware": summary.get("hardware"), "git_sha": summary.get("git_sha"),
            "n_requests": summary.get("n_requests"), "methods": methods}


def load_cost_model(path: str | Path | None = None) -> dict[str, Any]:
    p = Path(path) if path else SHIPPED_COST_MODEL
    try:
        model = json.loads(p.read_text())
    except FileNotFoundError as e:
        msg = (f"auto: no cost model at {p}; fit one from a benchmark run with "
               "`kvrag bench fit-auto runs/bench/X/summary.json --out FILE` and pass auto:costs=FILE")
        raise ConfigError(msg) from e
    if model.get("format") != "kvrag-auto-cost" or not model.get("methods"):
        msg = f"{p} is not a kvrag auto cost model (format kvrag-auto-cost with a 'methods' table)"
        raise ConfigError(msg)
    return model


@register
class Auto(FusionMethod):
    """Per-request method choice under a TTFT budget (a fraction of ``full``'s TTFT), from a fitted cost model.

    Parameters:
        budget: TTFT budget as a fraction of full prefill's, in (0, 1] (default 0.3).
        costs: a cost-model JSON (default: the shipped ``kvrag/data/auto_cost.json``).
        margin: 'p90' (default: each candidate's p90 per-request overhead, a margin against request-to-request
            noise) or 'p50' (the overhead of the median TTFTs, no margin).
    """

    name = "auto"
    params = {"budget": (float, 0.3), "costs": (str, None), "margin": (str, "p90")}
    budget: float
    costs: str | None
    margin: str

    def validate(self) -> None:
        check_ratio(self.name, "budget", self.budget)
        check_choice(self.name, "margin", self.margin, ("p90", "p50"))
        self._model: dict[str, Any] | None = None

    def cost_model(self) -> dict[str, Any]:
        if self._model is None:
            self._model = load_cost_model(self.costs)
        return self._model

    def predict(self, model_config: Any, tc: int, s: int) -> list[tuple[str, float, float]]:
        """(spec, predicted TTFT ratio, KL) of every candidate for a request shape, fastest first."""
        from kvrag.fusion.cost import ModelCost

        cost = ModelCost.from_config(model_config)
        out = []
        for spec, m in self.cost_model()["methods"].items():
            if spec.startswith("auto"):
                continue
            stats = dict(m.get("stats") or {})
            if "repairer_flops_per_token" in stats:
                stats["repairer_flops"] = stats.pop("repairer_flops_per_token") * tc
            share = cost.share(stats, tc, s, full=spec == "full")
            # cost models fitted before the p90 was recorded have only the median overhead
            over = m.get("overhead_p90", m["overhead"]) if self.margin == "p90" else m["overhead"]
            out.append((spec, share * float(over), float(m["kl"])))
        return sorted(out, key=lambda x: x[1])

    def choose(self, model_config: Any, tc: int, s: int) -> tuple[str, float]:
        cands = self.predict(model_config, tc, s)
        within = [c for c in cands if c[1] <= self.budget]
        spec, ratio, _ = min(within, key=lambda c: (c[2], c[1])) if within else cands[0]
        return spec, ratio

    def fuse(self, inp: FusionInput) -> FusionOutput:
        s = int(inp.suffix_ids.shape[0])
        spec, ratio = self.choose(inp.model.config, inp.context_len, s)
        method = shared_method(spec)  # the process's instance (a checkpoint the engine loaded is not loaded again)
        chunks = sum(sp.kind == "chunk" for sp in inp.spans)
        log.info("auto: %s for %d context tokens in %d chunks (predicted TTFT %.2fx full, budget %.2f)", spec,
                 inp.context_len, chunks, ratio, self.budget)
        out = method.fuse(inp)
        out.stats = {**out.stats, "auto_choice": spec, "auto_predicted_ttft_ratio": ratio,
                     "auto_budget": self.budget, "auto_margin": self.margin, "auto_chunks": chunks}
        return out
