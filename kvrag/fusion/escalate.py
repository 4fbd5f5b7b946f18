"""``auto:agree=...``: escalate the repair of one request until its first token is confidently the one ``full`` gives.

A reused cache changes the answer on some requests and not on others, and the request itself says which: when the
repaired cache leaves the model unsure of its first answer token (a low top-1 probability of the first decode
step's distribution), the answer is much more likely to differ from ``full``'s. :class:`Ladder` runs a ladder of
repair levels on the request's own KV buffer, each building on the previous one in place:

* level ``0``: CacheRepair over the stale cache (``stale`` when the model has no repairer), then the question
  suffix; its first-step distribution is the first signal;
* a level ``r`` in (0, 1): RelaxKV's anchors at ratio ``r`` scored on the cache as the previous level left it, each
  target recomputed with its full causal prefix and the suffix folded in (the first one is exactly
  ``hybrid:r=...``);
* level ``1``: a full prefill of context and suffix (exactly ``full``'s computation on the request's ids: the prompt
  string's own tokenization where a chunk was spliced inexactly, :attr:`FusionInput.prompt_ids`).

After each level the first decode step's top-1 probability is compared with the level's threshold for the asked
agreement rate (:data:`AGREE_THRESHOLDS`, calibrated on dev rows: the lowest top-1 probability at which the answers
of that level's requests still matched ``full``'s at the asked rate). At or above it the level's cache is the
answer's; below it the next level runs, while the cost model predicts it within the TTFT budget (a cap). What was
tried and why the ladder stopped is in the method statistics (``auto_levels``, ``auto_confidences``,
``auto_reason``).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Generator, Sequence
from pathlib import Path

import torch

from kvrag.errors import ConfigError, KVRAGError
from kvrag.fusion.base import FusionInput, FusionOutput, shared_method
from kvrag.fusion.stats import MethodStats
from kvrag.kv import pieces

log = logging.getLogger(__name__)

DEFAULT_LEVELS = (0.0, 1.0)
"""The default ladder: CacheRepair, then ``full``. A ``hybrid`` level between them kept few more answers on dev rows:
a request whose first token is unsure after CacheRepair is mostly still unsure after ``hybrid:r=0.015``."""

AGREE_THRESHOLDS: dict[float, tuple[float, ...]] = {
    0.5: (0.2,),
    0.6: (0.2,),
    0.7: (0.25,),
    0.8: (0.35,),
    0.9: (0.45,),
    0.95: (0.55,),
    1.0: (1.01,),
}
"""Per agreement target, the top-1 probability a level must reach to keep its answer (one value for every level;
a row may give one per level). A target between two rows takes the stricter row. Calibrated on qa_dev rows 0-24
(SmolLM2-135M-Instruct, the benchmark's template, 24 answer tokens): for each target the lowest threshold, in steps
of 0.05, at which the ladder CacheRepair -> ``full`` kept ``full``'s normalized answer on at least that share of
the requests (see docs/methods.md#keeping-fulls-answer)."""


MODEL_THRESHOLDS = Path(__file__).resolve().parents[1] / "data" / "agree_thresholds.json"
"""Thresholds calibrated for other models than the default, keyed by :func:`model_key` (each entry's ``thresholds``
has the form of :data:`AGREE_THRESHOLDS`, for the ladder its ``levels`` name); a model without an entry takes
:data:`AGREE_THRESHOLDS`."""

Table = dict[float, tuple[float, ...]]


def model_key(model: torch.nn.Module) -> str:
    """What a threshold calibration is keyed by: the text model's type, depth, width and vocabulary (e.g.
    ``gemma3_text:18x640:v262144``), the same however the model was loaded (a GGUF file, a checkpoint folder)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return (f"{getattr(text, 'model_type', '?')}:{getattr(text, 'num_hidden_layers', '?')}x"
            f"{getattr(text, 'hidden_size', '?')}:v{getattr(text, 'vocab_size', '?')}")


def parse_table(raw: object, where: str) -> Table:
    """``{"0.9": [0.45], ...}`` (targets in (0, 1] to per-level thresholds) as a table; ConfigError naming ``where``."""
    msg = (f"{where}: agreement thresholds must map targets in (0, 1] to lists of top-1 probabilities in [0, 1], "
           'e.g. {"0.9": [0.45]} (python -m kvrag_bench.fidelity_probe calibrate RUN --write FILE writes one)')
    try:
        table = {float(k): tuple(float(t) for t in v) for k, v in raw.items()} if isinstance(raw, dict) else {}
    except (TypeError, ValueError) as e:
        raise ConfigError(msg) from e
    if not table or not all(0.0 < k <= 1.0 and v and all(0.0 <= t <= 1.01 for t in v) for k, v in table.items()):
        raise ConfigError(msg)
    return table


@functools.cache
def _shipped() -> dict[str, Table]:
    data = json.loads(MODEL_THRESHOLDS.read_text())
    return {key: parse_table(entry["thresholds"], f"{MODEL_THRESHOLDS.name} {key}")
            for key, entry in data["models"].items()}


@functools.cache
def load_table(path: str) -> Table:
    """A thresholds file (``auto:agree=X,thresholds=FILE``): ``{"thresholds": {"0.9": [0.45], ...}}``."""
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        msg = f"method 'auto': cannot read the thresholds file {path!r}: {e}"
        raise ConfigError(msg) from e
    return parse_table(data.get("thresholds") if isinstance(data, dict) else None, path)


def agree_table(model: torch.nn.Module | None, path: str | None = None) -> Table:
    """The thresholds ``auto:agree`` uses for ``model``: ``path``'s, else the shipped calibration for the model
    (:data:`MODEL_THRESHOLDS`), else :data:`AGREE_THRESHOLDS` (calibrated on the default model)."""
    if path:
        return load_table(path)
    if model is None:
        return AGREE_THRESHOLDS
    key = model_key(model)
    table = _shipped().get(key)
    if table is None:
        if key not in _uncalibrated:
            _uncalibrated.add(key)
            log.info("auto:agree: no threshold calibration for %s; using the default model's (calibrate yours: "
                     "docs/methods.md#keeping-fulls-answer)", key)
        return AGREE_THRESHOLDS
    return table


_uncalibrated: set[str] = set()


def thresholds_for(agree: float, levels: int, table: Table | None = None) -> tuple[float, ...]:
    """The confidence thresholds of the first ``levels - 1`` levels for an agreement target in (0, 1], from
    ``table`` (default :data:`AGREE_THRESHOLDS`)."""
    table = AGREE_THRESHOLDS if table is None else table
    keys = sorted(table)
    i = min(bisect.bisect_left(keys, agree - 1e-9), len(keys) - 1)
    row = table[keys[i]]
    need = max(0, levels - 1)
    return tuple(row[min(j, len(row) - 1)] for j in range(need))


def parse_levels(text: str) -> tuple[float, ...]:
    """``"0/0.015/1"`` -> (0.0, 0.015, 1.0): ascending recompute ratios in [0, 1]."""
    try:
        levels = tuple(float(x) for x in text.split("/") if x.strip())
    except ValueError as e:
        msg = f"method 'auto': levels must be '/'-separated ratios in [0, 1], e.g. 0/0.015/1, got {text!r}"
        raise ConfigError(msg) from e
    if not levels or any(not 0.0 <= x <= 1.0 for x in levels) or list(levels) != sorted(set(levels)):
        msg = (f"method 'auto': levels must be strictly ascending ratios in [0, 1] (0: CacheRepair only, 1: full), "
               f"e.g. 0/0.015/1, got {text!r}")
        raise ConfigError(msg)
    return levels


def first_step_confidence(logits: torch.Tensor) -> float:
    """The top-1 probability of the next-token distribution ``softmax(logits)`` (computed in float32)."""
    return float(torch.softmax(logits.detach().float(), dim=-1).max())


def level_spec(level: float, repaired: bool) -> str:
    """The method a ladder level computes when it runs from the stale cache: ``cacherepair`` / ``stale`` (0),
    ``hybrid:r=...`` / ``relaxkv:r=...,context=full`` (between), ``full`` (1)."""
    if level >= 1.0:
        return "full"
    if level <= 0.0:
        return "cacherepair" if repaired else "stale"
    return f"hybrid:r={level:g}" if repaired else f"relaxkv:r={level:g},context=full"


@dataclasses.dataclass
class Ladder:
    """The escalation of one ``auto:agree`` request (see the module docstring).

    Attributes:
        levels: ascending recompute ratios (0: CacheRepair, 1: full).
        thresholds: the top-1 probability each level but the last must reach to stop there.
        allowed: whether a level's method, run after the specs already run, is predicted within the TTFT budget
            (``(spec, ran) -> bool``); the first level always runs.
        checkpoint: the CacheRepair checkpoint (None: the shipped one for the model).
    """

    levels: Sequence[float]
    thresholds: Sequence[float]
    allowed: Callable[[str, list[str]], bool]
    checkpoint: str | None = None

    def run(self, inp: FusionInput, pace: pieces.Pace) -> Generator[None, None, FusionOutput]:
        from kvrag.fusion.full import Full
        from kvrag.fusion.relaxkv import RelaxKV

        work = inp.owned()  # every level writes in place, building on the previous one
        tc = work.context_len
        tried: list[float] = []
        confs: list[float] = []
        repaired = False
        repair_stats: MethodStats | None = None
        out: FusionOutput | None = None
        reason = "last level"
        for i, level in enumerate(self.levels):
            spec = level_spec(level, repaired)
            if i > 0 and not self.allowed(spec, [level_spec(x, repaired) for x in tried]):
                reason = f"{spec} predicted over the TTFT budget"
                break
            if level >= 1.0:
                out = yield from Full().fuse_pieces(work, pace)
            elif level <= 0.0:
                repaired, repair_stats = self._repair(work)
                yield from pace.boundary()
                keys, values = work.working_kv()
                cache = work.cache_over(keys, values)
                logits, cache = yield from pieces.forward_pieces(work.model, work.suffix_ids, cache, start=tc,
                                                                 pace=pace)
                out = FusionOutput(cache=cache, last_logits=logits[-1], stats=repair_stats or MethodStats())
            else:
                relax = shared_method(RelaxKV(r=level, context="full"))
                out = yield from relax.fuse_pieces(work, pace)
                if out.last_logits is None:  # the suffix was not folded: prefill it over the repaired cache
                    logits, cache = yield from pieces.forward_pieces(work.model, work.suffix_ids, out.cache,
                                                                     start=tc, pace=pace)
                    out = FusionOutput(cache=cache, last_logits=logits[-1], stats=out.stats)
            assert out.last_logits is not None
            tried.append(level)
            confs.append(first_step_confidence(out.last_logits))
            if i == len(self.levels) - 1:
                reason = "last level"
                break
            if confs[-1] >= self.thresholds[i]:
                reason = f"top-1 probability {confs[-1]:.3f} >= {self.thresholds[i]:.3f}"
                break
        assert out is not None
        stats = out.stats
        if repair_stats is not None and 0.0 < tried[-1] < 1.0:
            part = dataclasses.replace(repair_stats, repairer_flops=None)
            stats = dataclasses.replace(stats, repair=part, repairer_flops=repair_stats.repairer_flops or 0.0)
        stats = dataclasses.replace(stats, auto_choice=level_spec(tried[-1], repaired), auto_levels=tried,
                                    auto_confidences=confs, auto_reason=reason)
        return FusionOutput(cache=out.cache, last_logits=out.last_logits, stats=stats,
                            prompt_tokenized=out.prompt_tokenized)

    def _repair(self, work: FusionInput) -> tuple[bool, MethodStats | None]:
        """CacheRepair in place when the model has a repairer; (False, None) leaves the stale cache."""
        from kvrag.fusion.cacherepair import CacheRepair

        try:
            rep = shared_method(CacheRepair(checkpoint=self.checkpoint)).fuse(work)
        except KVRAGError:
            if self.checkpoint:  # an explicitly given checkpoint that does not fit is an error
                raise
            return False, None
        return True, rep.stats


__all__ = ["AGREE_THRESHOLDS", "DEFAULT_LEVELS", "MODEL_THRESHOLDS", "Ladder", "agree_table", "first_step_confidence",
           "level_spec", "load_table", "model_key", "parse_levels", "parse_table", "thresholds_for"]
