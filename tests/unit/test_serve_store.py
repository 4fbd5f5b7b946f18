"""kvrag serve when its KV store fails, and what it tells clients about itself (over real HTTP, a tiny engine).

A store that fails with ``--on-store-error raise`` is a 503 ``store_unavailable`` whose message names no host (the
server's log has the store's error and its traceback) and makes ``/health`` say ``store: degraded`` until a later
request succeeds; with ``recompute`` a registration carries the same ``Warning`` header as a completion. The
served model id of a model loaded from a file is the file's name, not its path; ``kvrag serve --ray`` refuses to
replace a kvrag app already deployed and reports the proxy's real address (Ray faked: no cluster is started).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import types
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
pytest.importorskip("uvicorn", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
httpx = pytest.importorskip("httpx")

from kvrag.config import EngineConfig  # noqa: E402
from kvrag.engine import generate  # noqa: E402
from kvrag.engine.engine import KVRAGEngine  # noqa: E402
from kvrag.errors import ConfigError, StoreError  # noqa: E402
from kvrag.kv.chunk import ChunkKV  # noqa: E402
from kvrag.serve import STORE_WARNING, LiveServer, ServeConfig, cli, create_app, ray_serve  # noqa: E402
from kvrag.serve.config import default_model_id  # noqa: E402
from kvrag.store.memory import MemoryStore  # noqa: E402
from kvrag_testing.tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny-qwen2"
PASSAGES = ["\n\nParis is the capital of France. The city has many museums.",
            "\n\nBerlin is the capital of Germany. It is a large city."]
HOST = "redis://10.20.30.40:6390/0"
"""The internal address the store's errors name: never in an answer."""


