"""Real OpenAI clients, as their users write them, against kvrag serve on 127.0.0.1 with the real default model.

Each client's answer equals the in-process answer for the same prompt and method (greedy, float32): the engine itself
for the ``openai`` SDK, ``KVCachedLLM`` in the same LlamaIndex query engine, ``ChatKVCached`` in the same LCEL chain.
The passages registered with the server (``POST /v1/kvrag/chunks``) are all hits. The last test starts the real
``kvrag serve`` command and stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
httpx = pytest.importorskip("httpx")

from kvrag import adapters  # noqa: E402
from kvrag.config import EngineConfig  # noqa: E402
from kvrag.engine.engine import KVRAGEngine  # noqa: E402
from kvrag.serve import LiveServer, ServeConfig, create_app  # noqa: E402
from kvrag.store.memory import MemoryStore  # noqa: E402
from kvrag_testing.redis_server import free_port  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "kvrag-smollm2"
N = 8
_fares = [p.strip() for p in (ROOT / "examples/data/02_fares.md").read_text().split("\n\n") if p.strip()]
PASSAGES = [p for p in _fares if not p.startswith("#")][:3]
QUESTION = "How much does a day pass cost?"


@pytest.fixture(scope="module")
def engine(default_model_fp32: Any) -> KVRAGEngine:
    return KVRAGEngine(default_model_fp32, MemoryStore(), EngineConfig(method="stale"))


@pytest.fixture(scope="module")
def server(engine: KVRAGEngine) -> Iterator[LiveServer]:
    with LiveServer(create_app(engine, ServeConfig(model_id=MODEL, method="stale")), drain_timeout_s=10) as srv:
        r = httpx.post(srv.url + "/v1/kvrag/chunks", json={"texts": PASSAGES}, timeout=120)
        assert r.status_code == 200 and len(r.json()["data"]) == len(PASSAGES)
        yield srv


def hits(server: LiveServer) -> tuple[float, float]:
    """(chunk hits, chunks registered) so far, from the server's /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    vals = {ln.split(" ")[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln and ln[0] != "#"}
    return vals.get("kvrag_chunk_hits_total", 0.0), vals.get("kvrag_chunks_registered_total", 0.0)


def test_openai_sdk_sync_async_stream(engine: KVRAGEngine, server: LiveServer) -> None:
    openai = pytest.importorskip("openai")
    content = "Answer from the passages.\n\n" + "\n\n".join(PASSAGES) + f"\n\nQuestion: {QUESTION}"
    msgs = [{"role": "user", "content": content}]
    prompt = adapters.render_chat(engine.tokenizer, msgs)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0)
    for method in ("stale", "cacherepair"):
        ref = engine.answer(prompt, PASSAGES, method, max_new_tokens=N)
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, temperature=0,
                                           extra_body={"kvrag": {"method": method}})
        assert r.choices[0].message.content == ref.text, method
        extra = r.model_extra or {}
        assert extra["kvrag"]["hit_rate"] == 1.0 and extra["kvrag"]["method"] == ref.method
        assert r.usage.prompt_tokens_details.cached_tokens >= ref.stats.chunk_tokens > 0
    ref = engine.answer(prompt, PASSAGES, "stale", max_new_tokens=N).text
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        parts += [c.delta.content or "" for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(parts) == ref and usage is not None and usage.completion_tokens > 0

    async def concurrent() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0) as a:
            rs = await asyncio.gather(*(a.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N)
                                        for _ in range(2)))
        return [x.choices[0].message.content or "" for x in rs]

    assert asyncio.run(concurrent()) == [ref, ref]


def test_llamaindex_openailike_in_a_query_engine(engine: KVRAGEngine, server: LiveServer) -> None:
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core import SummaryIndex
    from llama_index.core.schema import TextNode
    from llama_index.llms.kvrag import KVCachedLLM
    from llama_index.llms.openai_like import OpenAILike
    from llama_index.postprocessor.kvrag import KVCachePostprocessor

    index = SummaryIndex([TextNode(text=p) for p in PASSAGES])
    remote = OpenAILike(model=MODEL, api_base=server.url + "/v1", api_key="not-needed", is_chat_model=True,
                        context_window=2048, max_tokens=N, temperature=0.0, max_retries=0)
    before = hits(server)
    answer = str(index.as_query_engine(llm=remote).query(QUESTION))
    after = hits(server)
    local = KVCachedLLM(engine=engine, method="stale", max_new_tokens=N)
    expected = str(index.as_query_engine(llm=local, node_postprocessors=[KVCachePostprocessor(engine=engine)])
                   .query(QUESTION))
    assert answer == expected and answer.strip()
    assert after[1] - before[1] == len(PASSAGES) and after[0] - before[0] == len(PASSAGES)  # hit rate 1.0


