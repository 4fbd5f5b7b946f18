"""``kvrag bench chat --frameworks serve`` (kvrag_bench.chat_serve): server subprocesses started with a bounded wait
and stopped; the conversation over HTTP with the ``openai`` SDK against two in-process servers (conversation cache
on / off) over a tiny model, with a llama.cpp peer that cannot be reached kept out of the rows and reported."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
pytest.importorskip("uvicorn", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from kvrag.config import EngineConfig, GenerationConfig  # noqa: E402
from kvrag.engine.engine import KVRAGEngine  # noqa: E402
from kvrag.serve import LiveServer, ServeConfig, create_app  # noqa: E402
from kvrag.store.memory import MemoryStore  # noqa: E402
from kvrag_bench import chat_serve  # noqa: E402
from kvrag_bench.chat_bench import _scenario_lines, compare_with_full, same_as_full_counts  # noqa: E402
from kvrag_testing.tiny import tiny_model  # noqa: E402


def _python_server(tmp_path: Path, code: str, timeout_s: float = 120) -> chat_serve.Server:
    script = tmp_path / "srv.py"
    script.write_text(code)
    return chat_serve.Server("test server", [sys.executable, str(script)], lambda p: [str(p)], "/",
                             start_timeout_s=timeout_s)


HTTP = """import http.server, sys
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def test_a_server_is_waited_for_and_stopped(tmp_path: Path) -> None:
    import httpx

    srv = _python_server(tmp_path, HTTP)
    with srv:
        assert srv.alive() and httpx.get(srv.url + "/", timeout=30).status_code == 200
    assert not srv.alive() and srv.proc is not None and srv.proc.returncode is not None


def test_a_server_that_exits_or_never_answers_fails_with_its_output(tmp_path: Path) -> None:
    srv = _python_server(tmp_path, "import sys\nprint('no model here', flush=True)\nsys.exit(3)\n")
    with pytest.raises(chat_serve.ServerFailed, match=r"(?s)exited with status 3.*no model here"), srv:
        pass
    srv = _python_server(tmp_path, "import time\nprint('loading', flush=True)\ntime.sleep(600)\n", timeout_s=0.5)
    with pytest.raises(chat_serve.ServerFailed, match=r"(?s)did not answer / within 0.5 s.*loading"), srv:
        pass
    assert not srv.alive()  # stopped, not left running


def test_llamacpp_missing_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m: None if m == "sse_starlette" else real(m))
    why = chat_serve.llamacpp_missing()
    assert why is not None and "sse_starlette" in why and "llama-cpp-python[server]" in why


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def test_the_conversation_over_http_reuses_history_and_reports_a_peer_that_failed() -> None:
    model = tiny_model("llama", init_std=0.02, seed=2)
    reuse = KVRAGEngine(model, MemoryStore(), EngineConfig(max_context=1024, method="stale"))
    recompute = KVRAGEngine(model, MemoryStore(), EngineConfig(max_context=1024, method="stale",
                                                               conversation_cache_bytes=0))
    chunks = ["\n\nThe tram runs every ten minutes.", "\n\nA day pass costs five euros."]
    questions = ["How often does the tram run?", "What does a pass cost?", "And a week?"]
    cfg = ServeConfig(model_id=chat_serve.MODEL_ID, max_queue=4)
    with LiveServer(create_app(reuse, cfg), drain_timeout_s=5) as a, \
            LiveServer(create_app(recompute, cfg), drain_timeout_s=5) as b:
        servers = {"reuse": _client(a.url), "recompute": _client(b.url),
                   "llama.cpp": _client(f"http://127.0.0.1:{chat_serve.free_port()}")}  # nothing listens there
        out = chat_serve.converse(servers, chunks, questions, max_tokens=4)
    rows = out["rows"]
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert rows[0]["reused_conversation"] == 0 and rows[0]["same_answer"]  # turn 1: the same computation
    for prev, r in zip(rows, rows[1:], strict=False):
        # the turn before's prompt comes from the conversation cache; the recomputing server prefills it
        assert 0 < r["reused_conversation"] <= prev["prompt_tokens"]
        assert r["reused_conversation"] <= r["cached_tokens"] < r["prompt_tokens"]
        assert r["recompute_prefilled"] == r["prompt_tokens"]
        assert r["prefilled"] == r["prompt_tokens"] - r["cached_tokens"]
    assert all(r["ttft_reuse_s"] is not None and r["ttft_recompute_s"] is not None for r in rows)
    assert all(r["llamacpp_ttft_s"] is None for r in rows)
    assert out["llamacpp_error"].startswith("turn 1: APIConnectionError")
    assert out["summary"]["llamacpp_turns"] == 0 and "ttft_ratio_last_first_llamacpp" not in out["summary"]
    compare_with_full(rows, recompute, lambda k: chunks, questions, GenerationConfig(max_new_tokens=4))
    assert all(isinstance(r["same_as_full_reuse"], bool) and isinstance(r["same_as_full_recompute"], bool) for r in rows)
    out["summary"].update(same_as_full_counts(rows))
    md = "\n".join(_scenario_lines("serve", out))
    assert "| same as full reuse / recompute |" in md
    assert "| llama.cpp prompt tokens | llama.cpp TTFT (s) | / turn 1 |" in md and "llama.cpp server -" in md
    assert all(line.count("|") == md.splitlines()[2].count("|") for line in md.splitlines() if line.startswith("|"))


def test_passages_that_change_every_turn_move_the_history_over_http() -> None:
    """The whole ``messages`` list each turn, the system message's passages changing: the reusing server moves the
    kept history behind the new passages (kvrag.engine.relocate); the recomputing one prefills everything."""
    from kvrag.engine.relocate import MIN_MOVED

    model = tiny_model("llama", init_std=0.02, seed=2)
    reuse = KVRAGEngine(model, MemoryStore(), EngineConfig(max_context=1024, method="stale"))
    recompute = KVRAGEngine(model, MemoryStore(), EngineConfig(max_context=1024, method="stale",
                                                               conversation_cache_bytes=0))
    turns = [["\n\nThe tram runs every ten minutes."], ["\n\nA day pass costs five euros."],
             ["\n\nThe ferry leaves at noon."]]
    questions = ["How often does the tram run?", "What does a pass cost?", "And a week?"]
    cfg = ServeConfig(model_id=chat_serve.MODEL_ID, max_queue=4)
    with LiveServer(create_app(reuse, cfg), drain_timeout_s=5) as a, \
            LiveServer(create_app(recompute, cfg), drain_timeout_s=5) as b:
        out = chat_serve.converse({"reuse": _client(a.url), "recompute": _client(b.url)}, lambda k: turns[k],
                                  questions, max_tokens=4)
    rows = out["rows"]
    assert rows[0]["reused_conversation"] == 0
    for r in rows[1:]:
        assert r["reused_conversation"] >= MIN_MOVED and r["cached_tokens"] >= r["reused_conversation"]
        assert r["recompute_prefilled"] == r["prompt_tokens"]
    assert reuse.conversations.stats()["moved_hits"] == 2
