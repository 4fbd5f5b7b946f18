"""Ablation controls: methods that answer a research question about another method, not methods to serve with.

They are not in the user registry (``kvrag.fusion.available_methods()`` does not list them and ``get_method``
does not resolve them) until :func:`register_ablations` is called: the benchmark and the test suites call it. They
live in kvrag-bench, not in the kvrag wheel.
"""

from __future__ import annotations

from kvrag.fusion.base import FusionMethod, register
from kvrag.fusion.relaxkv import RelaxKV


class RelaxKVFullContext(RelaxKV):
    """RelaxKV's targets with the full causal prefix as context (the full-prefix control, RelaxKV §A.4): how much
    quality RelaxKV's sparse anchor-union context costs (``relaxkv:context=full`` with another name)."""

    name = "relaxkv-fullctx"
    params = {**RelaxKV.params, "context": (str, "full")}


ABLATIONS: tuple[type[FusionMethod], ...] = (RelaxKVFullContext,)


def register_ablations() -> list[str]:
    """Register the ablation controls (idempotent); returns their names."""
    for cls in ABLATIONS:
        register(cls)
    return [cls.name for cls in ABLATIONS]


__all__ = ["ABLATIONS", "RelaxKVFullContext", "register_ablations"]
