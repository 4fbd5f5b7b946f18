"""Over HTTP: an OpenAI client sending the whole ``messages`` list each turn gets the earlier turns' KV reused,
reported in ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

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
MODEL = "tiny-llama"


def test_a_chat_over_http_reuses_its_earlier_turns() -> None:
    eng = KVRAGEngine(tiny_model("llama", init_std=0.02, seed=2), MemoryStore(), EngineConfig(max_context=512))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer briefly."}]
    cached, prompt = [], []
    with LiveServer(create_app(eng, ServeConfig(model_id=MODEL, max_queue=4)), drain_timeout_s=5) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as c:
        for q in ("What is the capital of France?", "And of Germany?", "Which is larger?"):
            messages.append({"role": "user", "content": q})
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 6})
            assert r.status_code == 200, r.text
            body = r.json()
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            prompt.append(body["usage"]["prompt_tokens"])
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    assert cached[0] == 0
    # the turn before's prompt reused (its answer, written by decode steps, is prefilled again with the new message)
    assert all(0 < cached[i] <= prompt[i - 1] for i in (1, 2))
