"""LlamaIndex quickstart: a stock query engine over the sample documents, answered with reused KV caches.

    python examples/llamaindex_quickstart.py [--method stale] [--persist DIR] [--question "..."]

The first run splits ``examples/data``, computes every chunk's KV cache once (KVCacheTransform) and persists the
FAISS index and the caches together; later runs reload both and recompute nothing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never reach the Hugging Face Hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = [
    "How much does a day pass cost?",
    "How often does tram line T2 run at peak times?",
    "Which ferry route carries cars?",
]


def default_persist_dir() -> Path:
    from kvrag.paths import kvrag_home

    return Path(os.environ.get("KVRAG_EXAMPLE_DIR") or kvrag_home() / "examples") / "llamaindex"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="stale", help="fusion method: full, stale, relaxkv, ...")
    ap.add_argument("--persist", type=Path, default=None, help="index + cache directory")
    ap.add_argument("--question", action="append", help="question(s) to ask (default: three sample questions)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    persist = args.persist or default_persist_dir()

    from llama_index.core import SimpleDirectoryReader
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.llms.kvrag import KVCachedLLM
    from llama_index.postprocessor.kvrag import KVCachePostprocessor, build_index, load_index, open_engine

    from kvrag.default_model import default_embedder_path

    engine = open_engine(persist)  # the default model + a file store in PERSIST/kvcache
    embed_model = HuggingFaceEmbedding(model_name=str(default_embedder_path()))
    if (persist / "docstore.json").exists():
        index = load_index(persist, embed_model=embed_model)
        print(f"reloaded the index and its caches from {persist}")
    else:
        docs = SimpleDirectoryReader(str(DATA), file_metadata=lambda p: {"source": Path(p).name}).load_data()
        index = build_index(docs, engine=engine, embed_model=embed_model, persist_dir=persist, show_progress=True,
                            transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0)])
        print(f"built the index and cached {len(index.docstore.docs)} chunks in {persist}")

    llm = KVCachedLLM(engine=engine, method=args.method, max_new_tokens=args.max_new_tokens)
    query_engine = index.as_query_engine(
        llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)], similarity_top_k=args.top_k
    )
    for q in args.question or QUESTIONS:
        answer = query_engine.query(q)
        info = llm.last_info["additional_kwargs"]
        print(f"\nQ: {q}\nA: {str(answer).strip()}")
        print(f"   method={info['method']}  ttft={info['ttft_s'] * 1000:.0f} ms  hit_rate={info['hit_rate']:.2f}  "
              f"chunks={info['chunk_hits']}/{info['chunks_registered']}")

    # streaming works the same way
    streaming = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine=engine)],
                                      similarity_top_k=args.top_k, streaming=True)
    print("\nQ (streamed): When does the last boat leave Tamsin Isle?\nA: ", end="", flush=True)
    for delta in streaming.query("When does the last boat leave Tamsin Isle?").response_gen:
        print(delta, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
