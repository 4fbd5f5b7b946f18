"""A real 3-master Redis Cluster on loopback: the standard store suite, key spread, and a master going down.

Skips (does not fail) without redis-server / redis-cli / redis-py.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvrag.config import EngineConfig
from kvrag.engine.engine import KVRAGEngine
from kvrag.errors import ConfigError, StoreError
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store.base import KVStore
from kvrag_testing.store_suite import KVStoreTests
from kvrag_testing.tiny import tiny_model

PASSAGES = [render_passage(f"Fact {i}: the {w} ferry leaves at {i + 5} o'clock from pier {i}.", f"Doc {i}")
            for i, w in enumerate(["red", "blue", "green", "white", "black", "grey"])]


def _prefix() -> str:
    return f"kvrag-cluster-{uuid.uuid4().hex}:"


def _keys_on_nodes(cluster: Any, prefix: str) -> list[int]:
    import redis

    out = []
    for port in cluster.ports:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=5) as r:
            out.append(len(r.keys(prefix + "*")))
    return out


def _ask(eng: KVRAGEngine) -> Any:
    prompt = RagTemplate().render(eng.tokenizer, PASSAGES, "When does the red ferry leave?")
    return eng.answer(prompt, PASSAGES, "stale", max_new_tokens=4)


@pytest.fixture
def fresh_cluster() -> Iterator[Any]:
    """A cluster of its own (the test kills a node)."""
    pytest.importorskip("redis", reason="redis-py not installed (pip install 'kvrag[redis]')")
    from kvrag_testing.redis_server import RedisCluster

    try:
        cluster = RedisCluster(masters=3)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with cluster:
        yield cluster


class TestRedisClusterStore(KVStoreTests):
    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster: Any) -> None:
        self.url = redis_cluster.url

    def make_store(self, tmp_path: Path, **opts: Any) -> KVStore:
        from kvrag.store.factory import store_from_url

        return store_from_url(self.url, prefix=_prefix(), **opts)


def test_a_plain_url_on_a_cluster_node_names_the_cluster_scheme(redis_cluster: Any) -> None:
    """redis://NODE reached one node: every key another node holds failed with a MOVED reply mid-ingest, and reads
    fell back to recomputing everything."""
    from kvrag.store.factory import store_from_url

    plain = redis_cluster.url.replace("redis+cluster://", "redis://") + "/0"
    with pytest.raises(ConfigError, match=r"is a Redis Cluster node: use redis\+cluster://"):
        store_from_url(plain)


def test_cluster_url_spreads_keys_over_every_master_and_serves_them(redis_cluster: Any) -> None:
    from kvrag.store.factory import store_from_url
    from kvrag.store.redis import RedisStore

    prefix = _prefix()
    store = store_from_url(redis_cluster.url, prefix=prefix)
    assert isinstance(store, RedisStore) and "RedisCluster" in type(store._client).__name__
    eng = KVRAGEngine(tiny_model("llama"), store)
    texts = [*PASSAGES, *[render_passage(f"Extra note {i} about harbour timetables.") for i in range(18)]]
    keys = eng.ingest(texts, batch_size=4)
    per_node = _keys_on_nodes(redis_cluster, prefix)
    assert sum(per_node) == len(set(keys)) == len(texts) and min(per_node) > 0, per_node
    assert sorted(store.iter_keys()) == sorted(keys)  # SCAN covers every master
    resp = _ask(eng)
    assert resp.stats["hit_rate"] == 1.0 and resp.stats["chunk_misses"] == 0
    store.close()


def test_cluster_master_going_down_degrades_as_on_store_error_says(
    fresh_cluster: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from kvrag.store.factory import store_from_url

    prefix = _prefix()
    lm = tiny_model("llama")
    recompute = KVRAGEngine(lm, store_from_url(fresh_cluster.url, prefix=prefix, socket_timeout=2.0),
                            EngineConfig(store_retry_s=0.0))
    strict = KVRAGEngine(lm, store_from_url(fresh_cluster.url, prefix=prefix, socket_timeout=2.0),
                         EngineConfig(on_store_error="raise"))
    recompute.ingest(PASSAGES)
    ref = _ask(recompute)
    assert ref.stats["hit_rate"] == 1.0
    per_node = _keys_on_nodes(fresh_cluster, prefix)
    victim = max(range(3), key=lambda i: per_node[i])
    assert per_node[victim] > 0

    fresh_cluster.kill_node(victim)  # one master goes away mid-run
    with caplog.at_level(logging.WARNING, logger="kvrag.store"):
        down = [_ask(recompute) for _ in range(2)]
    assert [r.text for r in down] == [ref.text] * 2  # answers still work, caches recomputed
    assert all(r.stats["chunk_misses"] >= per_node[victim] for r in down)
    # a partial outage flaps (keys on the live masters still work): announced once, not once per request
    warned = [r.getMessage() for r in caplog.records if "continuing WITHOUT the store" in r.getMessage()]
    assert len(warned) == 1 and f"127.0.0.1:{fresh_cluster.ports[0]}" in warned[0], warned
    assert recompute.serving_store.stats()["outages"] >= 1
    with pytest.raises(StoreError):
        _ask(strict)  # on_store_error="raise"
    with pytest.raises(StoreError):
        recompute.ingest(PASSAGES)  # ingest always fails loudly (some of these keys live on the dead master)
