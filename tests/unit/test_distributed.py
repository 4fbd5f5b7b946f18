"""Distributed ingest on a real local Ray (2 workers, a tiny model saved to disk): exactness, resume, a worker
SIGKILLed mid-run, and the errors. Skips without Ray (pip install 'kvrag[ray]')."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError
from kvrag.prompting import render_passage
from kvrag.store import DiskStore
from kvrag.store.maintenance import verify_store
from kvrag_testing.tiny import tiny_model

N = 240
TEXTS = [render_passage(f"Record {i}: " + "the ferry leaves the harbour at dawn and returns at dusk. " * (1 + i % 6))
         for i in range(N)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama")
    lm = tiny_model("llama")
    lm.model.save_pretrained(d)
    lm.tokenizer.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def ray_local() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="Ray not installed (pip install 'kvrag[ray]')")
    from kvrag import distributed

    assert distributed.init_ray(None, workers=2)  # a local Ray with 2 CPUs, one torch thread per worker
    yield ray
    ray.shutdown()


def _entries(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file() and p.suffix == ".kv")


def test_worker_killed_mid_run_is_retried_and_everything_is_stored_once_and_exact(
    tmp_path: Path, model_dir: Path, ray_local: Any
) -> None:
    from kvrag import distributed

    root = tmp_path / "kv"
    url = f"file://{root}"
    eng = KVRAGEngine.from_pretrained(str(model_dir), url, on_store_error="raise")
    keys, todo, counts = distributed.plan_items(eng, TEXTS)
    assert len(todo) == N and counts == {"skipped_empty": 0, "duplicates": 0, "already_stored": 0}

    pool = distributed.RayIngest(eng, url, workers=2, max_retries=3)
    victim = pool.pids[0][0]
    out: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: out.update(pool.run(todo, batch_size=2, task_chunks=4)))
    runner.start()
    deadline = time.monotonic() + 60
    while _entries(root) < 20:  # bounded: fail (not hang) if the workers never write
        assert runner.is_alive() and time.monotonic() < deadline, "the workers stored nothing"
        time.sleep(0.002)
    at_kill = _entries(root)
    os.kill(victim, signal.SIGKILL)  # a worker dies mid-run
    runner.join(120)
    assert not runner.is_alive()
    pool.close()
    assert at_kill < N, "the run finished before the kill: the test did not test a mid-run death"
    assert len(pool.pids[0]) == 2 and pool.pids[0][0] == victim  # Ray restarted the worker and retried its tasks
    # a retried task skips what its killed attempt had stored already
    assert N - 8 <= out["computed"] <= N and out["tasks"] == N // 4

    store = DiskStore(root)  # opening removes a temp file the killed writer may have left
    assert sorted(store.iter_keys()) == sorted(keys)  # every chunk stored, each exactly once (content-addressed)
    v = verify_store(store)
    assert v.clean and v.ok == N
    for i in (0, 7, N - 1):  # the workers' batched K/V equals the driver's one-at-a-time prefill
        got = store.get(keys[i])
        ref = eng.compute(eng.tokenize(TEXTS[i]))
        assert got is not None and got.token_ids.tolist() == ref.token_ids.tolist()
        assert (got.keys - ref.keys).abs().max().item() <= 1e-4 and (got.values - ref.values).abs().max().item() <= 1e-4

    # resumable: a rerun (the library entry point) finds everything stored and starts no worker
    rep = distributed.ingest([*TEXTS, "   "], url, engine=eng, workers=2)
    assert rep.keys == keys and rep.computed == 0 and rep.already_stored == N and rep.skipped_empty == 1


def test_cli_ingest_on_ray_resumes_a_partial_store_and_every_chunk_is_served(
    tmp_path: Path, model_dir: Path, ray_local: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from kvrag import cli
    from kvrag.index import ChunkIndex

    docs = Path(__file__).parents[1] / "data" / "docs"
    persist, url = tmp_path / "idx", f"file://{tmp_path / 'kv'}"
    args = ["ingest", str(docs), "--persist", str(persist), "--store", url, "--model", str(model_dir),
            "--chunk-tokens", "64"]
    assert cli.main([*args, "--batch-size", "4"]) == 0  # serial, batched
    n = len(ChunkIndex.load(persist).chunks)
    first_key = next(iter(DiskStore(tmp_path / "kv").iter_keys()))
    assert DiskStore(tmp_path / "kv").delete(first_key)  # as if the first ingest had been interrupted
    capsys.readouterr()
    assert cli.main([*args, "--ray", "--workers", "1"]) == 0  # uses the running Ray (the fixture's)
    out = capsys.readouterr().out
    assert f"-> {n} chunks" in out and "1 computed" in out and f"{n - 1} already stored" in out, out
    assert verify_store(DiskStore(tmp_path / "kv")).ok == n
    assert cli.main(["ask", "When does the ferry leave?", "--persist", str(persist), "--top-k", "3",
                     "--max-new-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["hit_rate"] == 1.0


@pytest.mark.parametrize(("given", "address"), [(None, None), ("none", None), ("local", None), ("auto", "auto")])
def test_cli_ingest_ray_address(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                given: str | None, address: str | None) -> None:
    """`--ray none` (the word the help once used for a local Ray) starts a local Ray, as `--ray` alone does; it was
    passed to Ray as an address ("Invalid address format: none")."""
    from kvrag import cli, distributed

    class Stop(Exception):
        pass

    def ingest(*a: Any, **kw: Any) -> Any:
        raise Stop(kw["address"])

    monkeypatch.setattr(distributed, "ingest", ingest)
    docs = Path(__file__).parents[1] / "data" / "docs"
    with pytest.raises(Stop) as got:
        cli.main(["ingest", str(docs), "--persist", str(tmp_path / "idx"), "--store", f"file://{tmp_path / 'kv'}",
                  "--model", str(model_dir), "--chunk-tokens", "64", "--ray", *([given] if given else [])])
    assert got.value.args[0] == address


def test_cli_ingest_on_ray_gives_the_workers_the_drivers_quantization(
    tmp_path: Path, model_dir: Path, ray_local: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvrag ingest --ray --quantize none` (or another mode than the model's default) failed: the workers loaded
    the model with the default quantization, another model fingerprint, and refused to run."""
    from kvrag import cli
    from kvrag.models import default_quantize

    other = "none" if default_quantize(torch.device("cpu"), torch.float32, gguf=False) else "int8"
    docs = Path(__file__).parents[1] / "data" / "docs"
    assert cli.main(["ingest", str(docs), "--persist", str(tmp_path / "idx"), "--store", f"file://{tmp_path / 'kv'}",
                     "--model", str(model_dir), "--chunk-tokens", "64", "--quantize", other, "--ray",
                     "--workers", "1"]) == 0, capsys.readouterr().err
    assert verify_store(DiskStore(tmp_path / "kv")).ok > 0


def test_bad_arguments_name_the_fix(tmp_path: Path) -> None:
    from kvrag import distributed

    with pytest.raises(ConfigError, match="private to one process.*redis://"):
        distributed.shared_store_url("memory://")
    assert distributed.shared_store_url(str(tmp_path)) == f"file://{tmp_path.resolve()}"
    eng = KVRAGEngine(tiny_model("llama"), DiskStore(tmp_path))
    pytest.importorskip("ray")
    with pytest.raises(ConfigError, match="workers must be an int >= 1"):
        distributed.RayIngest(eng, f"file://{tmp_path}", workers=0)
