"""Optional dependencies: import one, or say which kvrag extra installs it.

The core installs without FAISS, sentence-transformers, gguf, redis-py and Ray (``pip install 'kvrag[faiss]'``,
``[embed]``, ``[gguf]``, ``[redis]``, ``[ray]``, or ``[all]``); each feature that needs one imports it here when it
runs, so ``import kvrag`` never does and a missing package is an ``ImportError`` that names the fix.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, purpose: str, hint: str = "") -> ModuleType:
    """Import ``module`` (e.g. ``"faiss"``, ``"redis.cluster"``) for ``purpose``.

    Raises:
        ImportError: it is not installed; the message names ``purpose``, the package and
            ``pip install 'kvrag[<extra>]'`` (plus ``hint`` when given).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        msg = f"{purpose} needs {package}; install it with: pip install 'kvrag[{extra}]'{hint}"
        raise ImportError(msg) from e


__all__ = ["require"]
