"""Fusion (cache repair) methods, registered by name. Importing this package registers the built-ins."""

from __future__ import annotations

from kvrag.fusion.base import (
    FusionInput,
    FusionMethod,
    FusionOutput,
    Observation,
    Span,
    available_methods,
    get_method,
    load_builtin_methods,
    parse_method_spec,
    register,
    shared_method,
)
from kvrag.fusion.stats import MethodStats

load_builtin_methods()

__all__ = [
    "FusionInput",
    "FusionMethod",
    "FusionOutput",
    "MethodStats",
    "Observation",
    "Span",
    "available_methods",
    "get_method",
    "parse_method_spec",
    "register",
    "shared_method",
]
