"""The RAG prompt template shared by the CLI, the demo and the benchmark.

The prompt is: chat template( system header, [one-shot turns], user: instruction + passages + question )
+ generation prompt [+ answer prefix]. Passages are rendered by :func:`render_passage` exactly once, so the same
passage text (and thus the same cache) is found in every prompt that retrieves it. Everything before the first
passage (system header, one-shot example, instruction) is a fixed, cacheable preamble.

:data:`TEMPLATES` holds the candidate templates the benchmark compares (``kvrag bench templates``);
:data:`DEFAULT_TEMPLATE` names the one chosen by full-prefill F1 on the dev data (see that constant).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from kvrag.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_INSTRUCTION = (
    "Answer the question using the documents below. Reply with a short answer of a few words, not a sentence."
)
DEFAULT_QUESTION = "\n\nQuestion: {question}\nShort answer:"

ANSWER_EXTRACTIONS = ("line", "raw", "short")
"""How a template's answer is read from the generated text: ``line`` = first non-empty line without an
"Answer:"-style lead-in (:func:`kvrag_bench.metrics.extract_answer`), ``raw`` = the whole text, stripped,
``short`` = ``line``, then a leading yes/no alone, else the first sentence (see :mod:`kvrag_bench.extract`)."""


ROLE_ALIASES = {"human": "user", "ai": "assistant", "model": "assistant", "chatbot": "assistant",
                "developer": "system"}
"""Framework role names mapped to the chat-template roles (system / user / assistant)."""


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> str:
    """Render chat messages to the prompt string the model sees: the one chat-template renderer of kvrag.

    The engine, the framework adapters, :class:`RagTemplate` and the CacheRepair leads all render through this
    function, so a prompt (and therefore its cached preamble) is the same string whoever builds it.

    Args:
        tokenizer: a Hugging Face tokenizer; its ``chat_template`` is used when it has one.
        messages: ``{"role", "content"}`` dicts; roles in :data:`ROLE_ALIASES` are mapped first.
        add_generation_prompt: end with the assistant turn's opening.

    Without a chat template (base models) the fallback is plain text: the BOS token, then one ``role: content``
    line per message, then ``assistant: `` when ``add_generation_prompt``.
    """
    msgs = [{"role": ROLE_ALIASES.get(m["role"], m["role"]), "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt))
    lines = [f"{m['role']}: {m['content']}" for m in msgs] + (["assistant: "] if add_generation_prompt else [])
    return (getattr(tokenizer, "bos_token", None) or "") + "\n".join(lines)


def chat_preamble(tokenizer: PreTrainedTokenizerBase) -> str:
    """The fixed text :func:`render_chat` puts before a user message's content (the chat template's system header).

    This is what chunk caches are conditioned on with ``chunk_prefix='template'`` (the engine and the CacheRepair
    data pipeline share it, so a repairer is trained on caches computed exactly like the engine's).
    """
    marker = "\u2063KVRAG_MARK\u2063"
    return render_chat(tokenizer, [{"role": "user", "content": marker}], add_generation_prompt=False).split(marker, 1)[0]


PASSAGE_SEPARATOR = "\n\n"


def render_passage(text: str, title: str | None = None) -> str:
    """The exact text a passage contributes to a prompt (and the text its cache is computed for).

    The blank line that separates passages comes *first* (``"\n\nTitle: ...\n<body>"``) and the body ends in a
    non-space character. With byte-level BPE tokenizers (GPT-2-style pre-tokenization, e.g. SmolLM2, Llama 3,
    Qwen) a piece that ends in a non-space character and a piece that starts with newlines split there anyway, so
    each passage tokenized alone gives exactly the ids the whole prompt string tokenizes to. A trailing
    ``"\n\n"`` does not: alone it is one token (``"\n\n"``), inside the prompt before a word it is two (``"\n"``,
    ``"\n"``), and the cached prompt would differ from what ``model.generate`` on the prompt text sees.
    """
    body = text.strip()
    head = f"Title: {title.strip()}\n" if title and title.strip() else ""
    return f"{PASSAGE_SEPARATOR}{head}{body}"


@dataclasses.dataclass(frozen=True)
class RagTemplate:
    """Instruction before the passages and the question line after them.

    Attributes:
        instruction: user-turn text before the first passage (part of the cached preamble).
        question: the line after the passages; ``{question}`` is replaced by the question.
        system: optional system message (None: the chat template's default).
        examples: (user, assistant) turns placed before the real user turn (a few-shot demonstration inside the
            cached preamble).
        answer_prefix: text appended after the generation prompt (the start of the assistant's reply).
        answer_extraction: one of :data:`ANSWER_EXTRACTIONS`.
        name: a label for reports.
    """

    instruction: str = DEFAULT_INSTRUCTION
    question: str = DEFAULT_QUESTION
    system: str | None = None
    examples: tuple[tuple[str, str], ...] = ()
    answer_prefix: str = ""
    answer_extraction: str = "line"
    name: str = "custom"

    def __post_init__(self) -> None:
        if "{question}" not in self.question:
            msg = f"the question line must contain '{{question}}', got {self.question!r}"
            raise ConfigError(msg)
        if self.answer_extraction not in ANSWER_EXTRACTIONS:
            msg = f"answer_extraction must be one of {ANSWER_EXTRACTIONS}, got {self.answer_extraction!r}"
            raise ConfigError(msg)

    def _messages(self, user: str) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in self.examples:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        return msgs + [{"role": "user", "content": user}]

    def parts(self, tokenizer: PreTrainedTokenizerBase, passages: Sequence[str], question: str) -> tuple[str, list[str], str]:
        """(prefix, passages, suffix) such that prefix + ''.join(passages) + suffix is the full prompt string."""
        marker = "\u2063KVRAG_BODY\u2063"
        user = self.instruction + marker + self.question.format(question=question.strip())
        full = render_chat(tokenizer, self._messages(user))
        prefix, suffix = full.split(marker, 1)
        return prefix, list(passages), suffix + self.answer_prefix

    def render(self, tokenizer: PreTrainedTokenizerBase, passages: Sequence[str], question: str) -> str:
        prefix, ps, suffix = self.parts(tokenizer, passages, question)
        return prefix + "".join(ps) + suffix


# ----------------------------------------------------------------------------------------------------------------
# Candidate templates (compared by full-prefill F1 with `kvrag bench templates`)
# ----------------------------------------------------------------------------------------------------------------

# A made-up two-hop example (fictional names, so it teaches the format, not facts).
_EXAMPLE_PASSAGES = (
    render_passage(
        "The Marlow Viaduct is a stone railway bridge over the river Brenn. It opened in 1874 and was designed by "
        "the engineer Edith Crane.",
        "Marlow Viaduct",
    )
    + render_passage(
        "Edith Crane (1841-1913) was a civil engineer born in Leeds. She built bridges and harbours in northern "
        "England and wrote a textbook on masonry arches.",
        "Edith Crane",
    )
)
_EXAMPLE_QUESTION = "In which city was the designer of the Marlow Viaduct born?"
_EXAMPLE_ANSWER = "Leeds"

_TERSE_INSTRUCTION = (
    "Answer the question using the documents below. Give only the answer: a name, date, number or short phrase "
    "copied from the documents, with no explanation."
)
_TERSE_QUESTION = "\n\nQuestion: {question}\nAnswer:"

TEMPLATES: dict[str, RagTemplate] = {
    # the original wording
    "basic": RagTemplate(name="basic"),
    # stricter wording, "Answer:" cue
    "terse": RagTemplate(_TERSE_INSTRUCTION, _TERSE_QUESTION, name="terse"),
    # one-shot example inside the user turn, before the real documents
    "oneshot-inline": RagTemplate(
        _TERSE_INSTRUCTION
        + "\n\nExample:"
        + _EXAMPLE_PASSAGES
        + _TERSE_QUESTION.format(question=_EXAMPLE_QUESTION)
        + f" {_EXAMPLE_ANSWER}\n\nNow answer the real question.",
        _TERSE_QUESTION,
        name="oneshot-inline",
    ),
    # one-shot example as a previous chat turn: the assistant's reply shows the expected length
    "oneshot-chat": RagTemplate(
        _TERSE_INSTRUCTION,
        _TERSE_QUESTION,
        examples=((_TERSE_INSTRUCTION + _EXAMPLE_PASSAGES + _TERSE_QUESTION.format(question=_EXAMPLE_QUESTION),
                   _EXAMPLE_ANSWER),),
        name="oneshot-chat",
    ),
    # the assistant's reply is started for the model ("The answer is:"), which small models follow with a span
    "answer-is": RagTemplate(DEFAULT_INSTRUCTION, "\n\nQuestion: {question}", answer_prefix="The answer is:",
                             name="answer-is"),
    "terse-answer-is": RagTemplate(_TERSE_INSTRUCTION, "\n\nQuestion: {question}", answer_prefix="The answer is:",
                                   name="terse-answer-is"),
    # one-shot chat turn whose reply has the same lead-in the real reply is started with
    "oneshot-chat-answer-is": RagTemplate(
        _TERSE_INSTRUCTION,
        "\n\nQuestion: {question}",
        examples=((_TERSE_INSTRUCTION + _EXAMPLE_PASSAGES + f"\n\nQuestion: {_EXAMPLE_QUESTION}",
                   f"The answer is: {_EXAMPLE_ANSWER}"),),
        answer_prefix="The answer is:",
        answer_extraction="short",
        name="oneshot-chat-answer-is",
    ),
}

DEFAULT_TEMPLATE = "oneshot-chat-answer-is"
"""Name of the template the benchmark uses by default, chosen with ``kvrag bench templates`` on qa_dev rows 0-59
(SmolLM2-135M-Instruct, full prefill, greedy, 32 new tokens): F1 0.105 [0.044, 0.184] with the ``short``
extraction, vs 0.085 for ``oneshot-chat/short`` and 0.046 for ``basic/line`` (the original template); paired
difference vs ``basic/line`` +0.059 [-0.002, +0.125]. Small models answer in sentences; the one-shot chat turn plus
the started reply ("The answer is:") halves the answer length (14.8 vs 22-26 tokens). (Measured when passages
carried their blank line at the end; the prompt strings are unchanged since, only the split points moved.)"""


def get_template(name: str | RagTemplate | None = None) -> RagTemplate:
    """A template by name (None: :data:`DEFAULT_TEMPLATE`); a RagTemplate is returned unchanged."""
    if isinstance(name, RagTemplate):
        return name
    key = DEFAULT_TEMPLATE if name in (None, "", "default") else str(name)
    try:
        return TEMPLATES[key]
    except KeyError as e:
        msg = f"unknown prompt template {key!r}; valid templates: {', '.join(sorted(TEMPLATES))}"
        raise ConfigError(msg) from e
