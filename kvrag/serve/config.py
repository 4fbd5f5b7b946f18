"""``kvrag serve``'s settings: what the server answers, and the limits on everything a client sends.

Each limit is checked before the work it bounds starts (nothing is reserved, tokenized or stored for a request that
is over one) and refused with an OpenAI error whose ``code`` names it and whose message names the setting to raise:

=======================  ==========================  ======  ==============================================
setting                  ``kvrag serve`` option      status  bounds
=======================  ==========================  ======  ==============================================
``max_body_bytes``       ``--max-body-bytes``        413     the bytes of any request body (before parsing)
``max_messages``         ``--max-messages``          400     the messages of one chat completion
``max_texts``            ``--max-texts``             413     the texts of one ``POST /v1/kvrag/chunks``
``max_text_bytes``       ``--max-text-bytes``        413     the UTF-8 bytes of one registered text
``max_text_tokens``      ``--max-text-tokens``       400     the tokens of one registered text (one forward each)
``max_registered_bytes`` ``--max-registered-bytes``  413     the text bytes registered over the server's life
``max_store_bytes``      ``--max-store-bytes``       413     the store's bytes, above which nothing is registered
``max_queue``            ``--max-queue``             429     requests held at once (completions and registrations)
=======================  ==========================  ======  ==============================================
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from kvrag.errors import ConfigError

API_KEY_ENV = "KVRAG_API_KEY"
"""Environment variable with the server's API keys (several separated by commas or whitespace)."""


def default_model_id(name: str) -> str:
    """The id a model loaded by ``name`` is served as (without ``--model-id``): a local file or folder's own name
    (``/models/gemma-3-270m-q4_k_m.gguf`` -> ``gemma-3-270m-q4_k_m.gguf``: clients are not told the server's
    paths), else ``name`` as it is (an alias or a Hugging Face id such as ``HuggingFaceTB/SmolLM2-135M-Instruct``)."""
    path = Path(name).expanduser()
    local = path.suffix.lower() == ".gguf" or path.is_absolute() or name.startswith((".", "~"))
    if not local:
        try:
            local = os.sep in name and path.exists()
        except OSError:  # a name the filesystem cannot look up (too long, bad characters) is no path of ours
            local = False
    return path.name if local and path.name else name


def keys_from_env(value: str | None = None) -> tuple[str, ...]:
    """The API keys in ``value`` (default: ``$KVRAG_API_KEY``), split at commas and whitespace."""
    raw = os.environ.get(API_KEY_ENV, "") if value is None else value
    return tuple(k for k in raw.replace(",", " ").split() if k)


@dataclasses.dataclass
class ServeConfig:
    """Server settings (the engine's own settings are :class:`~kvrag.config.EngineConfig`).

    Attributes:
        model_id: the model name clients send and ``/v1/models`` lists (default: the engine's model name; a model
            loaded from a local file or folder is served as its own name, ``model.gguf``, never its path).
        method: default fusion method spec for requests that name none (default: the engine's ``method``).
        max_queue: most requests the server holds at once (completions decoding or waiting, and chunk
            registrations); more get 429 with ``Retry-After``.
        default_max_tokens: ``/v1/chat/completions`` without ``max_tokens`` / ``max_completion_tokens``.
        max_registered_chunks / max_registered_chars: bound of the registered-chunk table (least recently
            registered texts are forgotten first; their caches stay in the store).
        drain_timeout_s: on shutdown, seconds to let requests in flight finish; then each is cancelled (at its
            prepare's next piece or its next decode step) and its client answered ``503`` / an error event.
        max_body_bytes, max_messages, max_texts, max_text_bytes, max_text_tokens, max_registered_bytes,
            max_store_bytes: the limits of the module docstring (``max_store_bytes`` None: no store quota).
        api_keys: the keys a client must send as ``Authorization: Bearer KEY`` (empty: no key needed); every
            endpoint but ``/health`` and ``/health/ready`` (``middleware.OPEN_PATHS``) answers 401 without one.
        docs: serve ``/docs`` and ``/openapi.json``.
        server_header: add ``X-Kvrag-Server: host:pid`` to every response (which replica answered, behind a
            balancer); off by default, as it names the machine.
        stall_timeout_s: ``/health`` answers 503 when the engine has made no progress (no decode step, no prepare
            piece) for this long while requests wait.
        allowed_origins: web origins whose browser pages may call the server (CORS, e.g. ``http://localhost:3000``;
            ``*`` for any); empty (the default): no cross-origin headers, browsers refuse other origins' calls.
    """

    model_id: str | None = None
    method: str | None = None
    max_queue: int = 64
    default_max_tokens: int = 256
    max_registered_chunks: int = 100_000
    max_registered_chars: int = 200_000_000
    drain_timeout_s: float = 30.0
    max_body_bytes: int = 4 * 2**20
    max_messages: int = 256
    max_texts: int = 256
    max_text_bytes: int = 64 * 2**10
    max_text_tokens: int = 2048
    max_registered_bytes: int = 2**30
    max_store_bytes: int | None = None
    api_keys: tuple[str, ...] = ()
    docs: bool = False
    server_header: bool = False
    stall_timeout_s: float = 60.0
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_queue", "default_max_tokens", "max_body_bytes", "max_messages", "max_texts",
                     "max_text_bytes", "max_text_tokens", "max_registered_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_store_bytes is not None and (not isinstance(self.max_store_bytes, int) or self.max_store_bytes < 1):
            raise ConfigError(f"max_store_bytes must be an integer >= 1 or None, got {self.max_store_bytes!r}")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"drain_timeout_s must be >= 0 seconds, got {self.drain_timeout_s!r}")
        if not self.stall_timeout_s > 0:
            raise ConfigError(f"stall_timeout_s must be > 0 seconds, got {self.stall_timeout_s!r}")
        self.allowed_origins = (self.allowed_origins,) if isinstance(self.allowed_origins, str) else tuple(
            self.allowed_origins)
        if any(not isinstance(o, str) or not (o == "*" or o.startswith(("http://", "https://")))
               for o in self.allowed_origins):
            raise ConfigError(f"allowed_origins takes '*' or origins such as http://localhost:3000, got "
                              f"{list(self.allowed_origins)!r}")
        if isinstance(self.api_keys, str):
            self.api_keys = keys_from_env(self.api_keys)
        self.api_keys = tuple(self.api_keys)
        if any(not isinstance(k, str) or not k or k != k.strip() for k in self.api_keys):
            raise ConfigError("api_keys must be non-empty strings without surrounding whitespace")


__all__ = ["API_KEY_ENV", "ServeConfig", "default_model_id", "keys_from_env"]
