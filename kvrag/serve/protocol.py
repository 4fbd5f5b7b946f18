"""The OpenAI request bodies ``kvrag serve`` accepts, validated with pydantic, and its error responses.

Every field OpenAI defines for ``/v1/chat/completions`` and ``/v1/completions`` is either honoured, accepted at its
neutral value only (``n`` = 1, penalties 0, no logprobs, ``response_format`` text, ``tool_choice`` none, no tools,
``store`` false, ...: what clients that always send their defaults send), or refused: an unknown or unsupported field
(tools, JSON response formats, a non-empty ``logit_bias`` ...) is a 400 whose ``error.param`` names it. An assistant
message sent back as the ``openai`` SDK dumps it (``refusal``, ``tool_calls``, ``audio`` ... all null) is accepted.
kvrag's own options travel in the extra body field ``kvrag`` (:class:`KvragOptions`; ``extra_body={"kvrag": {...}}``
with the ``openai`` SDK).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, TypedDict, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

CHAT_ROLES = ("system", "developer", "user", "assistant")
"""Roles a chat message may have (``developer`` is rendered as ``system``); tool and function messages are refused."""

DEFAULT_COMPLETION_MAX_TOKENS = 16
"""``/v1/completions`` without ``max_tokens``: OpenAI's documented default."""

SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds accepted (a signed 64-bit integer, what the sampler's generator takes)."""


def _encodable(v: str) -> str:
    """Text that UTF-8 can encode: a lone surrogate (``"\\ud800"`` in JSON) is refused, not passed to the tokenizer."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        msg = (f"the text holds a character UTF-8 cannot encode ({v[e.start]!r} at position {e.start}: a lone "
               "surrogate); send valid Unicode")
        raise ValueError(msg) from None
    return v


Text = Annotated[str, AfterValidator(_encodable)]
"""A string field of a request: valid Unicode (encodable as UTF-8)."""


class ErrorDetail(TypedDict):
    """The ``error`` object of an OpenAI-style error response."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(TypedDict):
    """An OpenAI-style error response: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class ValidationErrorItem(TypedDict, total=False):
    """One entry of a pydantic/FastAPI validation error list (the fields :func:`validation_error_body` reads)."""

    type: str
    loc: Sequence[int | str]
    msg: str


def openai_error(message: str, *, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None) -> ErrorBody:
    """The body of an OpenAI-style error response (what the ``openai`` SDK raises from)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_V = TypeVar("_V", int, float, bool, str)


def _only(value: _V | None, allowed: tuple[_V, ...], field: str) -> _V | None:
    if value is not None and value not in allowed:
        msg = (f"{field}={value!r} is not supported by kvrag serve (accepted: "
               f"{', '.join(repr(a) for a in allowed)} or omitted)")
        raise ValueError(msg)
    return value


def _empty(value: object, field: str, why: str) -> object:
    """A field accepted only when it says nothing (None, ``[]``, ``{}``, ``""``)."""
    if value:
        raise ValueError(f"{field} is not supported by kvrag serve ({why}); send it empty or omit it")
    return value


class KvragOptions(BaseModel):
    """kvrag's own per-request options (the ``kvrag`` body field).

    Attributes:
        method: fusion method spec (``"relaxkv:r=0.15"``, ``"auto:budget=0.3"``; default: the server's ``--method``).
        params: the method's parameters as an object (merged with those in the spec).
        chunks: chunk texts to reuse for this request, exactly as the prompt contains them (default: every chunk
            registered with the server -- ``POST /v1/kvrag/chunks`` or the ``--persist`` index -- that occurs
            verbatim in the prompt).
    """

    model_config = ConfigDict(extra="forbid")

    method: Text | None = None
    params: dict[Text, object] = Field(default_factory=dict)
    chunks: list[Text] | None = None

    @field_validator("method")
    @classmethod
    def _method(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("an empty method names none: give a method spec (e.g. 'stale') or leave kvrag.method out")
        return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(default=False, strict=True)
    include_obfuscation: bool | None = Field(default=None, strict=True)  # OpenAI's padding of events: none here
    continuous_usage_stats: bool | None = Field(default=None, strict=True)  # vLLM's: usage on the last event only

    @field_validator("continuous_usage_stats")
    @classmethod
    def _continuous(cls, v: bool | None) -> bool | None:
        return _only(v, (False,), "stream_options.continuous_usage_stats")


class _Sampling(BaseModel):
    """Fields the two completion endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: Text
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False, strict=True)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False, strict=True)
    stop: Text | list[Text] | None = None
    stream: bool | None = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1], strict=True)
    user: Text | None = None
    n: int | None = Field(default=None, strict=True)
    frequency_penalty: float | None = Field(default=None, strict=True)
    presence_penalty: float | None = Field(default=None, strict=True)
    logit_bias: dict[str, float] | None = None
    store: bool | None = Field(default=None, strict=True)
    metadata: dict[Text, Text] | None = None
    # OpenAI's hints with nothing to do on one local model: accepted and not used
    prompt_cache_key: Text | None = None  # kvrag's caches are content-addressed already
    safety_identifier: Text | None = None
    service_tier: Text | None = None
    top_k: int | None = Field(default=None, ge=-1, strict=True)  # vLLM's and llama.cpp's extension: 0 or -1 is off
    kvrag: KvragOptions | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        return _only(v, (1,), "n")

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _penalty(cls, v: float | None, info: ValidationInfo) -> float | None:
        return _only(v, (0, 0.0), str(info.field_name))

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError(f"stop takes at most 4 sequences, got {len(stops)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        _empty(v, "logit_bias", "token biases are not applied")
        return v

    @field_validator("store")
    @classmethod
    def _store(cls, v: bool | None) -> bool | None:
        return _only(v, (False,), "store")

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true (as OpenAI answers); drop it")
        return v

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    # other keys of a text part (LangChain's "id", Anthropic-style "cache_control") say nothing about its text
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One chat message: text content only (a string or ``{"type": "text"}`` parts). ``name`` is accepted and not
    rendered (chat templates have no place for it). The fields the ``openai`` SDK's dump of an assistant message
    carries (``refusal``, ``tool_calls``, ``function_call``, ``audio``, ``annotations``) are accepted while they
    say nothing; a tool call or audio is refused."""

    model_config = ConfigDict(extra="forbid")

    role: str
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    refusal: Text | None = None
    tool_calls: list[object] | None = None
    function_call: None = None
    audio: None = None
    annotations: list[object] | None = None
    tool_call_id: None = None  # a tool message's; null on the others

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            why = " (tool calling is not supported)" if v in ("tool", "function") else ""
            msg = f"role {v!r} is not supported by kvrag serve{why}; use one of {', '.join(CHAT_ROLES)}"
            raise ValueError(msg)
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: object) -> object:
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported by kvrag serve (text only: "
                                 "a string or {'type': 'text', 'text': ...} parts)")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v: list[object] | None) -> list[object] | None:
        _empty(v, "tool_calls", "tool calling is not supported: send the assistant turn's text only")
        return v

    @model_validator(mode="after")
    def _content_where_needed(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (a string or text parts)")
        return self

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    logprobs: bool | None = Field(default=None, strict=True)
    top_logprobs: int | None = Field(default=None, strict=True)
    response_format: dict[str, object] | None = None
    tools: list[object] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = Field(default=None, strict=True)
    functions: list[object] | None = None  # OpenAI's older tools: empty or null only
    function_call: str | None = None
    modalities: list[str] | None = None

    @field_validator("tools", "functions")
    @classmethod
    def _tools(cls, v: list[object] | None, info: ValidationInfo) -> list[object] | None:
        kind = "tool" if info.field_name == "tools" else "function"
        _empty(v, str(info.field_name), f"{kind} calling is not supported")
        return v

    @field_validator("function_call")
    @classmethod
    def _function_call(cls, v: str | None) -> str | None:
        return _only(v, ("none",), "function_call")

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, object] | None) -> dict[str, object] | None:
        if v is not None and v != {"type": "text"}:
            raise ValueError(f"response format {v.get('type')!r} is not supported by kvrag serve (no constrained "
                             "decoding); use {'type': 'text'} or omit response_format")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: str | None) -> str | None:
        return _only(v, ("none",), "tool_choice")

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and v != ["text"]:
            raise ValueError(f"modalities={v!r} is not supported by kvrag serve (accepted: ['text'] or omitted)")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: bool | None) -> bool | None:
        return _only(v, (False,), "logprobs")

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None) -> int | None:
        return _only(v, (0,), "top_logprobs")

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


