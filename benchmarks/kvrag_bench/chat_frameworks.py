"""``kvrag bench chat --frameworks``: the same conversation through the frameworks' stock chat engines.

* ``llamaindex``: LlamaIndex's ``ContextChatEngine`` (the ``context`` chat mode) with ``KVCachedLLM`` and
  ``KVCachePostprocessor``, a ``ChatMemoryBuffer`` large enough to keep the whole conversation, and a retriever that
  returns the same passages in the same order every turn (fixed chunks).
* ``langchain``: an LCEL chain (system message with the passages, ``MessagesPlaceholder`` history, the question) |
  ``ChatKVCached`` with the passages as its chunks, wrapped in ``RunnableWithMessageHistory``.

``llamaindex-changing`` / ``langchain-changing``: the same chains over passages that change every turn (the
``changing`` scenario's of ``kvrag bench chat``: each turn the next dev row's): LlamaIndex's
``CondensePlusContextChatEngine`` (``condense_plus_context`` mode, ``skip_condense=True``: the message retrieves as
it is, so each turn's one LLM call is the answer) over a retriever returning the turn's passages, and the LangChain
chain with the turn's passages as its chunks.

Each framework runs two chat sessions side by side, taking turns per question: one over the reusing engine, one
over the recomputing engine (``conversation_cache_bytes=0``); each keeps its own history, as a deployed chat would.
"""

from __future__ import annotations

import warnings
from typing import Any

SYSTEM = "Answer the user's questions from these passages. Be brief."


def _llamaindex(eng: Any, chunks_of: Any, gen: Any, changing: bool = False) -> Any:
    from llama_index.core.chat_engine import CondensePlusContextChatEngine, ContextChatEngine
    from llama_index.core.memory import ChatMemoryBuffer
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from llama_index.llms.kvrag import KVCachedLLM
    from llama_index.postprocessor.kvrag import KVCachePostprocessor

    turn = [0]

    class Turns(BaseRetriever):
        """The turn's passages (the same every turn for fixed chunks)."""

        def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
            return [NodeWithScore(node=TextNode(text=c.strip()), score=1.0) for c in chunks_of(turn[0])]

    llm = KVCachedLLM(engine=eng, max_new_tokens=gen.max_new_tokens)
    common = {"retriever": Turns(), "llm": llm, "system_prompt": SYSTEM,
              "node_postprocessors": [KVCachePostprocessor(engine=eng)],
              "memory": ChatMemoryBuffer.from_defaults(token_limit=100_000)}
    chat = (CondensePlusContextChatEngine.from_defaults(**common, skip_condense=True) if changing
            else ContextChatEngine.from_defaults(**common))

    def ask(q: str) -> tuple[str, dict[str, Any]]:
        text = str(chat.chat(q))
        turn[0] += 1
        return text, dict(llm.last_info["additional_kwargs"])

    return ask


def _langchain(eng: Any, chunks_of: Any, gen: Any, changing: bool = False) -> Any:
    from langchain_core.chat_history import InMemoryChatMessageHistory
    from langchain_core.prompts import ChatPromptTemplate, MessagesPlaceholder
    from langchain_core.runnables.history import RunnableWithMessageHistory
    from langchain_kvrag import ChatKVCached

    prompt = ChatPromptTemplate.from_messages([("system", "{system}"), MessagesPlaceholder("history"),
                                               ("human", "{question}")])
    model = ChatKVCached(engine=eng, max_new_tokens=gen.max_new_tokens)
    history = InMemoryChatMessageHistory()
    turn = [0]

    def ask(q: str) -> tuple[str, dict[str, Any]]:
        chunks = chunks_of(turn[0])
        chain = RunnableWithMessageHistory(prompt | model.bind(chunks=chunks), lambda _sid: history,
                                           input_messages_key="question", history_messages_key="history")
        msg = chain.invoke({"system": SYSTEM + "\n" + "".join(chunks), "question": q},
                           config={"configurable": {"session_id": "bench"}})
        turn[0] += 1
        return str(msg.content), dict(msg.response_metadata["kvrag"])

    return ask


FRAMEWORKS = ("llamaindex", "langchain", "llamaindex-changing", "langchain-changing")


def run(framework: str, reuse: Any, recompute: Any, chunks_of: Any, questions: list[str],
        gen: Any) -> dict[str, Any]:
    """TTFT per turn of the framework's chat session over each engine, tokens reused, same answer text.
    ``chunks_of(k)``: turn ``k``'s passages."""
    name, _, variant = framework.partition("-")
    build = {"llamaindex": _llamaindex, "langchain": _langchain}.get(name)
    if build is None or variant not in ("", "changing"):
        raise SystemExit(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
    changing = variant == "changing"
    for k in range(len(questions)):
        reuse.ingest(chunks_of(k), progress=False)
    with warnings.catch_warnings():  # LangChain marks RunnableWithMessageHistory deprecated (LangGraph's persistence)
        warnings.simplefilter("ignore", DeprecationWarning)
        for eng in (reuse, recompute):  # untimed: the framework's first call pays one-time setup
            build(eng, chunks_of, gen, changing)(questions[0])
        reuse.conversations.clear()
        sessions = {"reuse": build(reuse, chunks_of, gen, changing),
                    "recompute": build(recompute, chunks_of, gen, changing)}
    rows = []
    for k, q in enumerate(questions):
        order = list(sessions.items()) if k % 2 == 0 else list(sessions.items())[::-1]
        got = {name: ask(q) for name, ask in order}
        (rt, ri), (ft, fi) = got["reuse"], got["recompute"]
        rows.append({"turn": k + 1, "prompt_tokens": ri.get("prompt_tokens"),
                     "reused_conversation": ri.get("conversation_tokens", 0),
                     "prefilled": None, "ttft_reuse_s": ri["ttft_s"], "ttft_recompute_s": fi["ttft_s"],
                     "same_answer": rt == ft, "answer": rt, "recompute_answer": ft if rt != ft else None})
        print(f"  turn {k + 1}: {ri.get('conversation_tokens', 0)} reused from the conversation; TTFT "
              f"{ri['ttft_s']:.3f} s (recompute {fi['ttft_s']:.3f} s); same answer: {rt == ft}", flush=True)
    first, last = rows[0], rows[-1]
    return {"rows": rows, "summary": {
        "turns": len(rows), "ttft_ratio_last_first_reuse": last["ttft_reuse_s"] / first["ttft_reuse_s"],
        "ttft_ratio_last_first_recompute": last["ttft_recompute_s"] / first["ttft_recompute_s"],
        "same_answers": sum(r["same_answer"] for r in rows),
        "same_answers_after_first": sum(r["same_answer"] for r in rows[1:]),
        "reused_tokens": sum(r["reused_conversation"] for r in rows)}}


__all__ = ["FRAMEWORKS", "run"]
