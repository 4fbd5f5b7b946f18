"""kvrag serve over real HTTP: a uvicorn server on 127.0.0.1 (ephemeral port) in front of a tiny engine.

Answers are compared with the in-process engine on the same prompt, chunks and method (greedy); faults are real:
a client that closes its connection, a server holding its limit of requests, a shutdown with a request in flight,
a Redis server that is killed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
pytest.importorskip("uvicorn", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
httpx = pytest.importorskip("httpx")

from kvrag.adapters import render_chat  # noqa: E402
from kvrag.config import EngineConfig  # noqa: E402
from kvrag.engine.engine import KVRAGEngine  # noqa: E402
from kvrag.serve import STORE_WARNING, LiveServer, ServeConfig, create_app  # noqa: E402
from kvrag.store.memory import MemoryStore  # noqa: E402
from kvrag_testing.tiny import tiny_model  # noqa: E402
from kvrag_testing.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny-qwen2"
PASSAGES = [
    "\n\nParis is the capital of France. The city has many museums.",
    "\n\nBerlin is the capital of Germany. It is a large city.",
]
QUESTION = "Which city is the capital of France?"
N = 6


def user_text(passages: list[str] = PASSAGES) -> str:
    return "Answer from the documents." + "".join(passages) + "\n\nQuestion: " + QUESTION


@pytest.fixture(scope="module")
def lm() -> Any:
    return tiny_model("qwen2", init_std=0.1)


@pytest.fixture(scope="module")
def engine(lm: Any) -> KVRAGEngine:
    return KVRAGEngine(lm, MemoryStore(), EngineConfig(method="stale", max_context=512))


@pytest.fixture(scope="module")
def server(engine: KVRAGEngine) -> Iterator[LiveServer]:
    with LiveServer(create_app(engine, ServeConfig(model_id=MODEL, max_queue=8)), drain_timeout_s=5) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[Any]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/v1/kvrag/chunks", json={"texts": PASSAGES})
        assert r.status_code == 200, r.text
        yield c


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": user_text()}], "max_tokens": N, **kw}


def local(engine: KVRAGEngine, method: str = "stale", prompt: str | None = None, n: int = N) -> Any:
    prompt = prompt if prompt is not None else render_chat(engine.tokenizer, [{"role": "user", "content": user_text()}])
    return engine.answer(prompt, PASSAGES, method, max_new_tokens=n)


def idle(engine: KVRAGEngine) -> bool:
    st = engine.batcher.stats()
    return st["decoding"] == 0 and st["joining"] == 0 and st["kv"]["leases"] == 0


def test_register_chat_completion_stream_equal_in_process(engine: KVRAGEngine, client: Any) -> None:
    again = client.post("/v1/kvrag/chunks", json={"texts": [*PASSAGES, "  "]}).json()["data"]
    assert [d["cached"] for d in again] == [True, True, False] and again[2]["key"] is None
    assert [d["key"] for d in again[:2]] == [c.key for c, _ in engine.ensure(PASSAGES)]
    for method in ("stale", "full"):
        ref = local(engine, method)
        r = client.post("/v1/chat/completions", json=chat_body(kvrag={"method": method}))
        assert r.status_code == 200 and "Warning" not in r.headers, r.text
        out = r.json()
        assert out["object"] == "chat.completion" and out["model"] == MODEL
        assert out["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
        assert out["kvrag"]["method"] == method and out["kvrag"]["hit_rate"] == (1.0 if method == "stale" else 0.0)
        u = out["usage"]
        assert (u["prompt_tokens"], u["completion_tokens"]) == (ref.stats.context_tokens + ref.stats.suffix_tokens,
                                                                len(ref.token_ids))
        cached = u["prompt_tokens_details"]["cached_tokens"]  # the chunks' and the stored preamble's tokens
        assert cached == out["kvrag"]["reused_tokens"]
        assert cached >= ref.stats.chunk_tokens > 0 if method == "stale" else cached == 0
    # streamed: the same text, then the finish chunk, the usage chunk and [DONE]
    events = []
    with client.stream("POST", "/v1/chat/completions",
                       json=chat_body(stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == local(engine).text
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # as OpenAI's chunks before the usage one


def test_completions_use_the_prompt_as_given(engine: KVRAGEngine, client: Any) -> None:
    prompt = "Documents:" + "".join(PASSAGES) + "\nQ: " + QUESTION + "\nA:"
    ref = local(engine, prompt=prompt, n=5)
    out = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5}).json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"] == ref.text
    assert out["kvrag"]["hit_rate"] == 1.0 and out["usage"]["completion_tokens"] == len(ref.token_ids)
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": [prompt], "max_tokens": 5,
                                                        "stream": True}) as r:
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                 if line.startswith("data: {")]
    assert "".join(texts) == ref.text


def test_sampling_seed_and_stop(client: Any) -> None:
    sampled = [client.post("/v1/chat/completions", json=chat_body(temperature=1.5, top_p=0.9, seed=seed)).json()
               for seed in (1, 1, 2)]
    texts = [r["choices"][0]["message"]["content"] for r in sampled]
    assert texts[0] == texts[1]  # the same seed samples the same answer
    greedy = client.post("/v1/chat/completions", json=chat_body(max_tokens=12)).json()["choices"][0]
    cut = greedy["message"]["content"][3:6]
    stopped = client.post("/v1/chat/completions", json=chat_body(max_tokens=12, stop=[cut])).json()["choices"][0]
    assert stopped["message"]["content"] == greedy["message"]["content"].split(cut)[0]
    assert stopped["finish_reason"] == "stop"


def test_openai_sdk_sync_async_stream(engine: KVRAGEngine, server: LiveServer, client: Any) -> None:
    """The openai SDK against the server (``client`` registers the passages, so the answers reuse them)."""
    openai = pytest.importorskip("openai")
    import asyncio

    ref = local(engine).text
    msgs = [{"role": "user", "content": user_text()}]
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in sdk.models.list()] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL  # what some frameworks call to check the model exists
    with pytest.raises(openai.NotFoundError, match="model_not_found"):
        sdk.models.retrieve("gpt-4o")
    r = sdk.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == ref and r.usage.prompt_tokens_details.cached_tokens > 0
    stream = sdk.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=N, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref

    async def both() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as a:
            rs = await asyncio.gather(*(a.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N)
                                        for _ in range(3)))
        return [x.choices[0].message.content for x in rs]

    assert asyncio.run(both()) == [ref] * 3
    with pytest.raises(openai.BadRequestError, match="tools"):
        sdk.chat.completions.create(model=MODEL, messages=msgs, tools=[{"type": "function", "function": {"name": "f"}}])


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"n": 2}, 400, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"kvrag": {"method": "nonsense"}}, 400, "kvrag.method"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0.role"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "word " * 600}], "stream": True}, 400, "messages"),
])
def test_bad_requests_name_the_field(client: Any, body: dict[str, Any], status: int, param: str) -> None:
    r = client.post("/v1/chat/completions", json=chat_body(**body))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param
    if "word " in str(body):
        assert err["code"] == "context_length_exceeded" and "context window is 512" in err["message"]
    else:
        assert param.split(".")[0] in err["message"]


def test_disconnect_cancels_and_others_are_unchanged(engine: KVRAGEngine, server: LiveServer, client: Any) -> None:
    """8 streaming clients, 4 of which go away mid-stream: no reservation is left and the other 4 answer unchanged."""
    ref = local(engine, n=24).text
    before = metric(client, "kvrag_cancelled_requests_total")
    pool = concurrent.futures.ThreadPoolExecutor(4)
    lock = engine.batcher.lock

    def streamed() -> str:
        with httpx.Client(base_url=server.url, timeout=60) as c, \
                c.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=24, stream=True)) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])

    with contextlib.ExitStack() as streams:
        for _ in range(4):  # four clients read a few events of a long answer...
            c = streams.enter_context(httpx.Client(base_url=server.url, timeout=60))
            lines = streams.enter_context(c.stream("POST", "/v1/chat/completions",
                                                   json=chat_body(max_tokens=400, stream=True))).iter_lines()
            for _ in range(4):
                next(lines)
        lock.acquire()  # (decoding paused, so that their answers cannot end first)
        rows_before = engine.batcher.stats().get("rows_stepped", 0)  # what they decoded so far is not counted
    try:  # ...and went away mid-stream (the server has noticed); four others stream meanwhile
        futs = [pool.submit(streamed) for _ in range(4)]
        wait_until(lambda: metric(client, "kvrag_cancelled_requests_total") == before + 4)
    finally:
        lock.release()
    assert [f.result(timeout=60) for f in futs] == [ref] * 4
    wait_until(lambda: idle(engine) and server_held(client) == 0)  # no reservation left behind
    assert metric(client, "kvrag_cancelled_requests_total") == before + 4
    # the abandoned answers stopped decoding: far fewer rows stepped after they left than their 4 x 400 tokens
    assert engine.batcher.stats()["rows_stepped"] - rows_before < 4 * 24 + 4 * 50
    pool.shutdown()


def metric(client: Any, name: str) -> float:
    text = client.get("/metrics").text
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).rsplit(" ", 1)[1])


def server_held(client: Any) -> int:
    return int(client.get("/health").json()["in_flight"])


def test_full_queue_answers_429_at_once(engine: KVRAGEngine, lm: Any) -> None:
    """64 requests at a queue of 16: 48 get 429 at once (the model busy meanwhile), the 16 held ones answer."""
    app = create_app(engine, ServeConfig(model_id=MODEL, max_queue=16))
    ref = local(engine).text
    lock = engine.batcher.lock
    with LiveServer(app, drain_timeout_s=5) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        c.post("/v1/kvrag/chunks", json={"texts": PASSAGES})
        pool = concurrent.futures.ThreadPoolExecutor(64)
        lock.acquire()  # the model is busy: admitted requests wait for their prepare
        try:
            futs = [pool.submit(lambda: httpx.post(srv.url + "/v1/chat/completions", json=chat_body(), timeout=60))
                    for _ in range(64)]
            wait_until(lambda: sum(f.done() for f in futs) == 48)  # answered while nothing could be computed
            rejected = [f.result() for f in futs if f.done()]
            assert server_held(c) == 16
        finally:
            lock.release()
        assert all(r.status_code == 429 and int(r.headers["Retry-After"]) >= 1 for r in rejected)
        assert rejected[0].json()["error"]["type"] == "rate_limit_error"
        answered = [f.result(timeout=60) for f in futs if f.result(timeout=60).status_code == 200]
        assert [r.json()["choices"][0]["message"]["content"] for r in answered] == [ref] * 16
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
        assert 'kvrag_requests_total{endpoint="chat",status="429"} 48.0' in c.get("/metrics").text
        pool.shutdown()


def test_shutdown_drains_requests_in_flight(engine: KVRAGEngine) -> None:
    ref = local(engine, n=24).text
    srv = LiveServer(create_app(engine, ServeConfig(model_id=MODEL)), drain_timeout_s=30).start()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    lock = engine.batcher.lock
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.post("/v1/kvrag/chunks", json={"texts": PASSAGES})
        lock.acquire()
        try:
            fut = pool.submit(lambda: httpx.post(srv.url + "/v1/chat/completions", json=chat_body(max_tokens=24),
                                                 timeout=60))
            wait_until(lambda: server_held(c) == 1)
            stopper = threading.Thread(target=srv.stop)
            stopper.start()
            wait_until(lambda: srv.server.should_exit)
        finally:
            lock.release()
    r = fut.result(timeout=60)
    stopper.join(60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref
    assert not srv.thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)
    pool.shutdown()


def test_metrics_report_latency_hits_and_method(client: Any) -> None:
    client.post("/v1/chat/completions", json=chat_body())
    text = client.get("/metrics").text

    def value(line_start: str) -> float:
        return float(next(ln for ln in text.splitlines() if ln.startswith(line_start)).rsplit(" ", 1)[1])

    assert value("kvrag_ttft_seconds_count") >= 1 and value("kvrag_queue_wait_seconds_count") >= 1
    assert value("kvrag_inter_token_latency_seconds_count") >= 1
    assert value("kvrag_chunk_hits_total") > 0 and value('kvrag_chunk_hit_rate_bucket{le="1.0"}') >= 1
    assert value('kvrag_method_requests_total{chosen="stale",method="stale"}') >= 1
    assert value("kvrag_decode_steps_total") >= 1 and value("kvrag_kv_bytes_limit") > 0
    health = client.get("/health").json()
    assert health["status"] == "ok"
    # answered chats keep their prompt's K/V (counted in the bound, not leased): reported beside the leases
    assert value("kvrag_kv_bytes_cached") == health["kv_bytes_cached"] > 0


def test_store_down_recomputes_with_a_warning_header(lm: Any, redis_server: Any) -> None:
    from kvrag.store.redis import RedisStore

    redis_server.start()
    store = RedisStore(redis_server.url, prefix=f"kvrag-serve-{uuid.uuid4().hex}:")
    eng = KVRAGEngine(lm, store, EngineConfig(method="stale", store_retry_s=0.0))
    with LiveServer(create_app(eng, ServeConfig(model_id=MODEL)), drain_timeout_s=5) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        assert c.post("/v1/kvrag/chunks", json={"texts": PASSAGES}).status_code == 200
        ok = c.post("/v1/chat/completions", json=chat_body())
        assert "Warning" not in ok.headers and ok.json()["kvrag"]["chunk_hits"] == 2
        redis_server.kill()
        down = c.post("/v1/chat/completions", json=chat_body())
        assert down.status_code == 200 and down.headers["Warning"] == STORE_WARNING
        assert down.json()["choices"] == ok.json()["choices"] and down.json()["kvrag"]["chunk_misses"] == 2
        assert c.get("/health").json()["store"] == "degraded"
        reg = c.post("/v1/kvrag/chunks", json={"texts": PASSAGES})  # computed, not stored: flagged the same way
        assert reg.status_code == 200 and reg.headers["Warning"] == STORE_WARNING
    store.close()


def test_serve_loads_the_quantization_its_index_was_built_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`kvrag serve --persist IDX` loaded the default quantization whatever the index was built with (another model
    fingerprint: every cache computed again, silently) and had no --quantize."""
    import types

    import torch

    import kvrag.serve
    from kvrag import cli

    seen: dict[str, Any] = {}

    def load(*a: Any, **kw: Any) -> Any:
        seen.update(kw)
        return types.SimpleNamespace(loaded=types.SimpleNamespace(
            name="m", fingerprint=f"fp-{kw['quantize']}", dtype=torch.bfloat16, quantize=kw["quantize"]))

    monkeypatch.setattr(KVRAGEngine, "from_pretrained", load)
    app = types.SimpleNamespace(state=types.SimpleNamespace(kvrag=types.SimpleNamespace(model_id="m", registered=0)))
    monkeypatch.setattr(kvrag.serve, "create_app", lambda *a, **kw: app)
    monkeypatch.setattr(kvrag.serve, "serve", lambda *a, **kw: None)
    (tmp_path / "index.json").write_text(json.dumps({"quantize": "int8", "model_fingerprint": "fp-int8",
                                                    "dtype": "bfloat16"}))
    assert cli.main(["serve", "--persist", str(tmp_path), "--no-warm-up"]) == 0
    assert seen["quantize"] == "int8" and "note:" not in capsys.readouterr().err
    assert cli.main(["serve", "--persist", str(tmp_path), "--no-warm-up", "--quantize", "none"]) == 0
    assert seen["quantize"] == "none" and "weights int8" in capsys.readouterr().err


