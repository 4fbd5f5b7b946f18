"""LangChain quickstart: the standard LCEL RAG chain over the sample documents, with reused KV caches.

    python examples/langchain_quickstart.py [--method stale] [--persist DIR] [--question "..."]

The chain is the usual ``{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm |
StrOutputParser()``; only the retriever wrapper (KVCacheRetriever) and the chat model (ChatKVCached) are kvrag's.
Chunk caches are kept in a file store, so a second run reuses them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATA = Path(__file__).resolve().parent / "data"
QUESTIONS = [
    "How much does a day pass cost?",
    "How often does tram line T2 run at peak times?",
    "Which ferry route carries cars?",
]


def default_persist_dir() -> Path:
    from kvrag.paths import kvrag_home

    return Path(os.environ.get("KVRAG_EXAMPLE_DIR") or kvrag_home() / "examples") / "langchain"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", default="stale", help="fusion method: full, stale, relaxkv, ...")
    ap.add_argument("--persist", type=Path, default=None, help="chunk-cache directory")
    ap.add_argument("--question", action="append", help="question(s) to ask (default: three sample questions)")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    persist = args.persist or default_persist_dir()

    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_huggingface import HuggingFaceEmbeddings
    from langchain_kvrag import ChatKVCached, KVCacheRetriever, format_docs
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    from kvrag import KVRAGEngine
    from kvrag.default_model import default_embedder_path

    engine = KVRAGEngine.from_pretrained(None, store=f"file://{(persist / 'kvcache').absolute()}")
    embeddings = HuggingFaceEmbeddings(model_name=str(default_embedder_path()))
    docs = [Document(page_content=p.read_text(encoding="utf-8"), metadata={"source": p.name})
            for p in sorted(DATA.glob("*.md"))]
    splits = RecursiveCharacterTextSplitter(chunk_size=1000, chunk_overlap=0).split_documents(docs)
    vectorstore = InMemoryVectorStore.from_documents(splits, embeddings)

    retriever = KVCacheRetriever(retriever=vectorstore.as_retriever(search_kwargs={"k": args.top_k}), engine=engine)
    llm = ChatKVCached(engine=engine, method=args.method, max_tokens=args.max_new_tokens)
    prompt = ChatPromptTemplate.from_template(
        "Answer the question using only this context:\n\n{context}\n\nQuestion: {question}"
    )
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()

    for q in args.question or QUESTIONS:
        answer = chain.invoke(q)
        kv = llm.history[-1]["response_metadata"]["kvrag"]
        print(f"\nQ: {q}\nA: {answer.strip()}")
        print(f"   method={kv['method']}  ttft={kv['ttft_s'] * 1000:.0f} ms  hit_rate={kv['hit_rate']:.2f}  "
              f"chunks={kv['chunk_hits']}/{kv['chunks_registered']}")

    print("\nQ (streamed): When does the last boat leave Tamsin Isle?\nA: ", end="", flush=True)
    for delta in chain.stream("When does the last boat leave Tamsin Isle?"):
        print(delta, end="", flush=True)
    print()
    print("\nbatch:", chain.batch(["What is the Lakecard?", "Who is the general manager of MRT?"]))


if __name__ == "__main__":
    main()
