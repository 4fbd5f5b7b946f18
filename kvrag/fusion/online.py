"""What ``auto`` learns in the running process: how fast ``full`` really is, and how far each candidate's cost-model
prediction is from what it achieves here.

A cost model predicts a candidate's TTFT as a ratio of full's (:mod:`kvrag.fusion.cost_model`). Fitted on another
machine, dtype or load, that ratio can be off (bf16 shrinks GEMM time but not per-request overhead). The engine
reports every request's measured TTFT (:meth:`kvrag.fusion.base.FusionMethod.observe`); from those, per model:

* ``seconds_per_flop``: a full prefill's seconds per analytic FLOP, an exponentially smoothed mean over the
  requests ``full`` served (directly or as ``auto``'s choice);
* per (cost model, candidate, context-length bucket), the smoothed *implied speed*: measured TTFT / (full-prefill
  FLOPs x the candidate's predicted ratio). Divided by ``seconds_per_flop`` it is the factor by which the candidate
  is slower (> 1) or faster than predicted, i.e. the smoothed ratio of achieved to predicted TTFT ratio.

The correction of a candidate in a bucket falls back to the candidate's over all buckets, then to 1: a candidate
not measured yet is taken at its prediction, so it is tried when it is the best choice and corrected from then on
(a pessimistic prior, e.g. the other candidates' mean correction, would let one slow candidate keep every other
one from being tried, and push ``auto`` to ``full``). Storing implied speeds rather than ratios lets corrections
gathered before ``full`` ever ran apply as soon as its speed is known.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_ALPHA = 0.3
"""Weight of a new measurement in the smoothed values (request-to-request TTFT noise is up to ~25%)."""
RATIO_CLAMP = (0.05, 20.0)
"""Bounds of one measurement's ratio to its prediction (a stalled request must not flip every later choice)."""


def length_bucket(tc: int) -> int:
    """Context-length bucket: 0 below 512 tokens, then one per doubling (512-1023: 1, 1024-2047: 2, ...)."""
    return max(0, int(tc).bit_length() - 9)


@dataclasses.dataclass
class Smoothed:
    """An exponentially smoothed value: the first measurement as it is, then ``(1 - alpha) v + alpha x``."""

    value: float = 0.0
    count: int = 0

    def update(self, x: float, alpha: float) -> None:
        self.value = x if self.count == 0 else (1.0 - alpha) * self.value + alpha * x
        self.count += 1


class OnlineCosts:
    """One model's measurements in this process (thread-safe); see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.full_speed = Smoothed()
        # (costs, spec, bucket) and (costs, spec) -> smoothed implied seconds per FLOP
        self._implied: dict[tuple[str | int, ...], Smoothed] = {}

    def observe_full(self, full_flops: float, seconds: float, alpha: float = DEFAULT_ALPHA) -> None:
        """A full prefill of ``full_flops`` FLOPs took ``seconds``."""
        if full_flops > 0 and seconds > 0:
            with self._lock:
                self.full_speed.update(seconds / full_flops, alpha)

    def speed(self, prior: float | None = None) -> float | None:
        """Seconds per full-prefill FLOP: measured here, else ``prior`` (a calibrated cost model's), else None."""
        return self.full_speed.value if self.full_speed.count else prior

    def observe(self, costs: str, spec: str, tc: int, seconds: float, predicted_flop_seconds: float,
                speed: float | None, alpha: float = DEFAULT_ALPHA) -> None:
        """Candidate ``spec`` of cost model ``costs`` took ``seconds`` on a context of ``tc`` tokens, where its
        uncorrected prediction was ``predicted_flop_seconds`` full-prefill FLOPs' worth of time (full-prefill
        FLOPs x predicted ratio). ``speed``: the current seconds per FLOP, used only to clamp outliers."""
        if seconds <= 0 or predicted_flop_seconds <= 0:
            return
        implied = seconds / predicted_flop_seconds
        if speed:
            lo, hi = RATIO_CLAMP
            implied = min(max(implied, lo * speed), hi * speed)
        with self._lock:
            for key in _keys(costs, spec, tc):
                self._implied.setdefault(key, Smoothed()).update(implied, alpha)

    def correction(self, costs: str, spec: str, tc: int, speed: float | None) -> float:
        """Achieved / predicted TTFT ratio of a candidate here (1.0 without a measured speed or measurement)."""
        if not speed:
            return 1.0
        with self._lock:
            for key in _keys(costs, spec, tc):  # the bucket, then the candidate over all buckets
                s = self._implied.get(key)
                if s is not None and s.count:
                    return s.value / speed
        return 1.0


def _keys(costs: str, spec: str, tc: int) -> tuple[tuple[str | int, ...], ...]:
    return (costs, spec, length_bucket(tc)), (costs, spec)


_STATE: weakref.WeakKeyDictionary[PreTrainedModel, OnlineCosts] = weakref.WeakKeyDictionary()
_STATE_LOCK = threading.Lock()


def online_costs(model: PreTrainedModel) -> OnlineCosts:
    """The process's measurements for ``model`` (created on first use, dropped with the model)."""
    with _STATE_LOCK:
        st = _STATE.get(model)
        if st is None:
            st = _STATE[model] = OnlineCosts()
        return st


def forget(model: PreTrainedModel) -> None:
    """Drop what was measured for ``model`` (e.g. after its threads or load changed a lot)."""
    with _STATE_LOCK:
        _STATE.pop(model, None)


__all__ = ["DEFAULT_ALPHA", "OnlineCosts", "Smoothed", "forget", "length_bucket", "online_costs"]