MAX_PROMPTS = 32
"""Most prompts one ``/v1/completions`` request may list (each is a request of its own in the server's queue)."""


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt string, or a list of them (one choice each)."""

    prompt: Text | list[Text]
    echo: bool | None = Field(default=None, strict=True)
    suffix: Text | None = None
    logprobs: int | None = Field(default=None, strict=True)
    best_of: int | None = Field(default=None, strict=True)

    @field_validator("prompt", mode="before")
    @classmethod
    def _token_ids(cls, v: object) -> object:
        """OpenAI also takes token ids (a list of ints, or of such lists): said so, not "a valid string"."""
        if isinstance(v, list) and v and all(isinstance(x, int) or (isinstance(x, list) and x and all(
                isinstance(y, int) for y in x)) for x in v):
            raise ValueError("token-id prompts are not supported by kvrag serve: send the prompt as text")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not 1 <= len(v) <= MAX_PROMPTS:
            raise ValueError(f"prompt takes a string or a list of 1 to {MAX_PROMPTS} strings, got a list of {len(v)}")
        return v

    @model_validator(mode="after")
    def _one_prompt_streamed(self) -> CompletionRequest:
        if self.stream and len(self.prompts()) > 1:
            raise ValueError("a streamed completion takes one prompt; send the list without stream, or each prompt "
                             "in a request of its own")
        return self

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool | None) -> bool | None:
        return _only(v, (False,), "echo")

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: str | None) -> str | None:
        return _only(v, ("",), "suffix")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v: int | None) -> int | None:
        return _only(v, (0,), "logprobs")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v: int | None) -> int | None:
        return _only(v, (1,), "best_of")

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def requested_tokens(self) -> int:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS


class ChunksRequest(BaseModel):
    """``POST /v1/kvrag/chunks``: passages to register and cache, exactly as prompts will contain them."""

    model_config = ConfigDict(extra="forbid")

    texts: list[Text] = Field(min_length=1)


_NOT_OPENAI = frozenset({"min_p", "repetition_penalty", "typical_p", "keep_alive", "options", "mirostat"})
"""Other servers' extensions a client of theirs may send (vLLM, llama.cpp, Ollama)."""


def _unsupported(param: str) -> str:
    """The message for a field the request model does not have."""
    name = param.rsplit(".", 1)[-1]
    if param.startswith("kvrag."):
        return (f"unknown kvrag option {name!r}: the kvrag object takes {', '.join(sorted(KvragOptions.model_fields))}"
                " (docs/serve.md)")
    if name in ("reasoning_effort", "verbosity", "reasoning"):
        return f"{name!r} applies to reasoning models; this server's model is not one: remove it"
    if name in _NOT_OPENAI:
        return (f"{name!r} is another server's extension, not one of OpenAI's sampling fields, which kvrag serve "
                "implements (with top_k): remove it")
    return (f"unsupported field {param!r}: kvrag serve does not implement it; remove it (docs/serve.md lists the "
            "fields each endpoint accepts)")


def validation_error_body(errors: Sequence[ValidationErrorItem]) -> ErrorBody:
    """A pydantic/FastAPI validation error list -> one OpenAI error naming the first offending field."""
    # a union field reports one error per member: the one a validator raised names the problem best
    none: ValidationErrorItem = {}
    # else the deepest: of a union's members, the one whose type the value has got furthest (a list of text parts
    # with one bad key: that key, not "Input should be a valid string" from the str member)
    first = next((e for e in errors if e.get("type") == "value_error"),
                 max(errors, key=lambda e: len(e.get("loc", ())), default=none))
    # a union's member ("str", "function-after[...]") is not a field: the param is the field's path
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not (isinstance(p, str) and ("[" in p or p in (
        "str", "int", "float", "bool", "list", "dict", "none")))]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        where = first.get("loc", ("body", None))[-1]
        return openai_error(f"the request body is not valid JSON ({first.get('msg', 'invalid')}"
                            + (f", at byte {where})" if isinstance(where, int) else ")"), code="invalid_json")
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        return openai_error("the request body must be a JSON object sent with 'Content-Type: application/json' "
                            "(curl: -H 'content-type: application/json')", code="invalid_json")
    if kind == "extra_forbidden":
        message = _unsupported(param or "")
    elif kind == "missing" and param is None:
        message = "the request has no JSON body: send a JSON object with 'Content-Type: application/json'"
    elif kind == "missing":
        message = f"missing required field {param!r}"
    else:
        text = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        message = f"invalid {param!r}: {text}" if param else text
    return openai_error(message, param=param)


__all__ = [
    "CHAT_ROLES",
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "ErrorBody",
    "ErrorDetail",
    "SEED_RANGE",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChunksRequest",
    "CompletionRequest",
    "KvragOptions",
    "StreamOptions",
    "Text",
    "ValidationErrorItem",
    "openai_error",
    "validation_error_body",
]
