"""Exact leads: the text real RAG prompts put before their first retrieved chunk (CacheRepair v2 training data).

At serving time everything before the first chunk (system turn, instructions, a one-shot example, a framework's
"Context information is below." header) is an exact prefix: the engine prefills it from scratch, so its KV is the
joint KV. The first chunk's cache, however, was computed after the short chat header only, so it is as stale as any
later chunk. A repairer learns to fix it only if training pairs put such a lead before chunk 1 and let the repairer
read it (as chunk 0, never repaired). This module renders those leads from the prompts kvrag actually serves:

* ``bench:<name>``: every benchmark template of :data:`kvrag.prompting.TEMPLATES`;
* ``llamaindex-text-qa`` / ``llamaindex-tree-summarize`` / ``llamaindex-refine`` /
  ``llamaindex-condense-plus-context``: LlamaIndex's default chat prompts (llama-index-core 0.14, copied verbatim so
  the core does not import LlamaIndex);
* ``langchain-rag``: the usual LangChain RAG chat prompt (a system message ending in "Context:", the question as
  the human turn);
* ``bare``: the chat header alone (a chunk right at the start of the user turn).

Each lead is rendered through the tokenizer's chat template. Leads that contain a question or an earlier answer
take them from the training group (a question about its first title), so the lead text varies like real prompts do.

Each lead kind also fixes how its prompt family renders the chunks that follow (:func:`chunk_style`): the bench's
``"\n\nTitle: ..."`` passages back to back; LlamaIndex's nodes (``node.get_content(MetadataMode.LLM)``: the
``title: ...`` metadata line, a blank line, the text) joined by a blank line; LangChain's ``page_content`` joined by a
blank line (``format_docs``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvrag.errors import ConfigError
from kvrag.prompting import TEMPLATES, render_chat
from kvrag.repair.documents import DEFAULT_CHUNK_FORMAT

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kvrag.repair.records import DocumentGroup

_MARK = "\u2063KVRAG_LEAD\u2063"

_LI_QA_SYSTEM = (
    "You are an expert Q&A system that is trusted around the world.\n"
    "Always answer the query using the provided context information, and not prior knowledge.\n"
    "Some rules to follow:\n"
    "1. Never directly reference the given context in your answer.\n"
    "2. Avoid statements like 'Based on the context, ...' or 'The context information ...' or anything along "
    "those lines."
)
_LI_REFINE_USER = (
    "You are an expert Q&A system that strictly operates in two modes when refining existing answers:\n"
    "1. **Rewrite** an original answer using the new context.\n"
    "2. **Repeat** the original answer if the new context isn't useful.\n"
    "Never reference the original answer or context directly in your answer.\n"
    "When in doubt, just repeat the original answer.\n"
    "New Context: "
)
_LI_CPC_SYSTEM = (
    "\n  The following is a friendly conversation between a user and an AI assistant.\n"
    "  The assistant is talkative and provides lots of specific details from its context.\n"
    "  If the assistant does not know the answer to a question, it truthfully says it\n"
    "  does not know.\n\n"
    "  Here are the relevant documents for the context:\n\n  "
)
_LC_RAG_SYSTEM = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, say that you don't know. Use three sentences maximum and keep the "
    "answer concise.\n\nContext:"
)

Messages = list[dict[str, str]]


def _li_text_qa(q: str) -> Messages:
    return [{"role": "system", "content": _LI_QA_SYSTEM},
            {"role": "user", "content": "Context information is below.\n---------------------\n" + _MARK}]


def _li_tree(q: str) -> Messages:
    return [{"role": "system", "content": _LI_QA_SYSTEM},
            {"role": "user", "content": "Context information from multiple sources is below.\n"
                                        "---------------------\n" + _MARK}]


def _li_refine(q: str) -> Messages:
    return [{"role": "user", "content": _LI_REFINE_USER + _MARK}]


def _li_condense_plus_context(q: str) -> Messages:
    return [{"role": "system", "content": _LI_CPC_SYSTEM + _MARK}]


def _lc_rag(q: str) -> Messages:
    return [{"role": "system", "content": _LC_RAG_SYSTEM + _MARK}]


def _bare(q: str) -> Messages:
    return [{"role": "user", "content": _MARK}]


_CHAT_LEADS: dict[str, Callable[[str], Messages]] = {
    "llamaindex-text-qa": _li_text_qa,
    "llamaindex-tree-summarize": _li_tree,
    "llamaindex-refine": _li_refine,
    "llamaindex-condense-plus-context": _li_condense_plus_context,
    "langchain-rag": _lc_rag,
    "bare": _bare,
}

LEAD_KINDS: tuple[str, ...] = (*(f"bench:{n}" for n in TEMPLATES), *_CHAT_LEADS)
"""Every lead kind :func:`render_lead` knows."""

DEFAULT_LEAD_KINDS: tuple[str, ...] = LEAD_KINDS


@dataclasses.dataclass(frozen=True)
class ChunkStyle:
    """How one prompt family renders its retrieved chunks.

    Attributes:
        fmt: ``str.format`` template of one chunk with ``{title}`` and ``{passage}``.
        separator: the text between two chunks (a span of its own, as the engine plans it).
    """

    fmt: str
    separator: str = ""


BENCH_STYLE = ChunkStyle(DEFAULT_CHUNK_FORMAT)
LLAMAINDEX_STYLE = ChunkStyle("title: {title}\n\n{passage}", "\n\n")
LANGCHAIN_STYLE = ChunkStyle("{passage}", "\n\n")


def chunk_style(kind: str) -> ChunkStyle:
    """The chunk rendering of a lead kind's prompt family ('' and 'bare': the bench's)."""
    if kind.startswith("llamaindex-"):
        return LLAMAINDEX_STYLE
    if kind.startswith("langchain-"):
        return LANGCHAIN_STYLE
    return BENCH_STYLE


def chunk_style_table(kinds: Sequence[str]) -> dict[str, dict[str, str]]:
    """{lead kind: {"format": ..., "separator": ...}} (recorded in a checkpoint's conditioning)."""
    return {k: {"format": chunk_style(k).fmt, "separator": chunk_style(k).separator} for k in kinds}


def style_identity() -> str:
    """Identifies the lead-kind -> chunk-style table (part of the pair-cache manifest)."""
    table = chunk_style_table(LEAD_KINDS)
    return "per-lead:" + "|".join(f"{k}={st['format']!r}+{st['separator']!r}" for k, st in table.items())


def render_lead(tokenizer: PreTrainedTokenizerBase, kind: str, question: str = "What is this about?") -> str:
    """The exact prompt text before the first chunk for one lead kind (rendered through the chat template)."""
    if kind.startswith("bench:"):
        name = kind.split(":", 1)[1]
        if name not in TEMPLATES:
            msg = f"unknown bench template {name!r} in lead kind {kind!r}; valid: {', '.join(TEMPLATES)}"
            raise ConfigError(msg)
        return TEMPLATES[name].parts(tokenizer, [], question)[0]
    fn = _CHAT_LEADS.get(kind)
    if fn is None:
        msg = f"unknown lead kind {kind!r}; valid kinds: {', '.join(LEAD_KINDS)}"
        raise ConfigError(msg)
    return render_chat(tokenizer, fn(question), add_generation_prompt=False).split(_MARK, 1)[0]


def pick_lead(kinds: Sequence[str], group_id: str) -> str:
    """The lead kind of one training group: a fixed pseudo-random choice by a hash of its id."""
    if not kinds:
        msg = "need at least one lead kind"
        raise ConfigError(msg)
    h = int.from_bytes(hashlib.sha256(("lead|" + group_id).encode()).digest()[:8], "big")
    return kinds[h % len(kinds)]


def group_question(group: DocumentGroup) -> str:
    """A question about a training group's first passage (leads that quote the question use it)."""
    titles = [t for t in group.get("titles") or [] if t and str(t).strip()]
    return f"What is known about {str(titles[0]).strip()}?" if titles else "What do these documents say?"


__all__ = ["BENCH_STYLE", "DEFAULT_LEAD_KINDS", "LANGCHAIN_STYLE", "LEAD_KINDS", "LLAMAINDEX_STYLE", "ChunkStyle",
           "chunk_style", "chunk_style_table", "group_question", "pick_lead", "render_lead", "style_identity"]
