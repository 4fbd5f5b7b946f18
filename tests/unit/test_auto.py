"""``auto``: per-request method choice under a TTFT budget from a cost model fitted on benchmark summaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvrag.errors import ConfigError
from kvrag.fusion import get_method
from kvrag.fusion.auto import fit_cost_model
from kvrag_testing.fusion_suite import context_kv, fusion_case


def _summary() -> dict:
    """A bench summary as kvrag_bench.aggregate writes it (the fields fit_cost_model reads)."""
    def m(ratio, share, kl, **stats):
        return {"ttft_ratio": ratio, "flop_share": share, "kl": kl, "method_stats_mean": stats}
    return {"methods": {
        "full": m(1.0, 1.0, 0.0, recomputed_fraction=1.0),
        "stale": m(0.06, 0.02, 0.5, recomputed_fraction=0.0),
        "relaxkv:r=0.15": m(0.5, 0.4, 0.12, recomputed_fraction=0.35, attention_computed_ratio=0.3,
                            score_edges_ratio=0.03),
        "epic:k=16": m(0.3, 0.2, 0.3, recomputed_fraction=0.1, attention_computed_ratio=0.1),
        "no-kl": {"ttft_ratio": 0.1, "flop_share": 0.1, "kl": None},
        "auto:budget=0.3": m(0.33, 0.3, 0.06, recomputed_fraction=0.2),  # auto's own row: not a candidate
    }}


def test_fit_keeps_measured_methods_and_overheads() -> None:
    model = fit_cost_model(_summary(), source="test", machine_kind="cpu-avx2", dtype="float32")
    assert set(model["methods"]) == {"full", "stale", "relaxkv:r=0.15", "epic:k=16"}
    assert model["methods"]["stale"]["overhead"] == pytest.approx(3.0)
    with pytest.raises(ConfigError, match="full among"):
        fit_cost_model({"methods": {}}, machine_kind="cpu-avx2", dtype="float32")


def test_fit_records_the_machine_kind_and_dtype() -> None:
    model = fit_cost_model(_summary(), machine_kind="cpu-amx", dtype="torch.bfloat16")
    assert (model["machine_kind"], model["dtype"]) == ("cpu-amx", "bfloat16")
    recorded = {**_summary(), "hardware": {"machine_kind": "cuda-nvidia-h200"}, "config": {"dtype": "bfloat16"}}
    model = fit_cost_model(recorded)  # what the summary records
    assert (model["machine_kind"], model["dtype"]) == ("cuda-nvidia-h200", "bfloat16")
    with pytest.raises(ConfigError, match="machine kind and dtype"):
        fit_cost_model(_summary())  # a summary that does not say where it was measured


def test_choice_is_the_best_kl_within_the_budget(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(fit_cost_model(_summary(), machine_kind="cpu-avx2", dtype="float32")))
    case = fusion_case("llama", 4)
    cfg = case.model.config
    tc, s = case.fusion_input().context_len, int(case.suffix_ids.shape[0])
    preds = {sp: r for sp, r, _ in get_method(f"auto:costs={path}").predict(cfg, tc, s)}
    ranked = sorted(preds.values())
    mid = min(1.0, (ranked[1] + ranked[2]) / 2)  # a budget the two fastest candidates fit
    pick = {b: get_method(f"auto:budget={b},costs={path}").choose(cfg, tc, s)[0] for b in (1.0, mid, 1e-4)}
    assert pick[1.0] == "full"  # everything fits: the exact one
    within = [sp for sp, r in preds.items() if r <= mid]
    kl = {"full": 0.0, "stale": 0.5, "relaxkv:r=0.15": 0.12, "epic:k=16": 0.3}
    assert len(within) == 2 and pick[mid] == min(within, key=kl.__getitem__)
    assert pick[1e-4] == min(preds, key=preds.__getitem__)  # nothing fits: the fastest


def test_p90_margin_keeps_a_noisy_candidate_out_of_a_tight_budget(tmp_path: Path) -> None:
    summary = _summary()
    noisy = summary["methods"]["epic:k=16"]
    noisy["overhead_p90"] = 2.0 * noisy["ttft_ratio"] / noisy["flop_share"]  # its slow requests take twice the median
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(fit_cost_model(summary, machine_kind="cpu-avx2", dtype="float32")))
    case = fusion_case("llama", 4)
    cfg = case.model.config
    tc, s = case.fusion_input().context_len, int(case.suffix_ids.shape[0])
    p50 = dict((sp, r) for sp, r, _ in get_method(f"auto:margin=p50,costs={path}").predict(cfg, tc, s))
    p90 = dict((sp, r) for sp, r, _ in get_method(f"auto:costs={path}").predict(cfg, tc, s))
    assert p90["epic:k=16"] == pytest.approx(2.0 * p50["epic:k=16"])
    assert p90["stale"] == pytest.approx(p50["stale"])  # no p90 recorded: the median overhead
    budget = 1.5 * p50["epic:k=16"]  # epic fits by its median, not by its p90
    assert budget < p50["relaxkv:r=0.15"]
    assert get_method(f"auto:budget={budget},margin=p50,costs={path}").choose(cfg, tc, s)[0] == "epic:k=16"
    assert get_method(f"auto:budget={budget},costs={path}").choose(cfg, tc, s)[0] == "stale"
    with pytest.raises(ConfigError, match="margin"):
        get_method("auto:margin=p99")


def test_auto_runs_the_chosen_method_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(fit_cost_model(_summary(), machine_kind="cpu-avx2", dtype="float32")))
    case = fusion_case("qwen2", 4)
    auto = get_method(f"auto:budget=0.3,costs={path}")
    out = auto.fuse(case.fusion_input())
    chosen = out.stats.auto_choice
    ref = get_method(chosen).fuse(case.fusion_input())
    for a, b in zip(context_kv(out, case.fusion_input().context_len), context_kv(ref, case.fusion_input().context_len),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert out.stats.auto_budget == 0.3 and out.stats.auto_predicted_ttft_ratio > 0
    assert out.stats.auto_margin == "p90"


def test_missing_cost_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fit-auto"):
        get_method(f"auto:costs={tmp_path / 'nope.json'}").cost_model()
    with pytest.raises(ConfigError, match="budget"):
        get_method("auto:budget=0")


def test_a_model_without_a_repairer_chooses_among_the_training_free_candidates(tmp_path: Path) -> None:
    """A cost model that favours CacheRepair (and hybrid) within the budget: a model with no repairer (any model
    but the default) answers with the best training-free candidate instead of failing with CacheRepair's error."""
    summary = _summary()
    summary["methods"]["cacherepair"] = {"ttft_ratio": 0.1, "flop_share": 0.05, "kl": 0.01,
                                         "method_stats_mean": {"recomputed_fraction": 0.0}}
    summary["methods"]["hybrid:r=0.015"] = {"ttft_ratio": 0.2, "flop_share": 0.1, "kl": 0.005,
                                            "method_stats_mean": {"recomputed_fraction": 0.05}}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(fit_cost_model(summary, machine_kind="cpu-avx2", dtype="float32")))
    case = fusion_case("qwen2", 4)
    auto = get_method(f"auto:budget=0.3,costs={path}")
    cfg, tc = case.model.config, case.fusion_input().context_len
    assert auto.choose(cfg, tc, 4)[0] in ("cacherepair", "hybrid:r=0.015")  # what it would pick with a repairer
    out = auto.fuse(case.fusion_input())
    assert out.stats.auto_choice == "epic:k=16"  # the best training-free one within the budget
    # a repairer given to auto is the one its chosen cacherepair / hybrid runs (here one that does not exist)
    from kvrag.errors import KVRAGError

    given = get_method(f"auto:budget=0.3,costs={path},checkpoint={tmp_path / 'my-repairer'}")
    with pytest.raises(KVRAGError, match="my-repairer"):
        given.fuse(case.fusion_input())