class FlakyStore(MemoryStore):
    """A memory store that fails as an unreachable Redis does while ``down``."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise StoreError(f"cannot reach Redis at {HOST}: Connection refused; is the server running?")

    def _get(self, key: str) -> ChunkKV | None:
        self._check()
        return super()._get(key)

    def _get_many_shared(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        self._check()
        return super()._get_many_shared(keys)

    def _put(self, key: str, chunk: ChunkKV) -> None:
        self._check()
        super()._put(key, chunk)

    def _contains(self, key: str) -> bool:
        self._check()
        return super()._contains(key)

    def _get_bytes(self, key: str) -> bytes | None:
        self._check()
        return super()._get_bytes(key)

    def _put_bytes(self, key: str, data: bytes) -> None:
        self._check()
        super()._put_bytes(key, data)


@pytest.fixture(scope="module")
def lm() -> Any:
    return tiny_model("qwen2", init_std=0.1)


@contextlib.contextmanager
def served(lm: Any, on_store_error: str) -> Iterator[tuple[FlakyStore, Any]]:
    store = FlakyStore()
    eng = KVRAGEngine(lm, store, EngineConfig(method="stale", max_context=512, on_store_error=on_store_error,
                                              store_retry_s=0.0))
    with LiveServer(create_app(eng, ServeConfig(model_id=MODEL)), drain_timeout_s=5) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        yield store, c
    eng.close()


def chat(**kw: Any) -> dict[str, Any]:
    content = "Answer from the documents." + "".join(PASSAGES) + "\n\nQuestion: Which city is the capital of France?"
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def store_state(c: Any) -> tuple[str, str]:
    return c.get("/health").json()["store"], c.get("/health/ready").json()["store"]


def assert_store_unavailable(err: dict[str, Any]) -> None:
    assert err["code"] == "store_unavailable" and err["type"] == "server_error", err
    assert "store is unavailable" in err["message"] and "server's log" in err["message"]
    assert "10.20.30.40" not in err["message"] and "Redis" not in err["message"], err


def test_store_down_with_raise_is_503_store_unavailable_and_logged(
        lm: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.ERROR, logger="kvrag.serve")
    with served(lm, "raise") as (store, c):
        assert c.post("/v1/kvrag/chunks", json={"texts": PASSAGES}).status_code == 200
        store.down = True
        for path, body in (("/v1/chat/completions", chat()), ("/v1/chat/completions", chat(stream=True)),
                           ("/v1/kvrag/chunks", {"texts": ["\n\nA passage the store never saw."]})):
            r = c.post(path, json=body)
            assert r.status_code == 503, r.text
            assert_store_unavailable(r.json()["error"])
        logged = [rec for rec in caplog.records if rec.exc_info and isinstance(rec.exc_info[1], StoreError)]
        assert len(logged) == 3 and HOST in str(logged[0].exc_info[1])  # type: ignore[index]
        store.down = False

        def refuse(self: Any, *a: Any, **kw: Any) -> None:  # a store error after the first byte of a stream
            raise StoreError(f"cannot reach Redis at {HOST}")

        monkeypatch.setattr(generate.DecodeState, "__init__", refuse)
        with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            assert r.status_code == 200
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        monkeypatch.undo()
        assert_store_unavailable(events[-1]["error"])
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200


def test_health_reports_the_store_degraded_while_requests_fail_on_it_with_raise(lm: Any) -> None:
    """A load balancer sees the outage: ``store: degraded`` from a request that failed on the store until one that
    arrived after it succeeds."""
    with served(lm, "raise") as (store, c):
        assert c.post("/v1/kvrag/chunks", json={"texts": PASSAGES}).status_code == 200
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200
        assert store_state(c) == ("ok", "ok")
        store.down = True
        assert c.post("/v1/chat/completions", json=chat()).status_code >= 500
        assert store_state(c) == ("degraded", "degraded")
        assert c.post("/v1/kvrag/chunks", json={"texts": PASSAGES}).status_code >= 500
        assert store_state(c) == ("degraded", "degraded")
        store.down = False
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200 and "Warning" not in r.headers  # nothing was recomputed
        assert store_state(c) == ("ok", "ok")


def test_a_failure_outside_a_requests_outcome_is_answered_without_its_text(
        lm: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The app's last-resort handler (the chat template's rendering fails before the request is admitted)."""
    from kvrag.serve import routes

    def broken(*a: Any, **kw: Any) -> str:
        raise RuntimeError("template at /srv/secret/chat.jinja is broken")

    def unreachable(*a: Any, **kw: Any) -> str:
        raise StoreError(f"cannot reach Redis at {HOST}")

    caplog.set_level(logging.ERROR, logger="kvrag.serve")
    with served(lm, "raise") as (_, c):
        monkeypatch.setattr(routes.adapters, "render_chat", broken)
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        assert "/srv" not in r.text and "RuntimeError" not in r.text
        assert any(rec.exc_info and "chat.jinja" in str(rec.exc_info[1]) for rec in caplog.records)
        monkeypatch.setattr(routes.adapters, "render_chat", unreachable)
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503, r.text
        assert_store_unavailable(r.json()["error"])
        assert store_state(c) == ("degraded", "degraded")
        monkeypatch.undo()
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200  # on the same connection
        assert store_state(c) == ("ok", "ok")


def test_registration_while_the_store_is_down_carries_the_warning_header(lm: Any) -> None:
    with served(lm, "recompute") as (store, c):
        ok = c.post("/v1/kvrag/chunks", json={"texts": PASSAGES[:1]})
        assert ok.status_code == 200 and "Warning" not in ok.headers
        store.down = True
        down = c.post("/v1/kvrag/chunks", json={"texts": PASSAGES[1:]})
        assert down.status_code == 200 and down.headers["Warning"] == STORE_WARNING, down.headers
        assert [d["cached"] for d in down.json()["data"]] == [False]
        assert c.get("/health").json()["store"] == "degraded"
        store.down = False
        again = c.post("/v1/kvrag/chunks", json={"texts": PASSAGES[1:]})
        assert again.status_code == 200 and "Warning" not in again.headers


