"""The house rules of docs/architecture.md (#layout, #conventions) that a parser can check: no import cycles, one
concept per (short) module, and the core never imports its own framework adapters.

Imports are read from the AST of every module under ``kvrag/``, including imports inside functions (a lazy import
is still a dependency); only ``if TYPE_CHECKING:`` blocks are skipped (annotations, never executed).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvrag"
MAX_LINES = 500
ADAPTER_PACKAGES = ("llama_index.llms.kvrag", "llama_index.postprocessor.kvrag", "langchain_kvrag")
# `kvrag bench load` mounts the load harness of the LlamaIndex integration, imported lazily (ImportError names the
# extra); no other core module may import an adapter distribution.
ADAPTER_IMPORT_ALLOWED = {"kvrag/bench/cli.py"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every runtime import in ``path``, relative imports resolved."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_nodes(tree)
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for a in node.names:  # `from kvrag.store import serde` imports the module kvrag.store.serde
                sub = f"{base}.{a.name}"
                out.append((sub if _is_module(sub) else base, node.lineno))
    return out


def _graph(unit: int | None) -> dict[str, set[str]]:
    """kvrag-internal import edges between units: ``unit`` leading name parts (2 = subpackage), None = module."""

    def cut(name: str) -> str:
        return name if unit is None else ".".join(name.split(".")[:unit])

    edges: dict[str, set[str]] = defaultdict(set)
    for path in PKG.rglob("*.py"):
        src = cut(_module_name(path))
        for name, _ in _imports(path):
            if name.startswith("kvrag.") and cut(name) != src and src != "kvrag":
                edges[src].add(cut(name))
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_subpackages() -> None:
    assert _cycles(_graph(2)) == []


def test_no_import_cycles_between_modules() -> None:
    assert _cycles(_graph(None)) == []


def test_layers_point_down() -> None:
    """kv is the bottom layer; repair (the learned network and its data) sits below fusion, fusion below engine."""
    edges = _graph(2)
    assert edges["kvrag.kv"] <= {"kvrag.errors"}
    assert not edges["kvrag.repair"] & {"kvrag.engine", "kvrag.fusion", "kvrag.adapters", "kvrag.bench"}
    assert not edges["kvrag.fusion"] & {"kvrag.engine", "kvrag.adapters", "kvrag.bench"}
    assert not edges["kvrag.store"] & {"kvrag.engine", "kvrag.fusion", "kvrag.repair", "kvrag.models"}
    # the model loader reads calibrations (dtype policy): kvrag.calibration must stay below models, fusion, engine
    assert edges["kvrag.calibration"] <= {"kvrag.paths"}
    assert "kvrag.calibrate" not in edges["kvrag.fusion"] | edges["kvrag.engine"] | edges["kvrag.models"]


def test_modules_are_short() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concept (docs/architecture.md#conventions rule 1, <= {MAX_LINES} lines): {long}"


def test_core_does_not_import_its_adapters() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line} {name}" for p in PKG.rglob("*.py") for name, line in _imports(p)
           if name.startswith(ADAPTER_PACKAGES) and str(p.relative_to(ROOT)) not in ADAPTER_IMPORT_ALLOWED]
    assert bad == []


def test_import_kvrag_stays_light() -> None:
    """``import kvrag`` imports neither redis, llama_index, langchain nor ray (docs/architecture.md#conventions, 9)."""
    import subprocess
    import sys

    code = ("import sys, kvrag, kvrag.adapters, kvrag.prompting; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'llama_index', 'langchain', "
            "'langchain_core', 'ray')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
