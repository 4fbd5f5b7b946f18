"""The QA benchmark's data: one JSONL row per request, each context passage one reusable chunk."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from kvrag.errors import ConfigError
from kvrag.prompting import render_passage


@dataclasses.dataclass(frozen=True)
class QARequest:
    """One benchmark request; ``contexts`` are (title, text) pairs, each a reusable chunk."""

    id: str
    question: str
    answers: tuple[str, ...]
    contexts: tuple[tuple[str, str], ...]
    source: str = ""

    def passages(self) -> list[str]:
        """The rendered chunk texts, in order (exactly the strings the prompt contains)."""
        return [render_passage(text, title) for title, text in self.contexts]


def load_requests(path: str | os.PathLike[str], limit: int | None = None, offset: int = 0) -> list[QARequest]:
    """Read and validate a QA JSONL file; rows ``offset .. offset+limit-1`` (file order).

    Raises:
        ConfigError: missing file, bad JSON or a row that does not follow the schema (the message names the line).
    """
    p = Path(path)
    if not p.is_file():
        msg = f"QA data file {str(p)!r} not found; expected a JSONL file with id/question/answers/contexts rows"
        raise ConfigError(msg)
    out: list[QARequest] = []
    seen: set[str] = set()
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rid = str(row["id"])
                q = str(row["question"])
                answers = row["answers"]
                ctx = row["contexts"]
                if isinstance(answers, str) or not answers or not all(isinstance(a, str) for a in answers):
                    raise ValueError("'answers' must be a non-empty list of strings")
                if not isinstance(ctx, list) or not ctx:
                    raise ValueError("'contexts' must be a non-empty list of {title, text} objects")
                contexts = tuple((str(c.get("title") or ""), str(c["text"])) for c in ctx)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                msg = (f"{p}:{lineno}: bad QA row ({e}); expected "
                       '{"id", "question", "answers": [..], "contexts": [{"title", "text"}, ..]}')
                raise ConfigError(msg) from e
            if rid in seen:
                msg = f"{p}:{lineno}: duplicate request id {rid!r}"
                raise ConfigError(msg)
            seen.add(rid)
            out.append(QARequest(rid, q, tuple(answers), contexts, str(row.get("source", ""))))
    if offset < 0 or (limit is not None and limit < 0):
        msg = f"offset and limit must be >= 0, got offset={offset}, limit={limit}"
        raise ConfigError(msg)
    out = out[offset:]
    return out[:limit] if limit is not None else out


__all__ = ["QARequest", "load_requests"]