# ----------------------------------------------------------------------------------------------- what is shown
@pytest.mark.parametrize(("name", "served_as"), [
    ("/srv/models/gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-q4_k_m.gguf"),
    ("models/gemma-3-270m-Q4_K_M.GGUF", "gemma-3-270m-Q4_K_M.GGUF"),
    ("~/models/qwen2.5-0.5b", "qwen2.5-0.5b"),
    ("./checkpoints/my-model/", "my-model"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("smollm2-135m-instruct", "smollm2-135m-instruct"),
])
def test_default_model_id_is_a_files_name_not_its_path(name: str, served_as: str) -> None:
    assert default_model_id(name) == served_as


def test_models_lists_the_gguf_files_name(lm: Any, tmp_path: Any) -> None:
    path = tmp_path / "gemma-3-270m-q4_k_m.gguf"
    eng = KVRAGEngine(dataclasses.replace(lm, name=str(path)), MemoryStore(), EngineConfig(method="stale"))
    with LiveServer(create_app(eng), drain_timeout_s=5) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["gemma-3-270m-q4_k_m.gguf"]
        assert str(tmp_path) not in c.get("/health").text
    with LiveServer(create_app(eng, ServeConfig(model_id="mine")), drain_timeout_s=5) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["mine"]
    eng.close()


def test_api_key_help_names_both_open_endpoints() -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    assert "/health and /health/ready" in " ".join(str(helps["api_key"]).split())


# ----------------------------------------------------------------------------------------------- Ray, faked
class FakeServe:
    """The few calls of Ray Serve that :func:`ray_serve.run` makes, recorded."""

    def __init__(self, apps: dict[str, Any], proxy: tuple[str, int]) -> None:
        self.apps, self.calls, self.options = apps, [], {}
        config = types.SimpleNamespace(http_config=types.SimpleNamespace(host=proxy[0], port=proxy[1]))
        self.context = types.SimpleNamespace(_get_global_client=lambda: config)

    def status(self) -> Any:
        return types.SimpleNamespace(applications=self.apps)

    def start(self, **kw: Any) -> None:
        self.calls.append(("start", kw))

    def run(self, app: Any, **kw: Any) -> None:
        self.calls.append(("run", kw))

    def ingress(self, build: Any) -> Any:
        return lambda: build

    def deployment(self, cls: Any, **opts: Any) -> Any:
        self.options = opts
        return types.SimpleNamespace(bind=lambda: "app")


def fake_ray(monkeypatch: pytest.MonkeyPatch, serve: FakeServe) -> None:
    actor = types.SimpleNamespace(options=lambda **kw: types.SimpleNamespace(remote=lambda: "table"))
    ray = types.SimpleNamespace(is_initialized=lambda: True, remote=lambda **kw: lambda cls: actor)
    monkeypatch.setattr(ray_serve, "require", lambda name, *a: serve if name == "ray.serve" else ray)


def test_ray_run_refuses_to_replace_a_running_kvrag_app(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = FakeServe({"kvrag": types.SimpleNamespace(status="RUNNING")}, ("127.0.0.1", 8000))
    fake_ray(monkeypatch, serve)
    with pytest.raises(ConfigError, match=r"already runs an application named 'kvrag'.*serve shutdown"):
        ray_serve.run(lambda: None, ServeConfig(), port=8001)  # type: ignore[arg-type,return-value]
    assert serve.calls == []  # nothing started, nothing replaced


def test_ray_run_reports_the_proxys_own_address(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = FakeServe({"other": types.SimpleNamespace(status="RUNNING")}, ("127.0.0.2", 8000))
    fake_ray(monkeypatch, serve)
    url = ray_serve.run(lambda: None, ServeConfig(), port=8001)  # type: ignore[arg-type,return-value]
    assert url == "http://127.0.0.2:8000"  # the proxy Serve already ran, not the port asked for
    assert [c for c, _ in serve.calls] == ["start", "run"]


def test_ray_replicas_get_the_drain_timeout_to_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    serve = FakeServe({}, ("127.0.0.1", 8000))
    fake_ray(monkeypatch, serve)
    ray_serve.application(lambda: None, ServeConfig(drain_timeout_s=45))  # type: ignore[arg-type,return-value]
    assert serve.options["graceful_shutdown_timeout_s"] == 45 + ray_serve.SHUTDOWN_MARGIN_S
