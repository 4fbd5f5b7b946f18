"""Installed, kvrag-bench mounts ``kvrag bench`` into the core's console script through its entry point."""

from __future__ import annotations

from importlib.metadata import entry_points

from kvrag.cli import PLUGIN_GROUP, build_parser


def test_entry_point_is_installed_and_mounts_bench() -> None:
    """Run by `make test`, which installs kvrag-bench (editable); a checkout on PYTHONPATH alone has no entry point."""
    from kvrag_bench.cli import add_bench_arguments, run_bench, run_sweep

    eps = {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}
    assert "bench" in eps, "kvrag-bench is not installed: pip install -e benchmarks"
    assert eps["bench"].load() is add_bench_arguments
    p = build_parser()
    assert p.parse_args(["bench", "--data", "x.jsonl"]).func.__wrapped__ is run_bench
    assert p.parse_args(["bench", "sweep", "--lengths", "1024"]).func.__wrapped__ is run_sweep


def test_bench_without_data_is_a_clear_error(capsys) -> None:
    from kvrag_bench.cli import main

    assert main(["bench"]) == 2
    assert "needs --data" in capsys.readouterr().err


def test_a_bench_command_pins_its_commit_before_it_runs(monkeypatch) -> None:
    """Result files name the commit a run started on (written at its end, after any commit made meanwhile)."""
    from kvrag_bench import provenance

    monkeypatch.setattr(provenance, "_RUN_SHA", {})
    seen = []
    monkeypatch.setattr("kvrag_bench.decode_bench.main", lambda args: seen.append(dict(provenance._RUN_SHA)) or 0)
    args = build_parser().parse_args(["bench", "decode", "--contexts", "64"])
    assert args.func(args) == 0 and seen == [{"sha": provenance.git_sha()}]
