"""``auto`` on the machine it runs on: the cost model's machine kind and dtype, which cost model wins, and the
online correction from measured TTFTs (tiny models, real engine timings)."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvrag.calibration import Calibration, DtypeCalibration, machine_kind, save_calibration
from kvrag.engine.engine import KVRAGEngine
from kvrag.fusion import FusionInput, FusionMethod, FusionOutput, get_method
from kvrag.fusion import base as fusion_base
from kvrag.fusion.auto import Auto
from kvrag.fusion.cost import ModelCost
from kvrag.fusion.cost_model import SHIPPED_COST_MODEL, Candidate, CostModel, load_cost_model
from kvrag.fusion.online import OnlineCosts, Smoothed, forget, length_bucket, online_costs
from kvrag.fusion.stats import MethodStats
from kvrag.prompting import RagTemplate
from kvrag.store.memory import MemoryStore
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cand(spec: str, kl: float, overhead: float, **stats: float) -> Candidate:
    return Candidate(spec=spec, kl=kl, ttft_ratio=overhead, flop_share=1.0, overhead=overhead, overhead_p90=overhead,
                     stats=MethodStats(**stats))


def _write(path: Path, cm: CostModel) -> str:
    path.write_text(json.dumps(cm.to_dict()))
    return str(path)


# --- smoothing and buckets --------------------------------------------------------------------------------------
def test_smoothing_takes_the_first_value_then_averages() -> None:
    s = Smoothed()
    s.update(2.0, 0.3)
    assert s.value == 2.0
    s.update(1.0, 0.3)
    assert s.value == pytest.approx(0.7 * 2.0 + 0.3 * 1.0)
    for _ in range(40):
        s.update(1.0, 0.3)
    assert s.value == pytest.approx(1.0, abs=1e-5)


def test_length_buckets_double() -> None:
    assert [length_bucket(n) for n in (0, 511, 512, 1023, 1024, 2047, 2048, 5000)] == [0, 0, 1, 1, 2, 2, 3, 4]


def test_correction_falls_back_from_bucket_to_candidate() -> None:
    on = OnlineCosts()
    assert on.correction("c", "x", 1500, speed=None) == 1.0  # nothing measured
    on.observe_full(1e9, 2.0)  # full: 2e-9 s per FLOP
    speed = on.speed()
    assert speed == pytest.approx(2e-9)
    on.observe("c", "x", 1500, seconds=0.6, predicted_flop_seconds=1e8, speed=speed)  # 3x slower than predicted
    assert on.correction("c", "x", 1500, speed) == pytest.approx(3.0)
    assert on.correction("c", "x", 600, speed) == pytest.approx(3.0)  # other bucket: the candidate's value
    assert on.correction("c", "y", 1500, speed) == 1.0  # an unmeasured candidate is taken at its prediction
    on.observe("c", "x", 600, seconds=0.1, predicted_flop_seconds=1e8, speed=speed)  # its own bucket: 0.5x
    assert on.correction("c", "x", 600, speed) == pytest.approx(0.5)
    assert on.correction("c", "x", 1500, speed) == pytest.approx(3.0)
    assert on.correction("other", "x", 1500, speed) == 1.0  # another cost model's predictions are not this one's
    on.observe("c", "z", 1500, seconds=1e3, predicted_flop_seconds=1e8, speed=speed)  # a stall is clamped
    assert on.correction("c", "z", 1500, speed) == pytest.approx(20.0)


# --- which cost model ---------------------------------------------------------------------------------------------
def test_cost_model_order_file_then_calibrated_then_shipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    kind = "cpu-testkind"
    local = CostModel({"full": _cand("full", 0.0, 1.0, recomputed_fraction=1.0), "stale": _cand("stale", 0.5, 2.0)},
                      machine_kind=kind, dtype="float32", source="local")
    save_calibration(Calibration(kind, "tiny", 1, {"float32": DtypeCalibration("float32", 1.0, 1.0,
                                                                                cost_model=local.to_dict())}))
    given = _write(tmp_path / "given.json", CostModel({"full": _cand("full", 0.0, 1.0)}, machine_kind="x",
                                                      dtype="float32", source="given"))
    assert Auto().cost_model(kind, "float32").source == "local"  # calibrated here beats shipped
    assert Auto(costs=given).cost_model(kind, "float32").source == "given"  # costs=FILE beats both
    with caplog.at_level(logging.WARNING, logger="kvrag.fusion.auto"):
        auto = Auto()
        shipped = auto.cost_model(kind, "bfloat16")  # nothing calibrated for bf16: the shipped one, with a warning
        auto.cost_model(kind, "bfloat16")
        Auto().cost_model(kind, "bfloat16")
    assert shipped.path == str(SHIPPED_COST_MODEL)
    assert (shipped.machine_kind, shipped.dtype) == ("cpu-avx2", "float32")  # where it was fitted
    warned = [r for r in caplog.records if "kvrag calibrate" in r.getMessage()]
    assert len(warned) == 1 and kind in warned[0].getMessage()
    assert Auto().cost_model().path == str(SHIPPED_COST_MODEL)  # no kind / dtype: the shipped one


def test_shipped_cost_model_records_where_it_was_fitted() -> None:
    cm = load_cost_model()
    assert (cm.machine_kind, cm.dtype) == ("cpu-avx2", "float32") and "full" in cm.candidates
    assert cm.candidates["cacherepair"].repairer_flops_per_token  # a version-1 field, read where it was
    assert cm.speed_for("cpu-avx2", "float32", 1, ModelCost(1, 1.0, 1.0, 1.0)) is None  # no speed measured


# --- the online correction on a real engine -------------------------------------------------------------------------
class _VirtualClock:
    """An injected ``time`` for the engine's timings: ``perf_counter`` reads a virtual clock that only
    :meth:`advance` moves, so every measured TTFT is exactly the virtual seconds the methods below spend (the real
    compute takes none); the rest of :mod:`time` is the real one."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def perf_counter(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


