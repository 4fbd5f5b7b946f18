"""The house rules of docs/architecture.md (#layout, #conventions) that a parser can check: no import cycles, one
concept per (short) module, and the core never imports its own framework adapters, the frameworks or the benchmarks.

Imports are read from the AST of every module under ``kvrag/`` (``kvrag/cli.py`` included), including imports
inside functions (a lazy import is still a dependency) and ``importlib.import_module("name")`` / ``__import__``
calls with a literal name. ``if TYPE_CHECKING:`` blocks (annotations, never executed) count for the cycle checks (a
circle through annotations still ties the modules together) and are skipped for the layering rules. The benchmarks
(``benchmarks/kvrag_bench``) are held to the same no-cycle rule.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvrag"
BENCH = ROOT / "benchmarks" / "kvrag_bench"
MAX_LINES = 500
# The core wheel imports no adapter (LlamaIndex / LangChain distributions, nor the frameworks themselves) and no
# benchmark: `kvrag bench` is mounted from the kvrag-bench distribution through an entry point (kvrag.cli_plugins).
FORBIDDEN_TOP_LEVEL = ("llama_index", "langchain", "kvrag_bench", "benchmarks")


def _module_name(path: Path, base: Path = ROOT) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, base: Path = ROOT) -> bool:
    p = base.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _imports(path: Path, me: str | None = None, *, root: Path = ROOT,
             annotations: bool = False) -> list[tuple[str, int]]:
    """(imported module, line) for every runtime import in ``path`` (module ``me``, default: its name under
    ``root``), relative imports resolved; with ``annotations``, also those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skip = set() if annotations else _type_checking_nodes(tree)
    me = me or _module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and ast.unparse(node.func).endswith(("import_module", "__import__"))):
            out.append((node.args[0].value, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for a in node.names:  # `from kvrag.store import serde` imports the module kvrag.store.serde
                sub = f"{base}.{a.name}"
                out.append((sub if _is_module(sub, root) else base, node.lineno))
    return out


def _graph(unit: int | None, pkg: Path = PKG, *, annotations: bool = False) -> dict[str, set[str]]:
    """Import edges inside package ``pkg`` between units: ``unit`` leading name parts (2 = subpackage), None =
    module; with ``annotations``, ``if TYPE_CHECKING:`` imports count too."""

    def cut(name: str) -> str:
        return name if unit is None else ".".join(name.split(".")[:unit])

    root, top = pkg.parent, pkg.name
    edges: dict[str, set[str]] = defaultdict(set)
    for path in pkg.rglob("*.py"):
        src = cut(_module_name(path, root))
        for name, _ in _imports(path, root=root, annotations=annotations):
            if name.startswith(f"{top}.") and cut(name) != src and src != top:
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
    assert _cycles(_graph(2, annotations=True)) == []


def test_no_import_cycles_between_modules() -> None:
    """In-function and ``TYPE_CHECKING`` imports included (a protocol in a lower module breaks such a circle)."""
    assert _cycles(_graph(None, annotations=True)) == []


def test_no_import_cycles_in_the_benchmarks() -> None:
    assert BENCH.is_dir()
    assert _cycles(_graph(None, BENCH, annotations=True)) == []


def test_the_cycle_check_sees_type_checking_and_in_function_imports(tmp_path: Path) -> None:
    """The cycle rule would pass vacuously if the parser missed these forms; it must not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n    return a\n")
    assert _cycles(_graph(None, pkg, annotations=True)) == [["pkg.a", "pkg.b"]]
    assert _cycles(_graph(None, pkg)) == []


def test_layers_point_down() -> None:
    """kv is the bottom layer (it reads only the machine's facts: the CPU flags and kvrag's data directory, for its
    int4 kernel, and the OpenMP runtime's per-thread count, for a prepare's pieces); repair (the learned network and
    its data) sits below fusion, fusion below engine."""
    edges = _graph(2)
    assert edges["kvrag.kv"] <= {"kvrag.errors", "kvrag.calibration", "kvrag.paths", "kvrag.threads"}
    assert not edges["kvrag.repair"] & {"kvrag.engine", "kvrag.fusion", "kvrag.adapters"}
    assert not edges["kvrag.fusion"] & {"kvrag.engine", "kvrag.adapters"}
    assert not edges["kvrag.store"] & {"kvrag.engine", "kvrag.fusion", "kvrag.repair", "kvrag.models"}
    # the model loader reads calibrations (dtype policy): kvrag.calibration must stay below models, fusion, engine
    assert edges["kvrag.calibration"] <= {"kvrag.paths"}
    assert "kvrag.calibrate" not in edges["kvrag.fusion"] | edges["kvrag.engine"] | edges["kvrag.models"]


def test_modules_are_short() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concept (docs/architecture.md#conventions rule 1, <= {MAX_LINES} lines): {long}"


def _forbidden(name: str) -> bool:
    top = name.split(".")[0]
    return top.startswith("langchain") or top in FORBIDDEN_TOP_LEVEL


def test_core_imports_no_adapter_framework_or_benchmark() -> None:
    modules = {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")}
    assert "kvrag/cli.py" in modules  # the console script is held to the same rule
    assert not (PKG / "bench").exists(), "the benchmarks live in benchmarks/kvrag_bench (distribution kvrag-bench)"
    bad = [f"{p.relative_to(ROOT)}:{line} {name}" for p in PKG.rglob("*.py") for name, line in _imports(p)
           if _forbidden(name)]
    assert bad == []


def test_the_layering_parser_sees_lazy_and_dynamic_imports(tmp_path) -> None:
    """The rule above would pass vacuously if the parser missed these forms; it must not."""
    probe = tmp_path / "probe.py"
    probe.write_text("import importlib\n\n\ndef f():\n    from kvrag_bench import cli\n"
                     "    importlib.import_module('llama_index.core')\n    __import__('langchain_core')\n"
                     "    return cli\n")
    names = [n for n, _ in _imports(probe, "kvrag.probe")]
    assert [n for n in names if _forbidden(n)] == ["kvrag_bench", "llama_index.core", "langchain_core"]


def test_import_kvrag_stays_light() -> None:
    """``import kvrag`` imports no adapter, framework, benchmark or optional extra (redis, ray, faiss,
    sentence-transformers, gguf), so it works with none of the extras installed (docs/architecture.md#conventions, 9)."""
    import subprocess
    import sys

    code = ("import sys, kvrag, kvrag.adapters, kvrag.prompting, kvrag.cli; kvrag.cli.build_parser; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'llama_index', 'langchain', "
            "'langchain_core', 'ray', 'faiss', 'sentence_transformers', 'gguf', 'kvrag_bench') "
            "or m.startswith('kvrag.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
    issue = ("import kvrag, sys; assert not any(m.startswith(('llama_index', 'langchain', 'kvrag.bench', "
             "'kvrag_bench')) for m in sys.modules)")
    subprocess.run([sys.executable, "-c", issue], check=True, cwd=ROOT)
