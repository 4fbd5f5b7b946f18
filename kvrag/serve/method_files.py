"""Method parameters a ``kvrag serve`` client may not set: those that name files (a request must not make the
server open one; files are the server's configuration, ``kvrag serve --method ...``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvrag.errors import ConfigError
from kvrag.fusion.base import parse_method_spec
from kvrag.serve.errors import HTTPProblem

PATH_PARAMS = frozenset({"costs", "checkpoint", "thresholds", "calibration", "path", "file", "dir", "root"})
"""Method parameters that name files (``auto``'s cost model and agreement thresholds, ``cacherepair``'s and
``hybrid``'s checkpoint): server-side configuration (``kvrag serve --method``), refused from clients."""

NOT_PATHS = frozenset({"levels"})
"""Method parameters whose values may hold a slash without naming a file (``auto``'s ``levels=0/0.5/1``)."""


def refuse_paths(spec: str | None, params: Mapping[str, object]) -> None:
    """400 when a client's method spec or params name a file (a parameter of :data:`PATH_PARAMS`, or a value that
    looks like a path): no request makes the server open one."""
    named = dict(params)
    if spec:
        try:
            named.update(parse_method_spec(spec)[1])
        except ConfigError as e:
            raise HTTPProblem(400, f"kvrag.method: {e}", param="kvrag.method") from e
    for key, value in named.items():
        pathlike = key.lower() not in NOT_PATHS and isinstance(value, str) and (
            os.sep in value or value.startswith(("~", ".")) or "\\" in value)
        if key.lower() in PATH_PARAMS or pathlike:
            where = "kvrag.params" if key in params else "kvrag.method"
            raise HTTPProblem(400, f"{where}: the method parameter {key!r} names a file; files are the server's "
                                   "configuration (kvrag serve --method ...), not a request's", param=where,
                              code="path_not_allowed")


__all__ = ["NOT_PATHS", "PATH_PARAMS", "refuse_paths"]
