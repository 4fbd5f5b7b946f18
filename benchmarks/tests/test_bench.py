"""The benchmark suite on a tiny model: full,full is exact, smoke run writes every output, resume, sweep, store."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError
from kvrag.store.memory import MemoryStore
from kvrag_bench import aggregate, plots, provenance
from kvrag_bench.config import BenchConfig, method_labels, resolve_methods, split_method_specs
from kvrag_bench.data import load_requests
from kvrag_bench.runner import QABenchmark, region_masks
from kvrag_testing.tiny import tiny_model

DATA = Path(__file__).resolve().parents[1] / "data" / "qa_tiny.jsonl"
REQUIRED = {"n", "f1", "em", "kl", "ttft_p50_s", "ttft_p90_s", "ttft_ratio", "f1_gap_recovery", "kl_gap_recovery"}


@pytest.fixture(scope="module")
def engine() -> KVRAGEngine:
    torch.manual_seed(0)
    return KVRAGEngine(tiny_model("llama"), MemoryStore(), EngineConfig())


def _cfg(tmp_path: Path, methods: str, limit: int = 3, **kw) -> BenchConfig:
    return BenchConfig(data=str(DATA), out=str(tmp_path / "out"), methods=methods, limit=limit, max_new_tokens=4,
                       kl_tokens=4, bootstrap=50, progress=False, **kw)


# ------------------------------------------------------------------ pure helpers


def test_split_method_specs_and_labels() -> None:
    assert split_method_specs("full,stale,relaxkv:r=0.15,k=2,cacheblend:r=0.15,epic:k=16") == [
        "full", "stale", "relaxkv:r=0.15,k=2", "cacheblend:r=0.15", "epic:k=16"]
    assert method_labels(["full", "stale", "full", "full"]) == ["full", "stale", "full#2", "full#3"]
    assert aggregate.reference_labels(["stale#2", "relaxkv:r=0.1", "full#2", "stale"]) == {"full": "full#2", "stale": "stale#2"}


def test_unregistered_method_is_skipped_bad_params_raise() -> None:
    methods, skipped = resolve_methods(["full", "no-such-method:r=1", "stale"])
    assert list(methods) == ["full", "stale"] and skipped == ["no-such-method:r=1"]
    with pytest.raises(ConfigError):
        resolve_methods(["full:bogus=1"])
    with pytest.raises(ConfigError):
        resolve_methods(["no-such-method"])


def test_load_requests_validates(tmp_path: Path) -> None:
    reqs = load_requests(DATA, limit=2, offset=1)
    assert [r.id for r in reqs] == ["tiny-2", "tiny-3"]
    assert reqs[0].passages()[0].startswith("\n\nTitle: Report\nThe committee")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "question": "q", "answers": "not a list", "contexts": [{"title": "", "text": "t"}]}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        load_requests(bad)


def test_region_masks() -> None:
    from kvrag.engine.planner import Plan, PlannedSegment

    segs = (PlannedSegment("prefix", "p", (1, 2), 0), PlannedSegment("chunk", "a", tuple(range(5)), 2),
            PlannedSegment("chunk", "b", tuple(range(12)), 7))
    plan = Plan(segs, PlannedSegment("suffix", "s", (9,), 19), 2, 2)
    m = region_masks(plan, boundary_tokens=8)
    assert m["first"].nonzero().flatten().tolist() == [2, 3, 4, 5, 6]
    assert m["boundary"].nonzero().flatten().tolist() == list(range(7, 15))
    assert m["interior"].nonzero().flatten().tolist() == list(range(15, 19))
    assert int(m["all"].sum()) == 17 and not bool(m["all"][:2].any())


def _row(rid: str, vals: dict[str, tuple[float, float, float]]) -> dict:
    return {"id": rid, "context_tokens": 100, "n_chunks": 2,
            "methods": {k: {"f1": f1, "em": float(f1 == 1.0), "kl": kl, "ttft_s": t} for k, (f1, kl, t) in vals.items()}}


def test_summarize_hand_computed() -> None:
    rows = [
        _row("a", {"full": (1.0, 0.0, 2.0), "stale": (0.0, 0.4, 0.5), "m": (1.0, 0.1, 1.0)}),
        _row("b", {"full": (0.5, 0.0, 4.0), "stale": (0.5, 0.2, 1.0), "m": (0.5, 0.1, 1.0)}),
    ]
    s = aggregate.summarize(rows, ["full", "stale", "m"], n_boot=200, env={"git_sha": "x"})
    full, stale, m = (s["methods"][k] for k in ("full", "stale", "m"))
    assert REQUIRED <= set(m)
    assert full["f1"] == pytest.approx(0.75) and stale["f1"] == pytest.approx(0.25) and m["f1"] == pytest.approx(0.75)
    assert m["kl"] == pytest.approx(0.1) and stale["kl"] == pytest.approx(0.3)
    assert m["f1_gap_recovery"] == pytest.approx(1.0)  # (0.75 - 0.25) / (0.75 - 0.25)
    assert m["kl_gap_recovery"] == pytest.approx((0.1 - 0.3) / (0.0 - 0.3))
    assert full["ttft_p50_s"] == pytest.approx(3.0) and stale["ttft_p50_s"] == pytest.approx(0.75)
    assert stale["ttft_ratio"] == pytest.approx(0.25) and full["ttft_ratio"] == pytest.approx(1.0)
    assert full["ttft_p90_s"] == pytest.approx(3.8)  # numpy linear interpolation between 2 and 4
    assert m["vs_stale"]["f1"]["mean"] == pytest.approx(0.5)
    assert s["quality_ceiling_f1"] == pytest.approx(0.75)
    assert "| `m` |" in aggregate.summary_markdown(s)


def test_overhead_p90_is_over_each_requests_own_flop_share() -> None:
    rows = [_row(r, {"full": (1.0, 0.0, 4.0), "m": (1.0, 0.1, t)}) for r, t in (("a", 1.0), ("b", 1.0), ("c", 2.0))]
    for row, share in zip(rows, (0.25, 0.125, 0.25), strict=True):
        row["methods"]["full"]["flop_share"], row["methods"]["m"]["flop_share"] = 1.0, share
    m = aggregate.summarize(rows, ["full", "m"], n_boot=10, env={})["methods"]["m"]
    # per request TTFT ratio / own share: 1.0, 2.0, 2.0 -> p90 2.0; overhead = p50 ratio 0.25 / mean share 0.208
    assert m["overhead_p90"] == pytest.approx(2.0)
    assert m["overhead"] == pytest.approx(0.25 / (0.625 / 3))


def test_results_name_the_commit_the_run_started_at(monkeypatch: pytest.MonkeyPatch) -> None:
    heads = iter(["aaa", "bbb", "bbb"])
    monkeypatch.setattr(provenance, "git_sha", lambda cwd=None: next(heads))
    monkeypatch.setattr(provenance, "_RUN_SHA", {})
    assert provenance.run_git_sha() == "aaa"  # pinned when the run starts
    info = aggregate.environment_info()  # a commit landed while it ran
    assert info["git_sha"] == "aaa" and info["git_sha_head"] == "bbb"


def test_extract_short() -> None:
    from kvrag_bench.extract import extract_short

    assert extract_short("No, the battle was fought in 1862.") == "no"
    assert extract_short("Answer: Spain.") == "Spain"
    assert extract_short("Charlie St. Cloud plays Billy. It is a film.") == "Charlie St. Cloud plays Billy"
    assert extract_short("Born in 1998. Then\nmore") == "Born in 1998"


def test_pareto_front() -> None:
    pts = [(1.0, 0.5), (2.0, 0.6), (1.5, 0.4), (3.0, 0.6), (0.5, 0.1)]
    assert plots.pareto_front(pts, higher_is_better=True) == [4, 0, 1]
    assert plots.pareto_front([(1.0, 0.3), (2.0, 0.1), (3.0, 0.2)], higher_is_better=False) == [0, 1]


# ------------------------------------------------------------------ runner on a tiny model


def test_full_full_identical_answers_zero_kl(engine: KVRAGEngine, tmp_path: Path) -> None:
    s = QABenchmark(_cfg(tmp_path, "full,full", limit=2, warmup=0, plots=False), engine).run()
    rows = aggregate.read_jsonl(tmp_path / "out" / "results.jsonl")
    assert len(rows) == 2
    for r in rows:
        a, b = r["methods"]["full"], r["methods"]["full#2"]
        assert a["token_ids"] == b["token_ids"] and a["raw"] == b["raw"]
        assert b["kl"] == 0.0 and a["kl"] == 0.0 and b["first_token_agree"]
        assert all(v == 0.0 for v in b["kv_rel_rmse"].values())
    assert s["methods"]["full#2"]["kl"] == 0.0


def test_smoke_run_outputs_and_resume(engine: KVRAGEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    methods = "full,stale,not-yet-a-method"
    bench = QABenchmark(_cfg(tmp_path, methods, limit=2), engine)
    assert bench.skipped == ["not-yet-a-method"]
    bench.run()
    out = tmp_path / "out"
    # resume: a larger limit runs only the new request
    calls: list[str] = []
    orig = QABenchmark.run_request

    def spy(self, req, index, gen=None):
        if gen is None:  # not the warm-up
            calls.append(req.id)
        return orig(self, req, index, gen)

    monkeypatch.setattr(QABenchmark, "run_request", spy)
    s = QABenchmark(_cfg(tmp_path, methods, limit=3), engine).run()
    assert calls == ["tiny-3"]
    rows = aggregate.read_jsonl(out / "results.jsonl")
    assert [r["id"] for r in rows] == ["tiny-1", "tiny-2", "tiny-3"]
    for name in ("results.jsonl", "summary.json", "summary.md", "pareto_f1_ttft.png", "pareto_kl_ttft.png"):
        assert (out / name).stat().st_size > 0, name
    js = json.loads((out / "summary.json").read_text())
    assert {"config", "git_sha", "versions", "hardware", "methods"} <= set(js)
    assert set(js["methods"]) == {"full", "stale"} and js["skipped_methods"] == ["not-yet-a-method"]
    for m in js["methods"].values():
        assert REQUIRED <= set(m) and m["n"] == 3
        assert 0.0 <= m["f1"] <= 1.0 and 0.0 <= m["em"] <= 1.0
    assert js["methods"]["full"]["ttft_ratio"] == pytest.approx(1.0)
    assert js["methods"]["stale"]["kl"] > 0.0  # stale differs from full on multi-chunk prompts
    r0 = rows[0]["methods"]["stale"]
    assert r0["kv_rel_rmse"]["k_boundary"] > 0 and r0["timings"]["ttft_s"] > 0 and r0["stats"]["chunk_misses"] == 0
    assert {"python", "torch", "transformers", "kvrag"} <= set(js["versions"]) and js["hardware"]["cores"]
    assert s["n_requests"] == 3
    # nothing left to do: a rerun runs no request
    calls.clear()
    QABenchmark(_cfg(tmp_path, methods, limit=3), engine).run()
    assert calls == []
    # a different configuration refuses to resume
    with pytest.raises(ConfigError, match="different configuration"):
        QABenchmark(BenchConfig(data=str(DATA), out=str(out), methods="full", limit=3, max_new_tokens=5,
                                progress=False), engine).run()


def test_method_failing_at_runtime_is_dropped_and_resume_still_works(engine: KVRAGEngine, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from kvrag.fusion.stale import Stale

    class Broken(Stale):
        name = "broken-test-method"

        def fuse(self, inp):
            raise ConfigError("no checkpoint for this model")

    from kvrag.fusion import base

    monkeypatch.setitem(base._REGISTRY, "broken-test-method", Broken)
    b = QABenchmark(_cfg(tmp_path, "full,broken-test-method", limit=1, warmup=0, plots=False), engine)
    b.run()
    assert b.labels == ["full"] and "no checkpoint" in b.skip_reasons["broken-test-method"]
    calls: list[str] = []
    monkeypatch.setattr(QABenchmark, "run_request", lambda self, req, i, gen=None: calls.append(req.id))
    QABenchmark(_cfg(tmp_path, "full,broken-test-method", limit=1, warmup=0, plots=False), engine).run()
    assert calls == []  # the finished request is not rerun for the dropped method


def test_peer_llamaindex_hf(engine: KVRAGEngine, tmp_path: Path) -> None:
    pytest.importorskip("llama_index.llms.huggingface")
    s = QABenchmark(_cfg(tmp_path, "full", limit=1, warmup=0, peer="llamaindex-hf", plots=False), engine).run()
    p = s["peers"]["llamaindex-hf"]
    assert p["n"] == 1 and p["ttft_p50_s"] > 0 and 0.0 <= p["f1"] <= 1.0


# ------------------------------------------------------------------ sweep, store, templates, CLI


def test_sweep_tiny(engine: KVRAGEngine, tmp_path: Path) -> None:
    from kvrag_bench.sweep import SweepConfig, run_sweep

    cfg = SweepConfig(methods=["full", "stale"], lengths=[64, 128], chunks=2, chunk_counts=[1, 4], content_tokens=128,
                      repeats=1, out=str(tmp_path / "sweep"), progress=False)
    res = run_sweep(cfg, engine)
    assert len(res["points"]) == 8
    assert all(p["ttft_s"] > 0 and p["cache_misses"] == 0 for p in res["points"])
    assert {p["n_chunks"] for p in res["points"] if p["sweep"] == "chunks"} == {1, 4}
    for name in ("sweep.json", "sweep.md", "sweep_length.png", "sweep_chunks.png"):
        assert (tmp_path / "sweep" / name).exists(), name
    assert len(run_sweep(cfg, engine)["points"]) == 8  # resumed: nothing re-measured, same points


def test_store_bench_tiny(engine: KVRAGEngine, tmp_path: Path) -> None:
    from kvrag_bench.store_bench import StoreBenchConfig, run_store_bench

    cfg = StoreBenchConfig(backends=["memory", "file"], codecs=["native", "float16", "int8"], chunks=3,
                           chunk_tokens=16, repeats=1, out=str(tmp_path / "store"), spec=engine.spec, progress=False)
    res = run_store_bench(cfg)
    assert len(res["backends"]) == 6 and all(r["write_mb_s"] > 0 and r["read_mb_s"] > 0 for r in res["backends"])
    c = res["codecs"]
    assert c["native"]["rel_error"] == 0.0 and 0 < c["int8"]["rel_error"] < 0.02
    assert c["float16"]["bytes_per_token"] < c["native"]["bytes_per_token"]  # fp32 model: fp16 halves the payload
    assert (tmp_path / "store" / "store.md").exists()


def test_template_selection_tiny(engine: KVRAGEngine, tmp_path: Path) -> None:
    from kvrag.prompting import TEMPLATES
    from kvrag_bench.templates import select_template

    res = select_template(engine, load_requests(DATA, limit=2), tmp_path / "tpl", ["basic", "oneshot-chat"],
                          max_new_tokens=3, n_boot=20, progress=False)
    assert set(res["candidates"]) == {f"{t}/{e}" for t in ("basic", "oneshot-chat") for e in ("line", "raw", "short")}
    assert res["best"] in res["candidates"] and "basic" in TEMPLATES


def test_cli_mounts_bench_commands() -> None:
    from kvrag_bench.cli import add_bench_arguments, run_bench, run_store, run_sweep, run_templates

    p = argparse.ArgumentParser(prog="kvrag")
    add_bench_arguments(p.add_subparsers(dest="command"))
    a = p.parse_args(["bench", "--data", "x.jsonl", "--limit", "3", "--methods", "full,relaxkv:r=0.15", "--bootstrap", "10"])
    assert a.func.__wrapped__ is run_bench and a.limit == 3 and a.methods == "full,relaxkv:r=0.15"
    a = p.parse_args(["bench", "sweep", "--lengths", "1024,2048", "--methods", "full"])
    assert a.func.__wrapped__ is run_sweep and a.lengths == [1024, 2048]
    assert p.parse_args(["bench", "store", "--codecs", "int8"]).func.__wrapped__ is run_store
    assert p.parse_args(["bench", "templates", "--data", "x"]).func.__wrapped__ is run_templates


def test_combined_pareto_plot(tmp_path: Path) -> None:
    from kvrag_bench.cli import main as bench_main

    def summ(methods: dict[str, tuple[float, float]]) -> dict:
        return {"methods": {k: {"ttft_ratio": r, "kl": kl, "f1": 0.5} for k, (r, kl) in methods.items()}}

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text(json.dumps(summ({"full": (1.0, 0.0), "stale": (0.1, 0.6)})))
    (tmp_path / "b.json").write_text(json.dumps(summ({"cacherepair": (0.2, 0.2)})))
    out = tmp_path / "p.png"
    assert bench_main(["bench", "plot", str(tmp_path / "a"), f"cr={tmp_path / 'b.json'}", "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    assert bench_main(["bench", "plot", f"x={tmp_path / 'missing'}", "--out", str(out)]) == 2


def test_merge_of_split_runs_equals_the_run_over_all_rows(engine: KVRAGEngine, tmp_path: Path) -> None:
    """Two runs over disjoint row ranges merge into the summary one run over all rows reports (quality metrics are
    deterministic; TTFT differs run to run, so only its presence is checked); mismatched runs are refused."""
    from kvrag_bench.cli import main as bench_main
    from kvrag_bench.merge import merge_runs

    methods = "full,stale"
    whole = QABenchmark(_cfg(tmp_path, methods, limit=3), engine).run()
    a = QABenchmark(dataclasses.replace(_cfg(tmp_path, methods, limit=1), out=str(tmp_path / "a")), engine).run()
    QABenchmark(dataclasses.replace(_cfg(tmp_path, methods, limit=2, offset=1), out=str(tmp_path / "b")), engine).run()
    assert a["n_requests"] == 1
    assert bench_main(["bench", "merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m"),
                       "--bootstrap", "50"]) == 0
    merged = json.loads((tmp_path / "m" / "summary.json").read_text())
    assert merged["n_requests"] == 3 and "merged_from" in merged and (tmp_path / "m" / "summary.md").is_file()
    run_a = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert merged["hardware"] == run_a["hardware"] and merged["git_sha"] == run_a["git_sha"]  # the runs' provenance
    assert len(merged["merged_hardware"]) == 2
    for lbl in ("full", "stale"):
        for key in ("f1", "em", "kl"):
            assert merged["methods"][lbl][key] == pytest.approx(whole["methods"][lbl][key]), (lbl, key)
        assert merged["methods"][lbl]["ttft_ratio"] is not None
    with pytest.raises(ConfigError, match="more than one run"):
        merge_runs(tmp_path / "x", [tmp_path / "a", tmp_path / "out"], make_plots=False)
    QABenchmark(dataclasses.replace(_cfg(tmp_path, "full", limit=1, offset=2), out=str(tmp_path / "c")), engine).run()
    with pytest.raises(ConfigError, match="ran methods"):
        merge_runs(tmp_path / "x", [tmp_path / "a", tmp_path / "c"], make_plots=False)
    with pytest.raises(ConfigError, match="not a kvrag bench"):
        merge_runs(tmp_path / "x", [tmp_path / "a", tmp_path / "nope"], make_plots=False)
    d = _cfg(tmp_path, methods, limit=1, offset=2)
    QABenchmark(dataclasses.replace(d, out=str(tmp_path / "d"), max_new_tokens=5), engine).run()
    with pytest.raises(ConfigError, match=r"ran with other settings .*\(max_new_tokens: 4 vs 5\)"):  # says what
        merge_runs(tmp_path / "x", [tmp_path / "a", tmp_path / "d"], make_plots=False)


def test_memory_bench_markdown_reports_kvrags_memory_by_stage() -> None:
    from kvrag_bench.memory_bench import _summarize, markdown

    run = {"peak_rss_mb": 700.0, "disk_mb": 1.5, "ttft_s": 4.5, "decode_ms": 12.0, "stale_ttft_s": 0.7, "load_s": 3.0,
           "imports_rss_mb": 250.0, "loaded_rss_mb": 530.0, "load_peak_rss_mb": 630.0, "prompt_ids": [1, 2, 3]}
    other = {**run, "peak_rss_mb": 710.0, "loaded_rss_mb": 540.0}
    summary = _summarize([run, other])
    assert summary["peak_rss_mb"] == 705.0 and summary["loaded_rss_mb"] == 535.0 and summary["prompt_tokens"] == 3
    peer = _summarize([{"peak_rss_mb": 250.0, "disk_mb": 0.0, "ttft_s": 13.0, "decode_ms": 18.0, "load_s": 0.5}])
    result = {"threads": 1, "rounds": 2, "files": [{"file": "/x/m.gguf", "file_mb": 94.0, "prompt_tokens": 3,
                                                     "summary": {"kvrag": summary, "llama.cpp": peer},
                                                     "runs": {"kvrag": [run, other], "llama.cpp": [{}]}}]}
    md = markdown(result)
    assert "| | kvrag / llama.cpp | 2.82x |" in md
    assert ("m.gguf, kvrag's resident memory: 250 MB before the model (Python, torch, transformers, kvrag), 535 MB "
            "loaded (630 MB at the load's peak), 705 MB at the peak with the answer.") in md


# ------------------------------------------------------------------ an evaluator's own QA file
def _qa_row(rid: str = "x", **kw) -> dict:
    return {"id": rid, "question": "Where?", "answers": ["Paris"], "contexts": [{"title": "P", "text": "In Paris."}],
            **kw}


@pytest.mark.parametrize(("line", "says"), [
    ('["not", "an", "object"]', "a row must be one JSON object"),
    (json.dumps({"question": "q", "answers": ["a"], "contexts": [{"text": "t"}]}), "missing key(s) ['id']"),
    (json.dumps(_qa_row(id=None)), "'id' must be a non-empty string"),
    (json.dumps(_qa_row(question="  ")), "'question' is empty"),
    (json.dumps(_qa_row(answers=["", "The"])), "empty after SQuAD normalization"),  # F1 of an empty answer was 1.0
    (json.dumps(_qa_row(contexts=["a plain string"])), "contexts[0] must be an object"),
    (json.dumps(_qa_row(question=None)), "'question' must be a string, got None"),  # ran as the question "None"
    (json.dumps(_qa_row(contexts=[{"title": "P", "text": "In Paris."}, {"title": "E", "text": " "}])),
     "contexts[1] has an empty 'text'"),
])
def test_a_bad_row_is_refused_naming_the_line_and_why(tmp_path: Path, line: str, says: str) -> None:
    p = tmp_path / "mine.jsonl"
    p.write_text(json.dumps(_qa_row("ok")) + "\n" + line + "\n")
    with pytest.raises(ConfigError, match=f"mine.jsonl:2: bad QA row .*{re.escape(says)}"):
        load_requests(p)


def test_encodings_of_an_evaluators_file(tmp_path: Path) -> None:
    p = tmp_path / "bom.jsonl"
    p.write_bytes("\ufeff".encode() + json.dumps(_qa_row()).encode() + b"\r\n")  # a Windows editor's UTF-8 with CRLF
    assert [r.id for r in load_requests(p)] == ["x"]
    p.write_bytes(json.dumps(_qa_row(question="Où ?"), ensure_ascii=False).encode("latin-1"))
    with pytest.raises(ConfigError, match=r"bom.jsonl:1: not UTF-8 text .*save the QA file as UTF-8"):
        load_requests(p)


def test_an_empty_selection_and_an_out_path_that_is_a_file_fail_at_once(engine: KVRAGEngine, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no QA requests selected .*offset=10"):
        QABenchmark(_cfg(tmp_path, "full,stale", offset=10), engine).run()
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        BenchConfig(data=str(DATA), out=str(tmp_path / "taken" / "run"), methods="full")


def test_a_resumed_run_reruns_a_row_the_evaluator_changed(engine: KVRAGEngine, tmp_path: Path) -> None:
    data = tmp_path / "mine.jsonl"
    data.write_text(json.dumps(_qa_row("r", answers=["Paris"])) + "\n")
    cfg = BenchConfig(data=str(data), out=str(tmp_path / "out"), methods="full", max_new_tokens=2, kl_tokens=2,
                      bootstrap=0, progress=False, warmup=0, plots=False)
    QABenchmark(cfg, engine).run()
    data.write_text(json.dumps(_qa_row("r", answers=["London"])) + "\n")  # the gold answer fixed
    QABenchmark(cfg, engine).run()
    rows = aggregate.read_jsonl(tmp_path / "out" / "results.jsonl")
    assert rows[-1]["answers"] == ["London"]


def test_merge_of_runs_that_skipped_a_method_merges_the_methods_that_ran(engine: KVRAGEngine, tmp_path: Path) -> None:
    """A method a run skipped (a typo, or dropped by its first request's probe) held no row of it, so the merge
    found no row with every method: 0 requests, exit 0."""
    from kvrag_bench.merge import merge_runs

    methods = "full,stale,stael"
    QABenchmark(dataclasses.replace(_cfg(tmp_path, methods, limit=1), out=str(tmp_path / "a")), engine).run()
    QABenchmark(dataclasses.replace(_cfg(tmp_path, methods, limit=1, offset=1), out=str(tmp_path / "b")), engine).run()
    merged = merge_runs(tmp_path / "m", [tmp_path / "a", tmp_path / "b"], make_plots=False, n_boot=0)
    assert merged["n_requests"] == 2 and set(merged["methods"]) == {"full", "stale"}
