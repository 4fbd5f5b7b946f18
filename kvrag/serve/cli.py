"""``kvrag serve``'s command line: its options and what it runs (the core CLI, :mod:`kvrag.cli`, mounts it)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Any

from kvrag.config import DEFAULT_METHOD
from kvrag.extras import require


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvrag serve``."""
    parser.add_argument("--persist", default=None, help="index directory of `kvrag ingest`: its chunks are registered "
                                                            "and its manifest names the store and model")
    parser.add_argument("--store", default=None, help="store URL (default: the index's store, else memory://)")
    parser.add_argument("--model", default=None, help="model name or path (default: the index's, else the embedded one)")
    parser.add_argument("--model-id", default=None, help="the model name clients send (default: the model's name)")
    parser.add_argument("--method", default=DEFAULT_METHOD,
                        help=f"default fusion method spec (default {DEFAULT_METHOD}; e.g. stale, auto:budget=0.3)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-queue", type=int, default=64,
                        help="most requests held at once (decoding or waiting); more get 429 with Retry-After")
    parser.add_argument("--max-batch-size", type=int, default=8, help="most requests decoded together")
    parser.add_argument("--speculative-tokens", type=int, default=3,
                        help="tokens drafted from the prompt per greedy request and step (0: off; answers are the same)")
    parser.add_argument("--pack-suffixes", action="store_true",
                        help="prefill the question suffixes of requests arriving together in one forward: a burst's "
                             "first tokens come together (TTFT p99 down, p50 up; answers are the same)")
    parser.add_argument("--compile-decode", action="store_true",
                        help="run plain decode steps compiled (torch.compile, the same bits), compiled on a helper "
                             "thread while steps run eagerly; minutes the first time on a machine, then cached")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the engine's runner, which runs every forward (default: torch's, the "
                             "machine's cores); the server's other threads run torch work on one thread")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="chat completions without max_tokens generate at most this many tokens")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="on shutdown, seconds to let requests in flight finish")
    parser.add_argument("--on-store-error", choices=["recompute", "raise"], default="recompute",
                        help="when the KV store fails: recompute caches (responses carry a Warning header), or fail")
    parser.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                        help="deploy on Ray Serve (pip install 'kvrag[ray-serve]'): ADDRESS of a running cluster, or none "
                             "to start a local Ray")
    parser.add_argument("--replicas", type=int, default=2, help="with --ray: replicas (each loads the model once)")
    parser.add_argument("--max-ongoing-requests", type=int, default=None,
                        help="with --ray: Ray Serve's max_ongoing_requests per replica")
    parser.add_argument("--autoscaling", default=None, metavar="JSON",
                        help="with --ray: Ray Serve's autoscaling_config as JSON (instead of --replicas), e.g. "
                             '\'{"min_replicas": 1, "max_replicas": 4}\'')


def run(args: argparse.Namespace, model: str | None, store: str, chunk_prefix: str) -> int:
    """Serve until SIGINT/SIGTERM (``model`` / ``store`` / ``chunk_prefix`` resolved by the caller from the options
    and the ``--persist`` manifest)."""
    require("fastapi", "serve", "kvrag serve")  # before loading a model for nothing
    require("uvicorn", "serve", "kvrag serve")
    from kvrag.serve import ServeConfig, create_app, serve

    if args.threads is not None and args.threads < 1:
        print(f"kvrag serve: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    factory = functools.partial(serving_engine, args.threads, model, store, chunk_prefix=chunk_prefix,
                                method=args.method, on_store_error=args.on_store_error,
                                max_batch_size=args.max_batch_size, speculative_tokens=args.speculative_tokens,
                                pack_suffixes=args.pack_suffixes, compile_decode=args.compile_decode)
    cfg = ServeConfig(model_id=args.model_id, max_queue=args.max_queue, default_max_tokens=args.default_max_tokens,
                      drain_timeout_s=args.drain_timeout)
    if args.ray is not None:
        return _serve_on_ray(args, factory, cfg, store)
    app = create_app(factory(), cfg, persist=args.persist, close_engine=True)
    print(f"kvrag serve: {app.state.kvrag.model_id} ({args.method}) on http://{args.host}:{args.port}/v1, "
          f"{len(app.state.kvrag.chunks)} chunks registered", file=sys.stderr)
    serve(app, args.host, args.port, drain_timeout_s=args.drain_timeout, log_level="debug" if args.verbose else "info")
    return 0


def serving_engine(threads: int | None, model: str | None, store: str, **config: Any) -> Any:
    """The server's engine: the forwards on the runner thread with ``threads`` torch threads (None: torch's count),
    this thread on one. GNU OpenMP gives each thread that runs parallel work its own
    team; with more team threads than cores it stops spinning between parallel regions and each small operation of
    a decode step pays a wake-up (see ``EngineConfig.runner_threads``)."""
    import torch

    from kvrag.engine.engine import KVRAGEngine

    runner = threads if threads is not None else torch.get_num_threads()
    torch.set_num_threads(1)
    return KVRAGEngine.from_pretrained(model, store, runner_threads=runner, **config)


def _serve_on_ray(args: argparse.Namespace, factory: Any, cfg: Any, store: str) -> int:
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
                        address=None if args.ray == "local" else args.ray, persist=args.persist,
                        replicas=args.replicas, max_ongoing_requests=args.max_ongoing_requests,
                        autoscaling_config=autoscaling)
    print(f"kvrag serve on Ray Serve: {url}/v1 ({'autoscaling' if autoscaling else f'{args.replicas} replicas'})",
          file=sys.stderr)
    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # after Ray started: its processes keep the default handling
    signal.sigwait(stop)
    ray_serve.shutdown()
    return 0


__all__ = ["add_arguments", "run", "serving_engine"]
