"""No bare ``Any`` among the named parameters of kvrag's public functions (issue: typed seams).

An engine, a prepared request, a store, a loaded model or a tokenizer crossing a module boundary carries its type (a
concrete class, imported under ``TYPE_CHECKING`` where the import would be heavy or circular, or a Protocol such as
:class:`kvrag.repair.run_state.TrainingRun`), so mypy checks the seam. Checked: every public function and method
(``__init__`` included) of kvrag/, parameters annotated ``Any`` or ``Any | None``. Not checked: ``*args`` /
``**kwargs`` pass-throughs and JSON documents (``dict[str, Any]``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvrag"

# Modules whose seams are still untyped: none.
PENDING_DIRS: tuple[str, ...] = ()
PENDING: frozenset[str] = frozenset()


def untyped_parameters(source: str) -> list[str]:
    """``function(parameter)`` for every named parameter of a public function annotated ``Any`` / ``Any | None``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
                not node.name.startswith("_") or node.name == "__init__"):
            for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                if a.annotation is not None and ast.unparse(a.annotation) in ("Any", "Any | None", "Optional[Any]"):
                    found.append(f"{node.name}({a.arg}) line {node.lineno}")
    return found


def test_public_parameters_carry_their_types() -> None:
    bad = {rel: found for p in sorted(PKG.rglob("*.py"))
           if (rel := str(p.relative_to(ROOT))) not in PENDING and not rel.startswith(PENDING_DIRS)
           and (found := untyped_parameters(p.read_text()))}
    assert bad == {}, "type these parameters (a concrete class under TYPE_CHECKING, or a Protocol)"


def test_the_check_sees_methods_and_constructors_but_not_private_helpers() -> None:
    src = ("from typing import Any\n\n"
           "def f(engine: Any, n: int, *args: Any, **kw: Any) -> None: ...\n"
           "def _g(x: Any) -> None: ...\n"
           "class C:\n    def __init__(self, store: Any | None = None) -> None: ...\n"
           "    async def m(self, *, loaded: Any) -> None: ...\n")
    assert [s.split(" line")[0] for s in untyped_parameters(src)] == ["f(engine)", "__init__(store)", "m(loaded)"]