FULL_S, STALE_S = 1.0, 0.2
"""Virtual TTFTs: full takes 1 s, stale 0.2 s (twice the 0.1x the cost model below believes)."""


class _Slowed(FusionMethod):
    """``stale`` plus ``delay`` virtual seconds: a candidate far slower here than its cost model predicts."""

    name = "slowed-test"
    params = {"delay": (float, 0.0)}
    delay: float
    clock: ClassVar[_VirtualClock | None] = None

    def fuse(self, inp: FusionInput) -> FusionOutput:
        out = get_method("stale").fuse(inp)
        assert self.clock is not None
        self.clock.advance(self.delay)
        return out


def _ttft(prep) -> float:  # type: ignore[no-untyped-def]
    t = prep.timings
    return t.fetch_s + t.assemble_s + t.repair_s + t.suffix_prefill_s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _VirtualClock:
    """The engine's clock made virtual, ``full`` costing :data:`FULL_S` and ``stale`` :data:`STALE_S` on it."""
    import kvrag.engine.engine
    import kvrag.engine.forwards
    import kvrag.kv.pieces
    from kvrag.fusion.full import Full
    from kvrag.fusion.stale import Stale

    vc = _VirtualClock()
    for mod in (kvrag.engine.engine, kvrag.engine.forwards, kvrag.kv.pieces):
        monkeypatch.setattr(mod, "time", vc)
    full_pieces, stale_fuse = Full.fuse_pieces, Stale.fuse

    def full(self, inp, pace):  # type: ignore[no-untyped-def]
        out = yield from full_pieces(self, inp, pace)
        vc.advance(FULL_S)
        return out

    def stale(self, inp):  # type: ignore[no-untyped-def]
        out = stale_fuse(self, inp)
        vc.advance(STALE_S)
        return out

    monkeypatch.setattr(Full, "fuse_pieces", full)
    monkeypatch.setattr(Stale, "fuse", stale)
    monkeypatch.setattr(_Slowed, "clock", vc)
    return vc


def test_auto_moves_off_a_slowed_candidate_and_keeps_its_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                clock: _VirtualClock) -> None:
    """The online correction on a real engine with an injected clock: the measured TTFTs are exact (virtual), so
    the choices, the measured ratios and the corrected prediction are asserted exactly, not against a wall clock
    another process can move."""
    from kvrag.calibrate import builtin_workload

    lm = tiny_model("llama")
    forget(lm.model)
    eng = KVRAGEngine(lm, MemoryStore())
    req = builtin_workload((4,))[0]  # ~2.1K tokens with the tiny tokenizer
    plan = eng.plan_parts(*RagTemplate().parts(eng.tokenizer, req.passages, req.question))
    eng.ingest(list(req.passages))
    fulls = [_ttft(eng.prepare(plan, "full")) for _ in range(3)]  # full's speed is learned too
    assert fulls == [pytest.approx(FULL_S)] * 3 and online_costs(lm.model).speed() is not None

    monkeypatch.setitem(fusion_base._REGISTRY, _Slowed.name, _Slowed)
    slowed = f"slowed-test:delay={4 * FULL_S}"
    tc, s = plan.context_len, len(plan.suffix.token_ids)
    share = ModelCost.from_config(lm.model.config).share(MethodStats(), tc, s)
    # the cost model believes the slowed candidate (the better KL) runs at 0.2x full and stale at 0.1x
    cm = CostModel({"full": _cand("full", 0.0, 1.0, recomputed_fraction=1.0),
                    slowed: _cand(slowed, 0.1, 0.2 / share), "stale": _cand("stale", 0.5, 0.1 / share)},
                   machine_kind=machine_kind(lm.device), dtype="float32")
    budget = 0.5
    auto = get_method(f"auto:budget={budget},costs={_write(tmp_path / 'c.json', cm)}")
    choices, ratios = [], []
    for _ in range(6):
        prep = eng.prepare(plan, auto)
        choices.append(prep.stats.method_stats.auto_choice)
        ratios.append(_ttft(prep) / FULL_S)
    assert choices[0] == slowed and ratios[0] == pytest.approx(4 + STALE_S)  # predicted 0.2x, measured 4.2x
    assert choices[1:] == ["stale"] * 5, choices  # measured once, then avoided
    assert ratios[1:] == [pytest.approx(STALE_S)] * 5, ratios  # what it moved to: within the budget
    last = eng.prepare(plan, auto).stats.method_stats
    # the corrected prediction is what was measured: stale's correction is 0.2 / 0.1 (the implied speed of its
    # first measurement, unchanged by equal ones after it)
    assert last.auto_predicted_ttft_ratio == pytest.approx(STALE_S), (last.auto_predicted_ttft_ratio, ratios)
    assert last.auto_correction == pytest.approx(STALE_S / 0.1)
    fixed = get_method(f"auto:budget={budget},costs={tmp_path / 'c.json'},adapt=0")
    assert [eng.prepare(plan, fixed).stats.method_stats.auto_choice for _ in range(2)] == [slowed] * 2  # uncorrected
