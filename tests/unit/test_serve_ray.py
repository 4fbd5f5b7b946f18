"""kvrag serve on Ray Serve: 2 replicas on a local Ray, one real 3-master Redis Cluster as the store, one shared chunk table.

A passage registered through one replica is found and hit by both (each cache computed once, by the registration),
and every replica answers what one engine answers alone.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="kvrag serve needs the serve extra (pip install 'kvrag[serve]')")
pytest.importorskip("ray.serve", reason="needs Ray Serve (pip install 'kvrag[ray-serve]')")
httpx = pytest.importorskip("httpx")

from kvrag.adapters import render_chat  # noqa: E402
from kvrag.serve import ServeConfig, ray_serve  # noqa: E402
from kvrag_testing.redis_server import free_port  # noqa: E402
from kvrag_testing.tiny import tiny_engine  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen2"
PASSAGES = ["\n\nParis is the capital of France. The city has many museums.",
            "\n\nBerlin is the capital of Germany. It is a large city."]
CONTENT = "Answer from the documents." + "".join(PASSAGES) + "\n\nQuestion: Which city is the capital of France?"


@pytest.fixture(scope="module")
def deployment(redis_cluster: Any) -> Iterator[str]:
    import ray

    ray.init(num_cpus=4, namespace="kvrag-test", include_dashboard=False, log_to_driver=False)
    try:
        url = ray_serve.run(functools.partial(tiny_engine, "qwen2", store=redis_cluster.url, method="stale"),
                            ServeConfig(model_id=MODEL, server_header=True), port=free_port(), replicas=2,
                            ray_actor_options={"num_cpus": 1})
        yield url
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def test_two_replicas_share_the_store_and_the_chunk_table(deployment: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": CONTENT}], "max_tokens": 6}
    with httpx.Client(base_url=deployment, timeout=60) as c:
        reg = c.post("/v1/kvrag/chunks", json={"texts": PASSAGES}).json()["data"]
        assert [d["cached"] for d in reg] == [False, False]  # computed once, by the replica that registered them
        servers, answers = set(), []
        deadline = time.monotonic() + 60
        while len(servers) < 2 or len(answers) < 4:  # until both replicas have answered
            assert time.monotonic() < deadline, f"only {servers} answered"
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            servers.add(r.headers["X-Kvrag-Server"])
            out = r.json()
            assert out["kvrag"]["hit_rate"] == 1.0 and out["kvrag"]["chunk_misses"] == 0
            answers.append(out["choices"][0]["message"]["content"])
    alone = tiny_engine("qwen2", method="stale")
    alone.ingest(PASSAGES)
    prompt = render_chat(alone.tokenizer, [{"role": "user", "content": CONTENT}])
    ref = alone.answer(prompt, PASSAGES, max_new_tokens=6).text
    assert answers == [ref] * len(answers)
