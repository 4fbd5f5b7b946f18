"""Machine kinds, calibration files, and ``kvrag calibrate`` on a tiny model with a tiny workload."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from kvrag import calibration
from kvrag.calibrate import CalibrationRequest, builtin_workload, run_calibration
from kvrag.calibration import Calibration, DtypeCalibration, load_calibration, machine_kind, save_calibration
from kvrag.fusion.auto import Auto, fit_cost_model
from kvrag.fusion.cost import ModelCost
from kvrag.fusion.cost_model import CostModel
from kvrag.kv import row_attention
from kvrag.prompting import render_passage
from kvrag_testing.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(("flags", "kind"), [({"avx2", "amx_bf16", "avx512_bf16"}, "cpu-amx"),
                                             ({"avx2", "avx512_bf16"}, "cpu-avx512bf16"),
                                             ({"avx2", "fma"}, "cpu-avx2"), (set(), "cpu")])
def test_cpu_machine_kinds(monkeypatch: pytest.MonkeyPatch, flags: set[str], kind: str) -> None:
    monkeypatch.setattr(calibration, "cpu_flags", lambda: frozenset(flags))
    assert machine_kind("cpu") == kind


def test_cuda_machine_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200 (MIG 1g)")
    assert machine_kind("cuda:0") == "cuda-nvidia-h200-mig-1g"


def _dc(dtype: str, ttft: float, decode_ms: float) -> DtypeCalibration:
    return DtypeCalibration(dtype, 1000.0, decode_ms, {"stale": ttft}, {"stale": ttft + 32 * decode_ms / 1000})


def test_preferred_dtype_is_the_faster_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 prefills faster but decodes slower: over TTFT + 32 tokens fp32 wins
    cal = Calibration("cpu-x", "m", 1, {"bfloat16": _dc("bfloat16", 0.2, 170.0), "float32": _dc("float32", 0.35, 110.0)})
    assert cal.preferred_dtype == "float32"
    assert Calibration("cpu-x", "m", 1).preferred_dtype is None
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    assert load_calibration("cpu-x") is None
    save_calibration(Calibration("cpu-x", "m", 1, {"float32": _dc("float32", 0.35, 110.0)}))
    save_calibration(Calibration("cpu-x", "m", 1, {"bfloat16": _dc("bfloat16", 0.2, 50.0)}))  # merged in
    back = load_calibration("cpu-x")
    assert back is not None and set(back.dtypes) == {"float32", "bfloat16"} and back.preferred_dtype == "bfloat16"
    assert back.path == str(tmp_path / "calibration" / "cpu-x.json")


def test_an_unreadable_calibration_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path))
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "cpu-x.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="kvrag.calibration"):
        assert load_calibration("cpu-x") is None
    assert "kvrag calibrate" in caplog.text


def test_builtin_workload_is_packaged_rag_prompts() -> None:
    reqs = builtin_workload()
    assert [len(r.passages) for r in reqs] == [7, 9, 11]
    assert all(r.question.endswith("?") and len(set(r.passages)) == len(r.passages) for r in reqs)
    assert reqs[0].passages != reqs[1].passages[:7]  # rotated: each request has its own chunk set


def _summary() -> dict:
    def m(ratio: float, share: float, kl: float, **stats: float) -> dict:
        return {"ttft_ratio": ratio, "flop_share": share, "kl": kl, "method_stats_mean": stats}
    return {"hardware": {"machine_kind": "cpu-avx2"}, "dtype": "float32", "methods": {
        "full": m(1.0, 1.0, 0.0, recomputed_fraction=1.0),
        "stale": m(0.06, 0.02, 0.5, recomputed_fraction=0.0),
        "relaxkv:r=0.3": m(0.5, 0.4, 0.12, recomputed_fraction=0.35, attention_computed_ratio=0.3,
                           score_edges_ratio=0.03)}}


def test_calibrate_writes_a_loadable_cost_model_that_auto_prefers(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    base = tmp_path / "base.json"
    base.write_text(json.dumps(fit_cost_model(_summary(), source="test")))
    texts = ["The lighthouse was built in 1871 from granite and painted red and white.",
             "The river floods every spring when the snow melts on the hills above the town.",
             "Sourdough bread rises slowly because wild yeasts work more slowly than baker's yeast.",
             "The canal climbs through twenty-three locks between the river and the town."]
    ps = [render_passage(t * 3, f"T{i}") for i, t in enumerate(texts)]
    workload = [CalibrationRequest(tuple(ps[:3]), "When was it built?"), CalibrationRequest(tuple(ps[1:]), "How?")]
    lm = tiny_model("qwen2")
    cal, path = run_calibration(lm, costs=str(base), workload=workload, progress=False)
    kind = machine_kind(lm.device)
    assert path == tmp_path / "home" / "calibration" / f"{kind}.json" and cal.torch_threads == 1
    loaded = load_calibration(kind)
    assert loaded is not None and loaded.preferred_dtype == "float32" and loaded.model == lm.name
    d = loaded.dtypes["float32"]
    assert d.prefill_tokens_per_s > 0 and d.decode_ms_per_token > 0
    assert set(d.ttft_s) == {"full", "stale", "relaxkv:r=0.3"}
    assert all(d.e2e_s[m] == pytest.approx(d.ttft_s[m] + 32 * d.decode_ms_per_token / 1000) for m in d.ttft_s)
    assert d.cost_model is not None
    if row_attention.why_not(torch.float32, torch.bfloat16) is None:  # K/V precision measured in float32
        int8 = {"int8"} if row_attention.why_not(torch.float32, torch.int8) is None else set()
        assert set(d.kv_decode_ms_per_token) == {"float32", "bfloat16"} | int8
        assert min(d.kv_decode_ms_per_token.values()) > 0
        assert 0 < d.kv_kl["bfloat16"] < 1e-3
        assert set(d.kv_kl) == {"bfloat16"} | int8 and all(0 < v < 1e-2 for v in d.kv_kl.values())
        assert d.preferred_kv_dtype() in {"float32", "bfloat16"} | int8
    cm = CostModel.from_dict(d.cost_model)
    assert (cm.machine_kind, cm.dtype) == (kind, "float32")
    assert cm.candidates["relaxkv:r=0.3"].kl == 0.12 and cm.candidates["stale"].kl == 0.5  # KL from the base
    assert cm.candidates["relaxkv:r=0.3"].stats.attention_computed_ratio  # measured here
    assert cm.candidates["full"].ttft_ratio == 1.0 and cm.candidates["stale"].overhead > 0
    assert cm.speed_for(kind, "float32", 1, ModelCost.from_config(lm.model.config)) == cm.seconds_per_flop > 0
    assert cm.speed_for(kind, "float32", 2, ModelCost.from_config(lm.model.config)) is None  # other threads
    picked = Auto().cost_model(kind, "float32")
    assert picked.source.startswith("kvrag calibrate") and picked.path == str(path)


def test_cli_calibrate_arguments(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    from kvrag import calibrate, cli

    args = cli.build_parser().parse_args(["calibrate", "--dtypes", "float32,bfloat16"])
    assert args.func is cli.cmd_calibrate and args.threads == 1 and args.model is None
    seen = {}

    def fake_run(model, **kw):  # type: ignore[no-untyped-def]
        seen.update(model=model, **kw)
        cal = Calibration("cpu-x", "m", 1, {"float32": _dc("float32", 0.3, 100.0)})
        return cal, tmp_path / "cpu-x.json"

    monkeypatch.setattr(calibrate, "run_calibration", fake_run)
    assert cli.main(["calibrate", "--dtypes", "float32, bfloat16", "--threads", "0", "--quiet"]) == 0
    assert seen["dtypes"] == ["float32", "bfloat16"] and seen["threads"] is None and seen["progress"] is False
    out = capsys.readouterr().out
    assert "preferred dtype" in out and "float32" in out and "cpu-x.json" in out


def test_a_calibration_file_is_a_cost_model_for_its_dtype(tmp_path: Path) -> None:
    from kvrag.errors import ConfigError
    from kvrag.fusion.cost_model import load_cost_model

    cm = CostModel.from_dict(fit_cost_model(_summary(), source="fp32"))
    cal = Calibration("cpu-x", "m", 1, {"float32": DtypeCalibration("float32", 1.0, 1.0, cost_model=cm.to_dict())})
    path = save_calibration(cal, tmp_path / "cal.json").path
    assert load_cost_model(path).source == "fp32" and load_cost_model(path, "float32").source == "fp32"
    assert Auto(costs=str(path)).cost_model("cpu-x", "float32").source == "fp32"
    with pytest.raises(ConfigError, match="not for bfloat16"):
        load_cost_model(path, "bfloat16")


@pytest.mark.parametrize(("ms", "kl", "want"), [
    ({"float32": 40.0, "bfloat16": 30.0}, {"bfloat16": 2e-4}, "bfloat16"),  # faster and within the KL budget
    ({"float32": 40.0, "bfloat16": 30.0}, {"bfloat16": 5e-3}, "float32"),  # faster but over the KL budget
    ({"float32": 30.0, "bfloat16": 31.0}, {"bfloat16": 2e-4}, "float32"),  # not faster
    ({}, {}, None),  # not compared
])
def test_preferred_kv_dtype_is_the_fastest_within_the_kl_budget(ms: dict[str, float], kl: dict[str, float],
                                                                  want: str | None, tmp_path: Path) -> None:
    d = DtypeCalibration("float32", 100.0, 50.0, kv_decode_ms_per_token=ms, kv_kl=kl)
    assert d.preferred_kv_dtype() == want
    cal = save_calibration(Calibration("cpu-amx", "m", 1, {"float32": d}), tmp_path / "c.json")
    back = Calibration.from_dict(json.loads(Path(str(cal.path)).read_text()))
    assert back.dtypes["float32"].preferred_kv_dtype() == want
