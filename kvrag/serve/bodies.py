"""The response bodies of a completion: OpenAI's ``chat.completion`` / ``text_completion`` objects, their streamed
chunks (SSE events), usage, and kvrag's per-response summary."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from kvrag import adapters

if TYPE_CHECKING:
    from kvrag.config import GenerationConfig
    from kvrag.engine.results import Prepared

JSONObject = dict[str, object]
Kind = Literal["chat", "text"]


@dataclasses.dataclass
class Job:
    """One prepared completion request, from its prepare to its last byte."""

    kind: Kind
    model: str
    prep: Prepared
    gen: GenerationConfig
    include_usage: bool
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def prefix(self) -> str:
        return "chatcmpl-" if self.kind == "chat" else "cmpl-"


def usage(*jobs: Job) -> JSONObject:
    """OpenAI's ``usage`` of a response: its job's counts, summed over the jobs of a list of prompts."""
    prompt = generated = cached = 0
    for job in jobs:
        p, g = adapters.token_usage(job.prep)
        prompt, generated, cached = prompt + p, generated + (g or 0), cached + int(job.prep.stats.reused_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(job: Job) -> str:
    """``"stop"`` (EOS or a stop string, also at the last allowed token) or ``"length"`` (``max_tokens``)."""
    return adapters.finish_reason(job.prep, job.gen.max_new_tokens)


def _choice(job: Job, text: str, index: int = 0) -> JSONObject:
    """One answered choice of a non-streamed response."""
    if job.kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason(job)}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason(job)}


def full_body(job: Job, text: str) -> JSONObject:
    """The non-streamed response."""
    return {"id": job.prefix + job.id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": job.created, "model": job.model, "choices": [_choice(job, text)], "usage": usage(job),
            "kvrag": adapters.response_summary(job.prep)}


def batch_body(done: Sequence[tuple[Job, str]]) -> JSONObject:
    """One response for a ``/v1/completions`` list of prompts (``done``: each prompt's job and text, in order), as
    OpenAI answers one: the first job's id, one choice per prompt with its index, the usage summed, and each
    prompt's ``kvrag`` summary in order (``kvrag.prompts``)."""
    first = done[0][0]
    return {"id": first.prefix + first.id, "object": "text_completion", "created": first.created,
            "model": first.model, "choices": [_choice(job, text, i) for i, (job, text) in enumerate(done)],
            "usage": usage(*(job for job, _ in done)),
            "kvrag": {"prompts": [adapters.response_summary(job.prep) for job, _ in done]}}


def chunk_body(job: Job, delta: str | None, finish: str | None = None, *, role: bool = False,
               with_usage: bool = False) -> JSONObject:
    """One streamed chunk: a text delta, the role (first chat chunk), the finish, or the usage (``choices`` []);
    with ``include_usage`` the others carry ``"usage": null``."""
    choices: list[JSONObject] = []
    if not with_usage:
        if job.kind == "chat":
            d: JSONObject = {"role": "assistant", "content": ""} if role else \
                ({} if delta is None else {"content": delta})
            choices = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
    out: JSONObject = {"id": job.prefix + job.id,
                       "object": "chat.completion.chunk" if job.kind == "chat" else "text_completion",
                       "created": job.created, "model": job.model, "choices": choices}
    if with_usage:
        out["usage"] = usage(job)
    elif job.include_usage:  # as OpenAI's: with include_usage every chunk before the usage chunk has a null usage
        out["usage"] = None
    if finish is not None:
        out["kvrag"] = adapters.response_summary(job.prep)
    return out


def sse(obj: Mapping[str, object]) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"

__all__ = ["DONE", "Job", "JSONObject", "Kind", "chunk_body", "finish_reason", "full_body", "sse", "usage"]