def test_langchain_chatopenai_in_an_lcel_chain(engine: KVRAGEngine, server: LiveServer) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_kvrag import ChatKVCached
    from langchain_openai import ChatOpenAI

    prompt = ChatPromptTemplate.from_template("Answer using only this context:\n\n{context}\n\nQuestion: {question}")
    context = RunnableLambda(lambda _: "\n\n".join(PASSAGES))

    def chain(llm: Any) -> Any:
        return {"context": context, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()

    remote = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key="not-needed", temperature=0, max_tokens=N,
                        max_retries=0)
    before = hits(server)
    answer = chain(remote).invoke(QUESTION)
    streamed = "".join(chain(remote).stream(QUESTION))
    after = hits(server)
    adapters.register_chunks(PASSAGES)  # what KVCacheRetriever does in process
    expected = chain(ChatKVCached(engine=engine, method="stale", max_tokens=N)).invoke(QUESTION)
    assert answer == expected == streamed and answer.strip()
    assert after[1] - before[1] == 2 * len(PASSAGES) and after[0] - before[0] == 2 * len(PASSAGES)



def start_serve(*args: str) -> tuple[subprocess.Popen[str], str]:
    """`kvrag serve` on a free loopback port with ``args``, output piped: the process and its URL."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "kvrag.cli", "serve", "--port", str(port), "--model-id", MODEL,
                             *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def wait_until_up(proc: subprocess.Popen[str], url: str) -> None:
    """Until ``/health`` answers 200 (a deadline guard of 120 s; the process must stay alive)."""
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "kvrag serve did not start"
        time.sleep(0.5)


def test_kvrag_serve_command_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    proc, url = start_serve("--store", f"file://{tmp_path / 'kv'}", "--max-queue", "4")
    try:
        wait_until_up(proc, url)
        assert httpx.post(url + "/v1/kvrag/chunks", json={"texts": PASSAGES[:1]}, timeout=60).status_code == 200
        # a passage after some leading text: text that starts a prompt is its prefix, never a chunk
        body = {"model": MODEL, "prompt": f"Context:\n\n{PASSAGES[0]}\n\nQ: {QUESTION}\nA:", "max_tokens": 4}
        out = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert out["kvrag"]["hit_rate"] == 1.0 and out["usage"]["completion_tokens"] >= 1
        assert len(list((tmp_path / "kv").rglob("*"))) > 0  # caches went to the file store
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0


def test_sigterm_during_a_long_prepare_answers_at_the_drain_timeout_and_exits(tmp_path: Path) -> None:
    """SIGTERM while a 6K-token prompt is being prepared (one forward: nothing else decodes, so it is not in pieces):
    the client gets a 503 naming the shutdown at the drain timeout instead of its completion, and the process exits
    0 without waiting for the forward (how soon: ``kvrag serve --drain-timeout``, docs/serve.md#deploying)."""
    drain = 2.0
    proc, url = start_serve("--threads", "1", "--drain-timeout", str(drain))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        wait_until_up(proc, url)
        body = {"model": MODEL, "prompt": "word " * 6000 + "\nQ: how many words?\nA:", "max_tokens": 4,
                "kvrag": {"method": "full"}}
        fut = pool.submit(lambda: httpx.post(url + "/v1/completions", json=body, timeout=120))

        def leases() -> float:
            text = httpx.get(url + "/metrics", timeout=10).text
            return float(next(ln for ln in text.splitlines() if ln.startswith("kvrag_kv_leases ")).split()[1])

        while leases() < 1:  # admitted: its prepare is running
            assert not fut.done(), fut.result().text
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)  # a deadline guard; how soon it exits is measured in docs/results/serve-limits.md
        r = fut.result(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        pool.shutdown()
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
    # answered 503 at the drain deadline while its prepare was still running (a finished prepare answers 200)
    assert rc == 0, proc.stdout.read() if proc.stdout else ""
