"""``auto`` on the machine it runs on: the cost model's machine kind and dtype, which cost model wins, and the
online correction from measured TTFTs (tiny models, real engine timings)."""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

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
class _Slowed(FusionMethod):
    """``stale`` plus a sleep of ``delay`` seconds: a candidate far slower here than its cost model predicts."""

    name = "slowed-test"
    params = {"delay": (float, 0.0)}
    delay: float

    def fuse(self, inp: FusionInput) -> FusionOutput:
        out = get_method("stale").fuse(inp)
        time.sleep(self.delay)
        return out


def _ttft(prep) -> float:  # type: ignore[no-untyped-def]
    t = prep.timings
    return t.fetch_s + t.assemble_s + t.repair_s + t.suffix_prefill_s


def test_auto_moves_off_a_slowed_candidate_and_keeps_its_budget(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrag.calibrate import builtin_workload

    lm = tiny_model("llama")
    forget(lm.model)
    eng = KVRAGEngine(lm, MemoryStore())
    req = builtin_workload((4,))[0]  # ~2.1K tokens with the tiny tokenizer
    plan = eng.plan_parts(*RagTemplate().parts(eng.tokenizer, req.passages, req.question))
    eng.ingest(list(req.passages))
    full_t = statistics.median(_ttft(eng.prepare(plan, "full")) for _ in range(5))  # full's speed is learned too
    assert online_costs(lm.model).speed() is not None

    monkeypatch.setitem(fusion_base._REGISTRY, _Slowed.name, _Slowed)
    slowed = f"slowed-test:delay={4 * full_t:.4f}"
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
        ratios.append(_ttft(prep) / full_t)
    assert choices[0] == slowed and ratios[0] > 4.0  # predicted within budget, measured far over it
    assert choices[1:] == ["stale"] * 5, choices  # measured once, then avoided
    # what it moved to is measured far below what it left (wall-clock ratios of a few-ms prefill vary with whatever
    # else the machine runs, e.g. another test worker, so the budget itself is a benchmark's claim, not this test's)
    assert max(ratios[1:]) < ratios[0] / 2, ratios
    last = eng.prepare(plan, auto).stats.method_stats
    measured = statistics.median(ratios[1:])
    # the corrected prediction tracks it: within 2x of the measured median, far from the 4x+ overrun it left (the
    # correction is an average over a few-ms prefill's wall clock, which another test worker can move by 60%)
    assert measured / 2 <= last.auto_predicted_ttft_ratio <= 2 * measured, (last.auto_predicted_ttft_ratio, ratios)
    assert last.auto_predicted_ttft_ratio < ratios[0] / 4
    assert last.auto_correction == pytest.approx(last.auto_predicted_ttft_ratio / 0.1)
    fixed = get_method(f"auto:budget={budget},costs={tmp_path / 'c.json'},adapt=0")
    assert [eng.prepare(plan, fixed).stats.method_stats.auto_choice for _ in range(2)] == [slowed] * 2  # uncorrected