def test_serve_options_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvrag serve``'s engine options go into the engine it loads (the server itself is not started here)."""
    import argparse
    import types

    import kvrag.serve
    from kvrag.engine import warmup
    from kvrag.serve import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(KVRAGEngine, "from_pretrained", lambda *a, **kw: seen.update(kw) or "engine")
    warmed: list[object] = []
    monkeypatch.setattr(warmup, "warm_up", warmed.append)
    app = types.SimpleNamespace(state=types.SimpleNamespace(kvrag=types.SimpleNamespace(model_id="m", registered=0)))
    monkeypatch.setattr(kvrag.serve, "create_app", lambda *a, **kw: app)
    monkeypatch.setattr(kvrag.serve, "serve", lambda *a, **kw: None)
    for argv, on in (([], False), (["--no-pack-suffixes", "--speculative-tokens", "0", "--speculative-max-batch", "5",
                                    "--conversation-cache-bytes", "0", "--no-warm-up", "--no-move-history",
                                    "--kv-dtype", "int8"], True)):
        args = parser.parse_args(argv)
        args.verbose = False
        warmed.clear()
        assert serve_cli.run(args, None, "memory://", "template") == 0
        assert warmed == ([] if on else ["engine"])  # the engine answers once before the server listens
        assert seen["pack_suffixes"] is not on and seen["speculative_tokens"] == (0 if on else 3)
        assert seen["speculative_max_batch"] == (5 if on else 8)
        assert seen["conversation_cache_bytes"] == (0 if on else None)
        assert seen["move_history"] is not on
        assert seen["kv_dtype"] == ("int8" if on else "auto")
    import torch

    saved = torch.get_num_threads()
    try:
        for argv, threads in (([], saved), (["--threads", "3"], 3)):
            torch.set_num_threads(saved)
            args = parser.parse_args(argv)
            args.verbose = False
            assert serve_cli.run(args, None, "memory://", "template") == 0
            # the runner gets the threads; the thread that loads the model (and serves HTTP) runs torch on one
            assert seen["runner_threads"] == threads and torch.get_num_threads() == 1
        args = parser.parse_args(["--threads", "0"])
        args.verbose = False
        assert serve_cli.run(args, None, "memory://", "template") == 2
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize(("given", "served"), [
    (None, "memory://?max_bytes=2147483648"),
    ("memory://", "memory://?max_bytes=2147483648"),  # an explicit memory store was unbounded: clients filled it
    ("memory://?codec=int8", "memory://?codec=int8&max_bytes=2147483648"),
    ("memory://?max_bytes=1000", "memory://?max_bytes=1000"),
    ("file:///tmp/kv", "file:///tmp/kv"),
    ("memory://?zzz=1", "memory://?zzz=1"),  # malformed: its error quotes the URL as given, not with the bound
])
def test_serve_bounds_a_memory_store_given_without_a_bound(monkeypatch: pytest.MonkeyPatch, given: str | None,
                                                           served: str) -> None:
    from kvrag import cli
    from kvrag.serve import cli as serve_cli

    seen: dict[str, str] = {}

    def run(args: Any, model: Any, store: str, *a: Any, **kw: Any) -> int:
        seen["store"] = store
        return 0

    monkeypatch.setattr(serve_cli, "run", run)
    assert cli.main(["serve", "--no-warm-up", *(["--store", given] if given else [])]) == 0
    assert seen["store"] == served
