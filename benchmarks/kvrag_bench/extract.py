"""How an answer is read from generated text, by a template's ``answer_extraction`` mode."""

from __future__ import annotations

import re
from collections.abc import Callable

from kvrag_bench.metrics import extract_answer

_YES_NO = re.compile(r"^(yes|no)\b", re.IGNORECASE)
# a sentence end: ., ! or ? after 3 lower-case letters/digits (so "Dr. X", "St. Cloud", "U.S. Army" do not split)
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\"']{3}[.!?])\s+(?=[A-Z\"'(])")


def extract_short(text: str) -> str:
    """``extract_answer``'s first line, then: a leading "Yes"/"No" alone, else only the first sentence.

    Small models answer "No, the film ... was released later." or "X is Y. It was ..."; SQuAD F1 rewards the
    span, so keep the part that can be the answer without guessing inside a sentence.
    """
    line = extract_answer(text)
    m = _YES_NO.match(line)
    if m:
        return m.group(1).lower()
    first = _SENTENCE_END.split(line, maxsplit=1)[0]
    return first.rstrip(".!? ").strip() or line


EXTRACTORS: dict[str, Callable[[str], str]] = {
    "line": extract_answer,
    "raw": lambda t: t.strip(),
    "short": extract_short,
}
"""Answer extraction by a template's ``answer_extraction`` mode (:data:`kvrag.prompting.ANSWER_EXTRACTIONS`)."""


__all__ = ["EXTRACTORS", "extract_short"]
