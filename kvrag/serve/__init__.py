"""``kvrag serve``: chunk reuse behind an OpenAI-compatible HTTP endpoint (``pip install 'kvrag[serve]'``).

Any OpenAI client (the ``openai`` SDK, LlamaIndex ``OpenAILike``, LangChain ``ChatOpenAI``, ``curl``) talks to it
unchanged; the passages registered with the server (``POST /v1/kvrag/chunks``, or the chunks of a ``kvrag ingest``
index) are found verbatim in each rendered prompt and their caches reused. Endpoints and options: docs/serve.md.

* :mod:`kvrag.serve.app`: the FastAPI app (:func:`create_app`, :class:`ServeConfig`).
* :mod:`kvrag.serve.protocol`: the accepted request bodies and OpenAI-style errors.
* :mod:`kvrag.serve.metrics`: the Prometheus metrics of ``/metrics``.
* :mod:`kvrag.serve.server`: running it with uvicorn (:func:`serve`, :class:`LiveServer`).

Importing this package needs FastAPI only when :func:`create_app` runs.
"""

from __future__ import annotations

from kvrag.serve.app import STORE_WARNING, KVRAGService, ServeConfig, create_app
from kvrag.serve.server import LiveServer, serve

__all__ = ["STORE_WARNING", "KVRAGService", "LiveServer", "ServeConfig", "create_app", "serve"]
