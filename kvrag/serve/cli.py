"""``kvrag serve``'s command line: its options and what it runs (the core CLI, :mod:`kvrag.cli`, mounts it)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from kvrag.config import DEFAULT_METHOD, KV_DTYPES
from kvrag.errors import ConfigError
from kvrag.extras import require
from kvrag.serve.config import ServeConfig, keys_from_env

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.index import IndexManifest

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvrag serve``."""
    parser.add_argument("--persist", default=None, help="index directory of `kvrag ingest`: its chunks are registered "
                                                            "and its manifest names the store and model")
    parser.add_argument("--store", default=None, help="store URL (default: the index's store, else memory:// "
                                                          "bounded to 2 GiB, as is a memory:// URL without max_bytes)")
    parser.add_argument("--model", default=None, help="model name or path (default: the index's, else the embedded one)")
    parser.add_argument("--quantize", default="default", choices=["default", "none", "int8", "int4"],
                        help="weights of the decode-sized products (default: the index's, else kvrag's choice for the "
                             "model on this machine; docs/quantization.md)")
    parser.add_argument("--model-id", default=None,
                        help="the model name clients send (default: the model's name; for a local file or folder, its "
                             "own name, e.g. model.gguf, never its path)")
    parser.add_argument("--method", default=DEFAULT_METHOD,
                        help=f"default fusion method spec (default {DEFAULT_METHOD}; e.g. stale, auto:budget=0.3)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-queue", type=int, default=64,
                        help="most requests held at once (decoding or waiting); more get 429 with Retry-After")
    parser.add_argument("--max-batch-size", type=int, default=8, help="most requests decoded together")
    parser.add_argument("--speculative-tokens", type=int, default=3,
                        help="tokens drafted from the prompt per greedy request and step (0: off; answers are the same)")
    parser.add_argument("--speculative-max-batch", type=int, default=8,
                        help="draft only while at most this many requests decode (default 8)")
    parser.add_argument("--pack-suffixes", action=argparse.BooleanOptionalAction, default=True,
                        help="prefill the question suffixes of requests arriving together in one forward (default "
                             "on): a burst ends sooner and its first tokens come together; answers are the same")
    parser.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                        help="precision of the K/V requests decode over (default auto: the compute dtype, so full "
                             "answers as model.generate does); int8 holds about half of bfloat16's bytes per "
                             "request at a measured next-token cost (docs/results/kv_precision.md)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the engine's runner, which runs every forward (default: torch's, the "
                             "machine's cores); the server's other threads run torch work on one thread")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                        help="answer one short prompt before listening (default on), so that the first client does "
                             "not pay the engine's one-time checks (seconds on a large model)")
    parser.add_argument("--conversation-cache-bytes", type=int, default=None,
                        help="most bytes of KV kept from answered requests for a chat's next turn (default: a quarter "
                             "of the KV bound; 0: off)")
    parser.add_argument("--move-history", action=argparse.BooleanOptionalAction, default=True,
                        help="when a chat's passages change, reuse its kept history at the new position, repaired "
                             "with the new passages, instead of prefilling it again (default on; never for full)")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="chat completions without max_tokens generate at most this many tokens")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on shutdown, seconds to let requests in flight finish")
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="a key clients must send as 'Authorization: Bearer KEY' (repeat for several; default: "
                             "$KVRAG_API_KEY, keys separated by commas); every endpoint but /health and /health/ready "
                             "answers 401 without one")
    limits = ServeConfig()
    for name, what in (("max_body_bytes", "bytes of a request body (413)"),
                       ("max_messages", "messages of a chat completion (400)"),
                       ("max_texts", "texts of one POST /v1/kvrag/chunks (413)"),
                       ("max_text_bytes", "bytes of one registered text (413)"),
                       ("max_text_tokens", "tokens of one registered text (400; one forward each)"),
                       ("max_registered_bytes", "text bytes registered over the server's life (413)"),
                       ("max_store_bytes", "store bytes above which nothing more is registered (413) nor a "
                                           "completion's own caches stored (default: none)")):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(limits, name),
                            help=f"most {what}")
    parser.add_argument("--docs", action="store_true", help="serve the API's /docs and /openapi.json pages")
    parser.add_argument("--server-header", action="store_true",
                        help="add X-Kvrag-Server: host:pid to every response (which replica answered)")
    parser.add_argument("--allowed-origins", action="append", metavar="ORIGIN", default=None,
                        help="a web origin whose browser pages may call the server (CORS), e.g. "
                             "http://localhost:3000, or '*' for any; repeat for several (default: none)")
    parser.add_argument("--stall-timeout", type=float, default=limits.stall_timeout_s,
                        help="/health answers 503 when the engine made no progress this many seconds with requests "
                             "waiting")
    parser.add_argument("--on-store-error", choices=["recompute", "raise"], default="recompute",
                        help="when the KV store fails: recompute caches (responses carry a Warning header), or fail")
    parser.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                        help="deploy on Ray Serve (pip install 'kvrag[ray-serve]'): ADDRESS of a running cluster; without one "
                             "(or 'local') a local Ray starts")
    parser.add_argument("--replicas", type=int, default=2, help="with --ray: replicas (each loads the model once)")
    parser.add_argument("--max-ongoing-requests", type=int, default=None,
                        help="with --ray: Ray Serve's max_ongoing_requests per replica")
    parser.add_argument("--autoscaling", default=None, metavar="JSON",
                        help="with --ray: Ray Serve's autoscaling_config as JSON (instead of --replicas), e.g. "
                             '\'{"min_replicas": 1, "max_replicas": 4}\'')


