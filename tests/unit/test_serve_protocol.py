"""kvrag serve's protocol pinned over HTTP: every field bound of the OpenAI bodies, sampling that a greedy server
would fail, and both finish reasons.

Each bound is checked on both sides (the value just past it is a 400 naming the field, the value on it is answered),
so a server that refuses too much fails as well as one that accepts too much.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
pytest.importorskip("uvicorn", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
httpx = pytest.importorskip("httpx")

from kvrag.config import EngineConfig  # noqa: E402
from kvrag.engine.engine import KVRAGEngine  # noqa: E402
from kvrag.serve import LiveServer, ServeConfig, create_app  # noqa: E402
from kvrag.store.memory import MemoryStore  # noqa: E402
from kvrag_testing.tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = "tiny-qwen2"
SEEDS = 24


@pytest.fixture(scope="module")
def engine() -> KVRAGEngine:
    return KVRAGEngine(tiny_model("qwen2", init_std=0.1), MemoryStore(), EngineConfig(method="stale", max_context=512))


@pytest.fixture(scope="module")
def client(engine: KVRAGEngine) -> Iterator[Any]:
    with LiveServer(create_app(engine, ServeConfig(model_id=MODEL)), drain_timeout_s=5) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 1, **kw}


def text(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, **kw}


# (endpoint body, a value past the bound -> 400 naming param, a value on the bound -> answered)
BOUNDS = [
    ("chat", "max_tokens", 0, 1),
    ("chat", "max_completion_tokens", 0, 1),
    ("text", "max_tokens", 0, 1),
    ("chat", "temperature", -0.01, 0.0),
    ("chat", "temperature", 2.01, 2.0),
    ("text", "temperature", 2.5, 2.0),
    ("chat", "top_p", 0.0, 1e-6),
    ("chat", "top_p", 1.01, 1.0),
    ("chat", "stop", ["a", "b", "c", "d", "e"], ["a", "b", "c", "d"]),
    ("text", "stop", ["a", "b", "c", "d", "e"], "a"),
    ("chat", "frequency_penalty", 0.5, 0.0),
    ("chat", "presence_penalty", -1.0, 0),
    ("text", "frequency_penalty", 1.0, 0),
    ("chat", "n", 2, 1),
    ("text", "n", 3, 1),
    ("text", "best_of", 2, 1),
    ("text", "echo", True, False),
    ("text", "suffix", "tail", ""),
    ("text", "logprobs", 1, 0),
    ("chat", "logprobs", True, False),
    ("chat", "top_logprobs", 2, 0),
    ("text", "prompt", [], ["one", "two"]),
    ("text", "prompt", ["p"] * 33, ["p"] * 3),
    ("chat", "messages", [], [{"role": "user", "content": "hi"}]),
    ("chat", "seed", 2**63, 2**63 - 1),
    ("chat", "seed", -(2**63) - 1, -(2**63)),
    ("chat", "temperature", float("nan"), 1.0),
    # sent by clients that always send their defaults: accepted at the neutral value only
    ("chat", "response_format", {"type": "json_object"}, {"type": "text"}),
    ("chat", "tools", [{"type": "function", "function": {"name": "f"}}], []),
    ("chat", "tool_choice", "auto", "none"),
    ("chat", "store", True, False),
    ("chat", "logit_bias", {"50256": -100}, {}),
    ("text", "logit_bias", {"1": 5}, {}),
    ("chat", "modalities", ["text", "audio"], ["text"]),
    ("chat", "functions", [{"name": "f"}], None),
    ("chat", "function_call", "auto", None),
    ("chat", "top_k", -2, -1),
    # types as OpenAI checks them: no string or boolean stands in for another type
    ("chat", "stream", "yes", False),
    ("text", "stream", 1, False),
    ("chat", "max_tokens", "3", 3),
    ("chat", "max_tokens", True, 1),
    ("chat", "max_completion_tokens", 2.0, 2),
    ("chat", "n", "1", 1),
]


@pytest.mark.parametrize(("kind", "field", "bad", "good"), BOUNDS,
                         ids=[f"{k}-{f}-{b!r}" for k, f, b, _ in BOUNDS])
def test_each_field_bound_over_http(client: Any, kind: str, field: str, bad: Any, good: Any) -> None:
    path, body = ("/v1/chat/completions", chat) if kind == "chat" else ("/v1/completions", text)
    extra = {"temperature": 1.0} if field == "seed" else {}
    if isinstance(bad, float) and bad != bad:  # NaN is not JSON: sent as the token clients' encoders write
        raw = body(**extra).copy()
        r = client.post(path, content=_json_with(raw, field, "NaN"), headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body(**extra, **{field: bad}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error"
    ok = client.post(path, json=body(**extra, **{field: good}))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


def _json_with(body: dict[str, Any], field: str, literal: str) -> bytes:
    import json

    return (json.dumps(body)[:-1] + f', "{field}": {literal}}}').encode()


def first_token_text(client: Any, **kw: Any) -> str:
    r = client.post("/v1/completions", json=text(**kw))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 1
    return str(out["choices"][0]["text"])


def test_sampling_at_temperature_one_is_not_greedy(client: Any) -> None:
    """Over seeds, the first token at temperature 1 takes several values, most of them not greedy's (the tiny
    model's next-token distribution is nearly flat); a greedy server gives greedy's token every time. The same seed
    gives the same token."""
    greedy = first_token_text(client, temperature=0)
    assert first_token_text(client) == greedy  # temperature omitted: greedy
    sampled = Counter(first_token_text(client, temperature=1.0, seed=s) for s in range(SEEDS))
    assert len(sampled) >= SEEDS // 3, sampled
    assert sampled[greedy] <= SEEDS // 2, sampled
    assert first_token_text(client, temperature=1.0, seed=5) == first_token_text(client, temperature=1.0, seed=5)
    # top_p at its smallest keeps only the most likely token: greedy's, whatever the seed
    assert {first_token_text(client, temperature=1.0, top_p=1e-6, seed=s) for s in range(4)} == {greedy}


def _answer(client: Any, stream: bool, max_tokens: int = 12, **kw: Any) -> tuple[str, str, int]:
    """(text, finish_reason, completion tokens) of a chat completion, streamed or not."""
    body = chat(max_tokens=max_tokens, **kw)
    if not stream:
        out = client.post("/v1/chat/completions", json=body).json()
        return (out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"],
                out["usage"]["completion_tokens"])
    import json

    with client.stream("POST", "/v1/chat/completions",
                       json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert len(finish) == 1
    return content, finish[0], events[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("stream", [False, True])
def test_finish_reason_length_and_stop(client: Any, stream: bool) -> None:
    def answer(**kw: Any) -> tuple[str, str, int]:
        return _answer(client, stream, **kw)

    full, reason, n = answer()
    assert (reason, n) == ("length", 12) and full  # the tiny model does not stop by itself within 12 tokens
    cut = full[4:7]
    stopped, reason, n = answer(stop=cut)
    assert reason == "stop" and stopped == full.split(cut)[0] and n < 12


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_completed_by_the_last_allowed_token_is_stop(client: Any, stream: bool) -> None:
    """OpenAI answers ``"stop"`` whenever a stop sequence ended the output, also when the token that completed it
    was the last one ``max_tokens`` allowed; a client reads ``"length"`` as a cut-off answer to continue."""
    texts = [_answer(client, stream, max_tokens=k)[0] for k in range(1, 9)]  # the greedy answer, token by token
    cases = [(k, texts[k - 1][len(texts[k - 2]):]) for k in range(2, 9)]
    cases = [(k, last) for k, last in cases if last.strip() and last not in texts[k - 2]]
    assert cases  # some token's text is new in the answer, so it can be a stop string
    for k, last in cases[:2]:
        assert _answer(client, stream, max_tokens=k, stop=last) == (texts[k - 2], "stop", k)
        assert _answer(client, stream, max_tokens=k - 1)[1:] == ("length", k - 1)


def test_neutral_client_defaults_and_an_sdk_dumped_assistant_turn_are_answered(client: Any) -> None:
    """What SDKs and frameworks send without being asked: ``parallel_tool_calls``, ``metadata``, ``user``, and an
    assistant turn sent back as ``ChatCompletionMessage.model_dump()`` dumps it (null refusal, tool_calls, audio,
    function_call, annotations)."""
    dumped = {"role": "assistant", "content": "Paris.", "refusal": None, "tool_calls": None, "function_call": None,
              "audio": None, "annotations": []}
    messages = [{"role": "user", "content": "Name a city."}, dumped, {"role": "user", "content": "Another one."}]
    r = client.post("/v1/chat/completions", json=chat(messages=messages, parallel_tool_calls=False,
                                                      metadata={"session": "a"}, user="u1"))
    assert r.status_code == 200, r.text
    plain = [{"role": "user", "content": "Name a city."}, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "Another one."}]
    assert r.json()["choices"][0] == client.post("/v1/chat/completions", json=chat(messages=plain)).json()["choices"][0]


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}]},
     "messages.0.tool_calls", "tool calling"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0", "needs content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]},
     "messages.0.content", "'image_url'"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"metadata": {"k": 1}}, "metadata.k", "string"),
    # a list of parts is judged as a list (not "Input should be a valid string" from the plain-text member)
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text",
     "string"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", "missing"),
    ({"min_p": 0.05}, "min_p", "another server's extension"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "reasoning models"),
    ({"kvrag": {"methd": "stale"}}, "kvrag.methd", "chunks, method, params"),
    ({"kvrag": {"method": " "}}, "kvrag.method", "empty method"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options.continuous_usage_stats",
     "continuous_usage_stats"),
])
def test_unsupported_message_fields_name_the_problem(client: Any, body: dict[str, Any], param: str, says: str) -> None:
    r = client.post("/v1/chat/completions", json=chat(**body))
    if body.get("stream"):
        assert r.status_code == 400, r.text
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


@pytest.mark.parametrize(("content", "headers"), [
    (b'[{"model": "tiny-qwen2"}]', {"content-type": "application/json"}),  # JSON, not an object
    (b"model=tiny-qwen2&max_tokens=1", {"content-type": "application/x-www-form-urlencoded"}),  # curl -d without -H
])
def test_a_body_that_is_not_a_json_object_says_how_to_send_one(client: Any, content: bytes,
                                                                headers: dict[str, str]) -> None:
    r = client.post("/v1/chat/completions", content=content, headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_json" and "JSON" in err["message"], err


def test_a_body_of_invalid_utf8_is_invalid_json(client: Any) -> None:
    r = client.post("/v1/chat/completions", content=b'{"model": "\xff\xfe"}', headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json", r.text
    huge = b'{"model": "x", "max_tokens": ' + b"9" * 5000 + b"}"  # valid JSON past Python's digit limit
    r = client.post("/v1/chat/completions", content=huge, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "over 4,300 digits" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("prompt", [[1, 2, 3], [[1, 2], [3]]])
def test_a_token_id_prompt_is_said_to_be_unsupported(client: Any, prompt: Any) -> None:
    r = client.post("/v1/completions", json=text(prompt=prompt))
    assert r.status_code == 400 and "token-id prompts are not supported" in r.json()["error"]["message"], r.text


def test_a_wrong_role_or_a_nested_methods_parameter_is_named_as_sent(client: Any) -> None:
    """An unknown role was refused as "tool calling is not supported"; hybrid's bad r was refused as relaxkv's."""
    r = client.post("/v1/chat/completions", json=chat(messages=[{"role": "wizard", "content": "hi"}]))
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "role 'wizard'" in msg and "tool calling" not in msg, r.text
    r = client.post("/v1/chat/completions", json=chat(kvrag={"method": "hybrid:r=1e308"}))
    assert r.status_code == 400 and "method 'hybrid': r must be in (0, 1]" in r.json()["error"]["message"], r.text



def test_openai_hints_and_other_clients_extras_are_answered(client: Any) -> None:
    """Fields OpenAI's current SDK and LangChain send that mean nothing to one local model (prompt_cache_key and
    safety_identifier, which replace user; service_tier; include_obfuscation), null tool fields on any message, and
    the keys LangChain puts on a text part ("id"), were each a 400."""
    plain = client.post("/v1/chat/completions", json=chat()).json()["choices"][0]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a city.", "id": "b1"}],
              "tool_call_id": None}]
    r = client.post("/v1/chat/completions", json=chat(
        messages=parts, prompt_cache_key="k1", safety_identifier="u-hash", service_tier="auto", functions=None,
        function_call=None, stream=True, stream_options={"include_usage": True, "include_obfuscation": False}))
    assert r.status_code == 200, r.text
    assert plain["message"]["content"] in r.text


def test_top_k_one_samples_greedily(client: Any) -> None:
    """top_k (vLLM's and llama.cpp's extension, which kvrag's sampler has): top_k=1 at temperature 1 is greedy."""
    greedy = first_token_text(client, max_tokens=1)
    assert {first_token_text(client, temperature=1.0, top_k=1, seed=s) for s in range(6)} == {greedy}


def test_a_list_of_prompts_gets_one_choice_each_as_each_alone(client: Any) -> None:
    """LangChain's OpenAI LLM sends up to 20 prompts in one request (batch, generate): they were a 400."""
    prompts = ["The capital of France is", "One, two, three,", "The capital of France is"]
    alone = [client.post("/v1/completions", json=text(prompt=p, max_tokens=3)).json() for p in prompts]
    r = client.post("/v1/completions", json=text(prompt=prompts, max_tokens=3))
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["text"] for c in out["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert [c["finish_reason"] for c in out["choices"]] == [a["choices"][0]["finish_reason"] for a in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert out["usage"][key] == sum(a["usage"][key] for a in alone)
    assert len(out["kvrag"]["prompts"]) == 3
    streamed = client.post("/v1/completions", json=text(prompt=prompts, stream=True))
    assert streamed.status_code == 400 and "one prompt" in streamed.json()["error"]["message"]


def test_a_list_with_one_prompt_too_long_is_its_error_and_leaves_nothing_held(client: Any, engine: KVRAGEngine) -> None:
    from kvrag_testing.waiting import wait_until

    def cancelled() -> str:
        return next(ln for ln in client.get("/metrics").text.splitlines() if ln.startswith("kvrag_cancelled_requests"))

    before = cancelled()
    r = client.post("/v1/completions", json=text(prompt=["The capital of France is", "word " * 2000], max_tokens=3))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "prompt.1"  # which prompt of the list

    def idle() -> bool:
        st = engine.batcher.stats()
        return st["decoding"] == 0 and st["joining"] == 0 and st["kv"]["leases"] == 0

    wait_until(idle, timeout=30)
    assert client.post("/v1/completions", json=text()).status_code == 200
    assert cancelled() == before  # the other prompt ended with the list's status, not as a client that left


def test_a_list_longer_than_the_queue_is_a_400_not_a_429_forever(engine: KVRAGEngine) -> None:
    """A list of 5 prompts on a server holding at most 4 requests got 429 queue_full ("retry later") when idle,
    which the openai SDK retried in vain, each attempt admitting 4 prompts and counting them as cancelled."""
    with LiveServer(create_app(engine, ServeConfig(model_id=MODEL, max_queue=4)), drain_timeout_s=5) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        r = c.post("/v1/completions", json=text(prompt=["a", "b", "c", "d", "e"], max_tokens=2))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "too_many_prompts" and "--max-queue 4" in err["message"] and err["param"] == "prompt"
        assert c.post("/v1/completions", json=text(prompt=["a", "b", "c", "d"], max_tokens=2)).status_code == 200
        assert "kvrag_cancelled_requests_total 0.0" in c.get("/metrics").text