def test_the_agreement_ladder_without_a_cap_reads_no_cost_model(caplog: pytest.LogCaptureFixture) -> None:
    """The default method (``auto:agree=0.9``, no budget) chooses by the first token's confidence, not by predicted
    TTFT: it neither loads a cost model nor warns, in every process, that the shipped one was fitted elsewhere."""
    import logging

    from kvrag.fusion import auto as auto_module

    case = fusion_case("qwen2", 4)
    method = get_method("auto:agree=0.9")
    calls = []
    orig = type(method).cost_model
    type(method).cost_model = lambda self, *a, **k: calls.append(a) or orig(self, *a, **k)  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.WARNING, logger=auto_module.log.name):
            out = method.fuse(case.fusion_input())
            from kvrag.config import EngineConfig
            from kvrag.engine.engine import KVRAGEngine
            from kvrag.prompting import RagTemplate
            from kvrag.store import MemoryStore
            from kvrag_testing.tiny import tiny_model

            eng = KVRAGEngine(tiny_model("qwen2"), MemoryStore(), EngineConfig())  # the default method, observed
            docs = ["The ferry leaves at nine.\n\n", "A day pass costs nine marks.\n\n"]
            eng.ingest(docs)
            r = eng.answer(RagTemplate().render(eng.tokenizer, docs, "When?"), docs, max_new_tokens=2)
    finally:
        type(method).cost_model = orig  # type: ignore[method-assign]
    assert out.stats.auto_choice is not None and r.stats.method_stats is not None and calls == []
    assert not [r for r in caplog.records if "cost model" in r.getMessage()]
