"""``kvrag`` mounts subcommands of other distributions through the ``kvrag.cli_plugins`` entry points (kvrag-bench
adds ``bench``); without the distribution, ``kvrag bench`` says what to install."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvrag import cli


class FakeEntryPoint:
    """The part of ``importlib.metadata.EntryPoint`` that kvrag.cli uses."""

    def __init__(self, name: str, target: Any, value: str = "fake_dist.cli:add") -> None:
        self.name, self.value, self._target = name, value, target

    def load(self) -> Any:
        if isinstance(self._target, Exception):
            raise self._target
        return self._target


def test_without_kvrag_bench_bench_names_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "_plugin_entry_points", lambda: [])
    for argv in (["bench"], ["bench", "--data", "qa.jsonl", "--limit", "3"], ["bench", "sweep", "--lengths", "1024"],
                 ["bench", "--help"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "kvrag-bench" in err and "pip install -e benchmarks" in err and "make bench" in err, err
    # the placeholder does not swallow unknown options of the core's own commands
    with pytest.raises(SystemExit):
        cli.main(["pull", "--no-such-option"])


def test_an_installed_plugin_is_mounted(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[argparse.Namespace] = []

    def add(sub: Any) -> None:
        p = sub.add_parser("bench")
        p.add_argument("--data")
        p.set_defaults(func=lambda args: calls.append(args) or 0)

    monkeypatch.setattr(cli, "_plugin_entry_points", lambda: [FakeEntryPoint("bench", add)])
    assert cli.main(["bench", "--data", "qa.jsonl"]) == 0
    assert [c.data for c in calls] == ["qa.jsonl"]
    with pytest.raises(SystemExit):  # a mounted plugin parses its own options strictly
        cli.main(["bench", "--no-such-option"])


def test_a_plugin_that_fails_to_load_says_why(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    broken = FakeEntryPoint("bench", ImportError("No module named 'matplotlib'"), "kvrag_bench.cli:add_bench_arguments")
    monkeypatch.setattr(cli, "_plugin_entry_points", lambda: [broken])
    assert cli.main(["bench", "--data", "qa.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "could not be loaded" in err and "matplotlib" in err and "pip install -e benchmarks" in err


def test_the_bench_entry_point_is_declared_by_kvrag_bench() -> None:
    """benchmarks/pyproject.toml declares the entry point that the core looks up (group and name)."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML in the standard library")
    meta = tomllib.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "kvrag-bench"
    assert meta["project"]["entry-points"][cli.PLUGIN_GROUP] == {"bench": "kvrag_bench.cli:add_bench_arguments"}
