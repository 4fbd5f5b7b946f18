"""Fusion (cache repair) methods, registered by name. Importing this package registers the built-ins."""

from __future__ import annotations

import importlib
import logging

from kvrag.fusion.base import (
    FusionInput,
    FusionMethod,
    FusionOutput,
    Span,
    available_methods,
    get_method,
    parse_method_spec,
    register,
)

_log = logging.getLogger(__name__)

# Built-in method modules; each registers itself on import.
_BUILTINS = ("full", "stale", "relaxkv", "cacheblend", "epic", "prophetkv", "cacherepair", "hybrid", "auto")
for _mod in _BUILTINS:
    try:
        importlib.import_module(f"kvrag.fusion.{_mod}")
    except ModuleNotFoundError as _e:  # a method under construction is simply not registered
        if _e.name != f"kvrag.fusion.{_mod}":
            raise

__all__ = [
    "FusionInput",
    "FusionMethod",
    "FusionOutput",
    "Span",
    "available_methods",
    "get_method",
    "parse_method_spec",
    "register",
]
