"""``kvrag serve``: chunk reuse behind an OpenAI-compatible HTTP endpoint (``pip install 'kvrag[serve]'``).

Any OpenAI client (the ``openai`` SDK, LlamaIndex ``OpenAILike``, LangChain ``ChatOpenAI``, ``curl``) talks to it
unchanged; the passages registered with the server (``POST /v1/kvrag/chunks``, or the chunks of a ``kvrag ingest``
index) are found verbatim in each rendered prompt and their caches reused. Endpoints and options: docs/serve.md.

* :mod:`kvrag.serve.app`: the FastAPI app (:func:`create_app`, :class:`ServeConfig`).
* :mod:`kvrag.serve.protocol`: the accepted request bodies and OpenAI-style errors.
* :mod:`kvrag.serve.metrics`: the Prometheus metrics of ``/metrics``.
* :mod:`kvrag.serve.server`: running it with uvicorn (:func:`serve`, :class:`LiveServer`).

* :mod:`kvrag.serve.ray_serve`: the same app in replicas on Ray Serve.
* :mod:`kvrag.serve.cli`: the ``kvrag serve`` options.

The names below are imported on first use, so that ``kvrag --help`` (which mounts :mod:`kvrag.serve.cli`) works
without the ``serve`` extra; :func:`create_app` and :func:`serve` raise an ``ImportError`` naming it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrag.serve.app import STORE_WARNING, KVRAGService, ServeConfig, create_app
    from kvrag.serve.server import LiveServer, serve

_WHERE = {"STORE_WARNING": "app", "KVRAGService": "app", "ServeConfig": "app", "create_app": "app",
          "LiveServer": "server", "serve": "server"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"kvrag.serve.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'kvrag.serve' has no attribute {name!r}")


__all__ = ["STORE_WARNING", "KVRAGService", "LiveServer", "ServeConfig", "create_app", "serve"]
