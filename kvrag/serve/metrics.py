"""Prometheus metrics of one ``kvrag serve`` app (its own registry, so several apps in one process do not collide).

Per request (observed by the app): time to first token, the gaps between streamed tokens, the wait before the
request's prepare started (queue wait: the scheduler's turns and the KV memory bound), the whole duration, prompt /
completion / cached tokens, the chunks registered and hit (hit rate = ``kvrag_chunk_hits_total /
kvrag_chunks_registered_total``, and a per-request histogram), and the method each request ran (``chosen`` is what
``auto`` picked, else the method itself). From the engine's scheduler at scrape time: decode steps and rows stepped
(mean batch size = rows / steps), requests decoding now, the largest batch, and the KV memory bound in use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvrag.extras import require

if TYPE_CHECKING:
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.engine.results import Prepared

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0)
HIT_RATE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


class _BatcherCollector:
    """Reads the engine's scheduler counters (:meth:`kvrag.engine.runner.Runner.stats`) at scrape time."""

    def __init__(self, engine: KVRAGEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.engine.runner.stats()
        yield CounterMetricFamily("kvrag_decode_steps", "Batched decode steps run by the engine", value=st.get("steps", 0))
        yield CounterMetricFamily("kvrag_decode_rows", "Request rows stepped (sum of batch sizes; / steps = mean batch size)",
                                  value=st.get("rows_stepped", 0))
        yield GaugeMetricFamily("kvrag_batch_size", "Requests decoding in the running batch now", value=st.get("decoding", 0))
        yield GaugeMetricFamily("kvrag_batch_size_max", "Largest decode batch so far", value=st.get("max_rows", 0))
        yield GaugeMetricFamily("kvrag_joining_requests", "Prepared requests waiting to join the batch",
                                value=st.get("joining", 0))
        kv = st.get("kv", {})
        yield GaugeMetricFamily("kvrag_kv_bytes_used", "KV bytes leased by requests in flight", value=kv.get("used", 0))
        yield GaugeMetricFamily("kvrag_kv_bytes_cached", "KV bytes held by kept conversations (within the bound; "
                                "given back when a request needs the room)", value=kv.get("cached", 0))
        yield GaugeMetricFamily("kvrag_kv_bytes_limit", "The engine's KV memory bound", value=kv.get("limit", 0))
        yield GaugeMetricFamily("kvrag_kv_leases", "KV leases held (requests holding memory)", value=kv.get("leases", 0))


class Metrics:
    """The app's metrics; :meth:`render` gives the Prometheus text format."""

    def __init__(self, engine: KVRAGEngine) -> None:
        prom = require("prometheus_client", "serve", "kvrag serve's /metrics")
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.ttft = prom.Histogram("kvrag_ttft_seconds", "Time from request arrival to its first token",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.itl = prom.Histogram("kvrag_inter_token_latency_seconds", "Time between two streamed text deltas",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = prom.Histogram("kvrag_queue_wait_seconds",
                                         "Time from request arrival until its prepare started", buckets=LATENCY_BUCKETS,
                                         registry=r)
        self.duration = prom.Histogram("kvrag_request_duration_seconds", "Whole request time (answered requests)",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.requests = prom.Counter("kvrag_requests", "Requests by endpoint and HTTP status",
                                     ["endpoint", "status"], registry=r)
        self.responses = prom.Counter("kvrag_http_responses", "Every HTTP response by status, also those given before "
                                      "a request is handled (401, 413, 404, a body that is not valid)",
                                      ["status"], registry=r)
        self.cancelled = prom.Counter("kvrag_cancelled_requests", "Requests whose client went away before the end",
                                      registry=r)
        self.in_flight = prom.Gauge("kvrag_requests_in_flight", "Requests held by the server (decoding or waiting)",
                                    registry=r)
        self.prompt_tokens = prom.Counter("kvrag_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = prom.Counter("kvrag_completion_tokens", "Generated tokens", registry=r)
        self.cached_tokens = prom.Counter("kvrag_cached_tokens", "Prompt tokens served from chunk caches", registry=r)
        self.chunks_registered = prom.Counter("kvrag_chunks_registered", "Registered chunks offered to requests",
                                              registry=r)
        self.chunk_hits = prom.Counter("kvrag_chunk_hits", "Registered chunks whose cache was in the store", registry=r)
        self.hit_rate = prom.Histogram("kvrag_chunk_hit_rate", "Per-request chunk hit rate (requests with chunks)",
                                       buckets=HIT_RATE_BUCKETS, registry=r)
        self.method = prom.Counter("kvrag_method_requests", "Requests by fusion method and the method it ran "
                                   "(auto's choice)", ["method", "chosen"], registry=r)
        self.store_degraded = prom.Counter("kvrag_store_degraded_requests",
                                           "Requests answered while the KV store was down (caches recomputed)",
                                           registry=r)
        r.register(_BatcherCollector(engine))
        self._content_type = prom.CONTENT_TYPE_LATEST
        self._generate = prom.generate_latest

    def observe_prepared(self, prep: Prepared, arrived: float) -> None:
        """A request's prepare finished (``arrived``: its ``perf_counter`` arrival time)."""
        st = prep.stats
        self.queue_wait.observe(max(0.0, prep.t0 - arrived))
        self.prompt_tokens.inc(int(prep.plan.total_len))
        self.cached_tokens.inc(int(st.reused_tokens))
        if st.chunks_registered:
            self.chunks_registered.inc(st.chunks_registered)
            self.chunk_hits.inc(st.chunk_hits)
            self.hit_rate.observe(st.hit_rate)
        # labelled by names (a client's parameter values, in a method or in auto's levels, would make a series each)
        chosen = (st.method_stats.auto_choice or prep.method.name).split(":")[0]  # a level's name, not its values
        self.method.labels(method=prep.method.name, chosen=chosen).inc()

    def render(self) -> tuple[bytes, str]:
        return self._generate(self.registry), self._content_type


__all__ = ["HIT_RATE_BUCKETS", "LATENCY_BUCKETS", "Metrics"]