def run(args: argparse.Namespace, model: str | None, store: str, chunk_prefix: str, quantize: str = "default",
        index: IndexManifest | None = None) -> int:
    """Serve until SIGINT/SIGTERM (``model`` / ``store`` / ``chunk_prefix`` / ``quantize`` resolved by the caller from
    the options and the manifest ``index`` of ``--persist``, whose model the loaded one is checked against)."""
    require("fastapi", "serve", "kvrag serve")  # before loading a model for nothing
    require("uvicorn", "serve", "kvrag serve")
    from kvrag.serve import create_app, serve

    if args.threads is not None and args.threads < 1:
        print(f"kvrag serve: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    factory = functools.partial(serving_engine, args.threads, model, store, chunk_prefix=chunk_prefix,
                                method=args.method, on_store_error=args.on_store_error,
                                max_batch_size=args.max_batch_size, speculative_tokens=args.speculative_tokens,
                                speculative_max_batch=args.speculative_max_batch,
                                pack_suffixes=args.pack_suffixes, conversation_cache_bytes=args.conversation_cache_bytes,
                                move_history=args.move_history, kv_dtype=args.kv_dtype, warm=args.warm_up,
                                quantize=quantize)
    keys = tuple(args.api_key) if args.api_key else keys_from_env()
    try:
        cfg = ServeConfig(model_id=args.model_id, max_queue=args.max_queue, default_max_tokens=args.default_max_tokens,
                          drain_timeout_s=args.drain_timeout, api_keys=keys, max_body_bytes=args.max_body_bytes,
                          max_messages=args.max_messages, max_texts=args.max_texts,
                          max_text_bytes=args.max_text_bytes, max_registered_bytes=args.max_registered_bytes,
                          max_store_bytes=args.max_store_bytes, docs=args.docs, server_header=args.server_header,
                          stall_timeout_s=args.stall_timeout, allowed_origins=tuple(args.allowed_origins or ()))
    except ConfigError as e:
        print(f"kvrag serve: {e}", file=sys.stderr)
        return 2
    if not keys and args.host not in LOOPBACK:
        print(f"kvrag serve: WARNING: serving on {args.host} without an API key: anyone who reaches this port can "
              "use the model and write to the store; set --api-key or $KVRAG_API_KEY (and TLS in front: "
              "docs/serve.md#deploying)", file=sys.stderr)
    if args.ray is not None:
        return _serve_on_ray(args, factory, cfg, store)
    engine = factory()
    if args.persist and index:
        from kvrag.cli_index import note_other_model

        note_other_model(args.persist, index, engine)
    app = create_app(engine, cfg, persist=args.persist, close_engine=True)
    print(f"kvrag serve: {app.state.kvrag.model_id} ({args.method}) on http://{args.host}:{args.port}/v1, "
          f"{app.state.kvrag.registered} chunks registered", file=sys.stderr)
    serve(app, args.host, args.port, drain_timeout_s=args.drain_timeout, log_level="debug" if args.verbose else "info")
    if _forward_in_flight(app):
        # a prepare that is one long forward cannot be interrupted, and a process that exits under it is aborted by
        # the C++ runtime: every request has been answered and the store's writes are atomic, so leave now
        print("kvrag serve: stopped with a forward in flight (not waited for)", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _forward_in_flight(app: object) -> bool:
    runner = getattr(getattr(getattr(getattr(app, "state", None), "kvrag", None), "engine", None), "runner", None)
    return runner is not None and bool(runner.stats().get("threads"))


def serving_engine(threads: int | None, model: str | None, store: str, *, warm: bool = False,
                   **config: Any) -> KVRAGEngine:
    """The server's engine: the forwards on the runner thread with ``threads`` torch threads (None: torch's count),
    this thread on one. GNU OpenMP gives each thread that runs parallel work its own
    team; with more team threads than cores it stops spinning between parallel regions and each small operation of
    a decode step pays a wake-up (see ``EngineConfig.runner_threads``). ``warm``: one short answer first
    (:func:`kvrag.engine.warmup.warm_up`)."""
    import torch

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.engine.warmup import warm_up

    runner = threads if threads is not None else torch.get_num_threads()
    torch.set_num_threads(1)
    engine = KVRAGEngine.from_pretrained(model, store, runner_threads=runner, **config)
    if warm:
        warm_up(engine)
    return engine


def _serve_on_ray(args: argparse.Namespace, factory: Callable[[], KVRAGEngine], cfg: ServeConfig,
                  store: str) -> int:
    """``kvrag serve --ray``: deploy on Ray Serve, then wait for SIGINT/SIGTERM and remove the deployment."""
    import signal

    require("ray.serve", "ray-serve", "kvrag serve --ray")
    from kvrag.serve import ray_serve

    if store.startswith(("memory:", "file:")) or "://" not in store:
        print(f"note: the replicas do not share {store!r} across machines; use a Redis or Redis Cluster store "
              "(--store redis://... or redis+cluster://...) so that a chunk cached by one replica is a hit on all",
              file=sys.stderr)
    autoscaling = json.loads(args.autoscaling) if args.autoscaling else None
    url = ray_serve.run(factory, cfg, host=args.host, port=args.port,
                        address=None if args.ray.lower() in ("local", "none") else args.ray, persist=args.persist,
                        replicas=args.replicas, max_ongoing_requests=args.max_ongoing_requests,
                        autoscaling_config=autoscaling)
    print(f"kvrag serve on Ray Serve: {url}/v1 ({'autoscaling' if autoscaling else f'{args.replicas} replicas'})",
          file=sys.stderr)
    if url != f"http://{args.host}:{args.port}":
        print(f"note: Ray Serve's proxy was already running on {url}: --host {args.host} --port {args.port} were "
              "ignored (run `serve shutdown` to start it on another address)", file=sys.stderr)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # after Ray started: its processes keep the default handling
    signal.sigwait(stop)
    ray_serve.shutdown()
    return 0


__all__ = ["add_arguments", "run", "serving_engine"]
