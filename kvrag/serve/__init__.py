"""``kvrag serve``: chunk reuse behind an OpenAI-compatible HTTP endpoint (``pip install 'kvrag[serve]'``).

Any OpenAI client (the ``openai`` SDK, LlamaIndex ``OpenAILike``, LangChain ``ChatOpenAI``, ``curl``) talks to it
unchanged; the passages registered with the server (``POST /v1/kvrag/chunks``, or the chunks of a ``kvrag ingest``
index) are found verbatim in each rendered prompt and their caches reused. Endpoints and options: docs/serve.md.

* :mod:`kvrag.serve.app`: the FastAPI app (:func:`create_app`).
* :mod:`kvrag.serve.config`: :class:`ServeConfig` (limits, keys, drain timeout).
* :mod:`kvrag.serve.routes`: the endpoints; :mod:`kvrag.serve.service`: what they call (:class:`KVRAGService`).
* :mod:`kvrag.serve.outcome`: the one owner of a request's outcome (lease, queue place, status, metrics).
* :mod:`kvrag.serve.middleware`: API keys and the body limit; :mod:`kvrag.serve.errors`: OpenAI's error object.
* :mod:`kvrag.serve.protocol`: the accepted request bodies; :mod:`kvrag.serve.bodies`: the response bodies.
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
    from kvrag.serve.app import create_app
    from kvrag.serve.config import ServeConfig
    from kvrag.serve.routes import STORE_WARNING
    from kvrag.serve.server import LiveServer, serve
    from kvrag.serve.service import KVRAGService

_WHERE = {"STORE_WARNING": "routes", "KVRAGService": "service", "ServeConfig": "config", "create_app": "app",
          "LiveServer": "server", "serve": "server"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"kvrag.serve.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'kvrag.serve' has no attribute {name!r}")


__all__ = ["STORE_WARNING", "KVRAGService", "LiveServer", "ServeConfig", "create_app", "serve"]
