"""The QA benchmark's data: one JSONL row per request, each context passage one reusable chunk."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from kvrag.errors import ConfigError
from kvrag.prompting import render_passage
from kvrag_bench.metrics import normalize_answer


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
    with p.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:  # utf-8-sig: a BOM at the start of the file (Windows editors) is dropped
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                msg = (f"{p}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start}); save the QA file as UTF-8 JSONL "
                       "(decompress a .gz file first)")
                raise ConfigError(msg) from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"a row must be one JSON object, got a JSON {type(row).__name__}")
                missing = [k for k in ("id", "question", "answers", "contexts") if k not in row]
                if missing:
                    raise ValueError(f"missing key(s) {missing}")
                if not isinstance(row["id"], str | int) or isinstance(row["id"], bool) or not str(row["id"]).strip():
                    raise ValueError(f"'id' must be a non-empty string or an integer, got {row['id']!r}")
                rid = str(row["id"])
                if not isinstance(row["question"], str):
                    raise ValueError(f"'question' must be a string, got {row['question']!r:.60}")
                q = row["question"]
                if not q.strip():
                    raise ValueError("'question' is empty")
                answers = row["answers"]
                ctx = row["contexts"]
                if isinstance(answers, str) or not answers or not all(isinstance(a, str) for a in answers):
                    raise ValueError("'answers' must be a non-empty list of strings")
                empty = [a for a in answers if not normalize_answer(a)]
                if empty:  # SQuAD scoring would count an empty prediction as a correct answer to it
                    raise ValueError(f"gold answer(s) {empty} are empty after SQuAD normalization")
                if not isinstance(ctx, list) or not ctx:
                    raise ValueError("'contexts' must be a non-empty list of {title, text} objects")
                for i, c in enumerate(ctx):
                    if not isinstance(c, dict) or not isinstance(c.get("text"), str):
                        raise ValueError(f"contexts[{i}] must be an object with a string 'text', got {c!r:.60}")
                    if not c["text"].strip():  # spliced as a chunk of no tokens: no cache, no place in the prompt
                        raise ValueError(f"contexts[{i}] has an empty 'text'; drop it from the row")
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
