"""The RAG prompt template shared by the CLI, the demo and the benchmark.

The prompt is: chat template( system header, user: instruction + passages + question ) + generation prompt.
Passages are rendered by :func:`render_passage` exactly once, so the same passage text (and thus the same cache)
is found in every prompt that retrieves it. Everything before the first passage is a fixed, cacheable preamble.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

DEFAULT_INSTRUCTION = (
    "Answer the question using the documents below. Reply with a short answer of a few words, not a sentence.\n\n"
)
DEFAULT_QUESTION = "Question: {question}\nShort answer:"


def render_passage(text: str, title: str | None = None) -> str:
    """The exact text a passage contributes to a prompt (and the text its cache is computed for)."""
    body = text.strip()
    head = f"Title: {title.strip()}\n" if title and title.strip() else ""
    return f"{head}{body}\n\n"


@dataclasses.dataclass(frozen=True)
class RagTemplate:
    """Instruction before the passages and the question line after them."""

    instruction: str = DEFAULT_INSTRUCTION
    question: str = DEFAULT_QUESTION
    system: str | None = None

    def parts(self, tokenizer: Any, passages: Sequence[str], question: str) -> tuple[str, list[str], str]:
        """(prefix, passages, suffix) such that prefix + ''.join(passages) + suffix is the full prompt string."""
        marker = "\u2063KVRAG_BODY\u2063"
        user = self.instruction + marker + self.question.format(question=question.strip())
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + [{"role": "user", "content": user}]
        if getattr(tokenizer, "chat_template", None):
            full = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            full = (self.system + "\n\n" if self.system else "") + user + "\n"
        prefix, suffix = full.split(marker, 1)
        return prefix, list(passages), suffix

    def render(self, tokenizer: Any, passages: Sequence[str], question: str) -> str:
        prefix, ps, suffix = self.parts(tokenizer, passages, question)
        return prefix + "".join(ps) + suffix
