"""Hypothesis-generated requests against a live kvrag serve (uvicorn on 127.0.0.1, a tiny engine with a small context
window, an API key): bodies near the protocol (each field of the OpenAI bodies, with plausible and arbitrary values,
lone surrogates, huge seeds and token counts, unknown fields), raw bytes, odd content types and keys, unknown paths
and methods.

Whatever is sent: no 5xx (nor a ``server_error`` event inside a 200 stream), every error is OpenAI's error object,
and once the requests end no KV lease and no queue place is left, ``/health`` is ok and a normal chat answers. The
examples are derandomized (the same ones every run) and bounded in number, so the suite's time is bounded too.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
pytest.importorskip("uvicorn", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvrag.config import EngineConfig  # noqa: E402
from kvrag.engine.engine import KVRAGEngine  # noqa: E402
from kvrag.serve import LiveServer, ServeConfig, create_app  # noqa: E402
from kvrag.store.memory import MemoryStore  # noqa: E402
from kvrag_testing.tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny-qwen2"
KEY = "fuzz-key"
EXAMPLES = 150

plain = st.text(max_size=24)
hostile_text = st.sampled_from(["\ud800", "a\udfffb", "\x00", "", " " * 3, "\u202e", "x" * 300])
texts = st.one_of(plain, st.text(st.characters(exclude_categories=()), max_size=8), hostile_text)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), texts)
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                        max_leaves=6)
numbers = st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.sampled_from([2**63, -(2**63) - 1, 2**64]))
METHODS = ["stale", "full", "relaxkv:r=0.5", "auto"]
HOSTILE_METHODS = ["auto:costs=/etc/passwd", "cacherepair:checkpoint=/tmp", "auto:costs=~/x", "nonsense", ":",
                   "relaxkv:r=2", "stale:x=1", "auto:costs=../../etc"]

# a field's well-formed values, and the hostile ones (past a bound, the wrong type, text UTF-8 cannot encode, files)
FIELDS: dict[str, tuple[Any, Any]] = {
    "max_tokens": (st.integers(1, 4), st.one_of(st.integers(-2, 0), st.just(10**9), numbers, anything)),
    "temperature": (st.floats(0, 2), st.one_of(st.floats(), st.floats(2.0001, 1e9), st.floats(-1e9, -1e-9), anything)),
    "top_p": (st.floats(1e-6, 1), st.one_of(st.just(0.0), st.floats(1.0001, 10), st.floats(), anything)),
    "seed": (st.integers(-(2**63), 2**63 - 1), st.one_of(numbers, anything)),
    "stop": (st.one_of(plain, st.lists(plain, max_size=4)), st.one_of(st.lists(texts, min_size=5, max_size=7),
                                                                      hostile_text, anything)),
    "stream": (st.booleans(), anything),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), anything),
    "n": (st.just(1), st.one_of(st.integers(), anything)),
    "frequency_penalty": (st.just(0), st.one_of(st.floats(), anything)),
    "presence_penalty": (st.just(0.0), st.one_of(st.floats(), anything)),
    "user": (plain, st.one_of(hostile_text, anything)),
    "kvrag": (st.fixed_dictionaries({}, optional={"method": st.sampled_from(METHODS)}),
              st.one_of(st.fixed_dictionaries({"method": st.sampled_from(HOSTILE_METHODS)}),
                        st.fixed_dictionaries({"method": st.sampled_from(METHODS), "params": st.dictionaries(
                            st.sampled_from(["costs", "checkpoint", "r", "budget", "x"]), anything, min_size=1,
                            max_size=2)}),
                        st.fixed_dictionaries({"chunks": st.lists(texts, max_size=2)}), anything)),
    "logit_bias": (st.nothing(), anything),
    "tools": (st.nothing(), anything),
}
CHAT_FIELDS = {**FIELDS, "max_completion_tokens": FIELDS["max_tokens"], "logprobs": (st.just(False), anything),
               "top_logprobs": (st.just(0), anything)}
TEXT_FIELDS = {**FIELDS, "echo": (st.just(False), anything), "suffix": (st.just(""), anything),
               "best_of": (st.just(1), anything), "logprobs": (st.just(0), anything)}
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "developer"]),
                                 "content": st.one_of(plain, st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": plain}), min_size=1, max_size=2))})
hostile_message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["tool", "function", "x", ""]), "content": plain}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(hostile_text, anything)}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": texts}), max_size=2)}), anything)


@st.composite
def body_of(draw: st.DrawFn, kind: str) -> Any:
    """A well-formed body with some of the optional fields, then none, one or two of its fields made hostile."""
    fields = CHAT_FIELDS if kind == "chat" else TEXT_FIELDS
    if kind == "chat":
        body: dict[str, Any] = {"model": MODEL, "messages": draw(st.lists(message, min_size=1, max_size=3))}
    else:
        body = {"model": MODEL, "prompt": draw(st.one_of(plain, st.lists(plain, min_size=1, max_size=1)))}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=5, unique=True)):
        body[name] = draw(fields[name][0])
    body.setdefault("max_tokens", draw(st.integers(1, 4)))
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2]))):
        name = draw(st.sampled_from([*sorted(fields), "model", "messages" if kind == "chat" else "prompt"]))
        hostile = {"model": st.one_of(plain, anything), "prompt": st.one_of(hostile_text, st.lists(plain, min_size=2),
                                                                             anything),
                   "messages": st.one_of(st.lists(hostile_message, max_size=3), st.just([]), anything)}.get(name)
        body[name] = draw(hostile if hostile is not None else fields[name][1])
    return body


chunks_body = st.one_of(st.fixed_dictionaries({"texts": st.lists(plain, min_size=1, max_size=3)}),
                        st.fixed_dictionaries({"texts": st.one_of(st.lists(texts, max_size=6), anything)}), anything)

json_request = st.one_of(
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), body_of("chat")),
    st.tuples(st.just("POST"), st.just("/v1/chat/completions"), body_of("chat")),
    st.tuples(st.just("POST"), st.just("/v1/completions"), body_of("text")),
    st.tuples(st.just("POST"), st.just("/v1/kvrag/chunks"), chunks_body),
    st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
              st.sampled_from(["/v1/models", "/health", "/health/ready", "/metrics", "/v1/chat/completions", "/",
                               "/v1/embeddings", "/docs", "/openapi.json", "/v1/kvrag/chunks/x"]), anything))
headers = st.fixed_dictionaries({}, optional={
    "authorization": st.one_of(st.just(f"Bearer {KEY}"), st.just(f"bearer {KEY}"), st.just(KEY),
                               st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20)),
    "content-type": st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                     "multipart/form-data", "application/json; charset=latin-1", ""])})
# most requests carry the key and JSON: the rest of the server is what is fuzzed


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, str]]:
    method, path, body = draw(json_request)
    hdrs = draw(headers) if draw(st.integers(0, 4)) == 0 else {}
    if draw(st.integers(0, 19)) == 0:
        raw = draw(st.binary(max_size=64))  # not JSON at all
    else:
        raw = json.dumps(body).encode()  # NaN and Infinity as Python writes them; surrogates as \\u escapes
    hdrs.setdefault("authorization", f"Bearer {KEY}")
    hdrs.setdefault("content-type", "application/json")
    return method, path, raw, hdrs


@pytest.fixture(scope="module")
def engine() -> KVRAGEngine:
    return KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig(method="stale", max_context=96))


@pytest.fixture(scope="module")
def client(engine: KVRAGEngine) -> Iterator[Any]:
    cfg = ServeConfig(model_id=MODEL, api_keys=(KEY,), max_texts=4, max_text_bytes=256, max_body_bytes=64 * 2**10)
    with LiveServer(create_app(engine, cfg), drain_timeout_s=5) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def check_answer(r: Any, body: bytes) -> None:
    assert r.status_code < 500, (r.status_code, body[:300])
    if r.status_code >= 400:
        if r.status_code == 499:
            return
        err = json.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], body[:300]
        assert err["type"] != "server_error", body[:300]
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in body.decode().splitlines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert event.get("error", {}).get("type") != "server_error", line


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(req=requests())
def test_fuzzed_requests_get_no_5xx(client: Any, req: tuple[str, str, bytes, dict[str, str]]) -> None:
    method, path, raw, hdrs = req
    with client.stream(method, path, content=raw if method != "GET" else None, headers=hdrs) as r:
        body = r.read()
    check_answer(r, body)


def test_nothing_is_left_after_the_fuzzing(engine: KVRAGEngine, client: Any) -> None:
    """Runs after the fuzz test (file order): the server is idle, healthy, and answers."""
    deadline = time.monotonic() + 30
    while True:
        st_ = engine.batcher.stats()
        health = client.get("/health")
        if (st_["kv"]["leases"], st_["kv"]["used"], health.json()["in_flight"]) == (0, 0, 0):
            break
        assert time.monotonic() < deadline, (st_["kv"], health.json())
        time.sleep(0.05)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    r = client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
