"""No unit test asserts on wall-clock time (docs/architecture.md#tests): on a shared 2-core CI machine running two
test workers such an assert is flaky by construction; a timing target belongs in a ``kvrag bench`` command.

The check reads every module under tests/unit and flags an ``assert`` that depends on a clock reading: a clock
call (``time.perf_counter()``, ``time.monotonic()``, ``time.time()``, ...) in the assert, or a name computed from
one in the same function (followed through assignments, ``.append`` and comprehensions). Exempt is the deadline
guard of a bounded wait, ``assert time.monotonic() < deadline`` with ``deadline = time.monotonic() + N``: it fails
only when something hangs, not when the machine is slow. Scheduling and timing behaviour is tested through the
pure scheduler (kvrag.engine.scheduler), counted events, or an injected clock (tests/unit/test_auto_online.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

UNIT = Path(__file__).parent
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns", "process_time",
          "thread_time", "now", "utcnow", "default_timer"}
CLOCK_OWNERS = {"time", "datetime", "timeit"}


def _is_clock(node: ast.AST, helpers: frozenset[str] = frozenset()) -> bool:
    """A clock reading: a call of ``time.monotonic()``, ``datetime.now()``, a from-imported ``perf_counter()``,
    a module helper that reads one; or an engine-measured duration (``<x>.timings``)."""
    if isinstance(node, ast.Attribute) and node.attr == "timings":
        return True
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr in CLOCKS:
        base = f.value
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
        return name in CLOCK_OWNERS
    return isinstance(f, ast.Name) and (f.id in CLOCKS - {"time", "now"} or f.id in helpers)


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Tuple | ast.List):
        return [n for e in node.elts for n in _targets(e)]
    return []


def _pairs(node: ast.Assign) -> list[tuple[list[str], ast.AST]]:
    """(names, the expression each gets) of an assignment; ``a, b = x, y`` pairs element by element."""
    out: list[tuple[list[str], ast.AST]] = []
    for t in node.targets:
        v = node.value
        if (isinstance(t, ast.Tuple | ast.List) and isinstance(v, ast.Tuple | ast.List) and len(t.elts) == len(v.elts)
                and not any(isinstance(e, ast.Starred) for e in t.elts)):
            out.extend((_targets(te), ve) for te, ve in zip(t.elts, v.elts, strict=True))
        else:
            out.append((_targets(t), v))
    return out


def _tainted(func: ast.AST, helpers: frozenset[str]) -> set[str]:
    """Names in ``func`` whose value derives from a clock reading (a fixpoint over assignments)."""
    flows: list[tuple[list[str], ast.AST]] = []  # (assigned names, value expression)
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            flows.extend(_pairs(node))
        elif isinstance(node, ast.AugAssign | ast.AnnAssign) and node.value is not None:
            flows.append((_targets(node.target), node.value))
        elif isinstance(node, ast.NamedExpr):
            flows.append((_targets(node.target), node.value))
        elif isinstance(node, ast.For):
            flows.append((_targets(node.target), node.iter))
        elif isinstance(node, ast.comprehension):
            flows.append((_targets(node.target), node.iter))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("append", "extend", "insert", "add") and isinstance(node.func.value, ast.Name)):
            flows.append(([node.func.value.id], node))
    tainted: set[str] = set()
    changed = True
    while changed:
        changed = False
        for names, value in flows:
            if any(_is_clock(n, helpers) for n in ast.walk(value)) or _names(value) & tainted:
                new = set(names) - tainted
                if new:
                    tainted |= new
                    changed = True
    return tainted


def _deadlines(func: ast.AST) -> set[str]:
    """Names only ever assigned ``<clock>() + <something>``: the deadlines of bounded waits."""
    seen: dict[str, bool] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for names, v in _pairs(node):
                ok = len(names) == 1 and isinstance(v, ast.BinOp) and isinstance(v.op, ast.Add) and _is_clock(v.left)
                for name in names:
                    seen[name] = seen.get(name, True) and ok
    return {n for n, ok in seen.items() if ok}


def _is_guard(node: ast.AST, deadlines: set[str]) -> bool:
    """``<clock>() < deadline`` (or ``>``, either side): a bounded wait's deadline, not a timing claim."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
        return False
    a, b = node.left, node.comparators[0]
    return ((_is_clock(a) and isinstance(b, ast.Name) and b.id in deadlines)
            or (_is_clock(b) and isinstance(a, ast.Name) and a.id in deadlines))


def _depends_on_clock(node: ast.AST, tainted: set[str], deadlines: set[str], helpers: frozenset[str]) -> bool:
    if _is_guard(node, deadlines):
        return False
    if _is_clock(node, helpers) or (isinstance(node, ast.Name) and node.id in tainted):
        return True
    return any(_depends_on_clock(c, tainted, deadlines, helpers) for c in ast.iter_child_nodes(node))


def _timings_of(node: ast.AST) -> str | None:
    """``r`` for ``r.timings.ttft_s`` (the request whose own durations these are), else None."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and node.attr == "timings":
            return ast.dump(node.value)
        node = node.value
    return None


def _helpers(tree: ast.Module) -> frozenset[str]:
    """Module-level non-test functions that return a clock reading or a value computed from one (their calls are
    clock readings too; a helper that only waits for a deadline is not one)."""
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("test")}
    found: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, f in funcs.items():
            known = frozenset(found)
            tainted = _tainted(f, known)
            returns = [r.value for r in ast.walk(f) if isinstance(r, ast.Return) and r.value is not None]
            if name not in found and any(_is_clock(n, known) or (isinstance(n, ast.Name) and n.id in tainted)
                                         for r in returns for n in ast.walk(r)):
                found.add(name)
                changed = True
    return frozenset(found)


def wall_clock_asserts(source: str, filename: str = "<test>") -> list[str]:
    """``file:line`` of every assert in ``source`` that compares a clock reading with a bound (see the module
    docstring). Not flagged: a reading compared with 0 or None, two durations of one request compared with each
    other (``r.timings.ttft_s <= r.timings.total_s``: an ordering, true on any machine), a bounded wait's deadline
    guard, and a test that takes an injected ``clock`` fixture (its readings are virtual)."""
    tree = ast.parse(source, filename)
    helpers = _helpers(tree)
    found = []
    for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
        if any(a.arg == "clock" for a in func.args.args):
            continue
        tainted, deadlines = _tainted(func, helpers), _deadlines(func)
        for node in (n for n in ast.walk(func) if isinstance(n, ast.Assert)):
            for cmp in (c for c in ast.walk(node.test) if isinstance(c, ast.Compare)):
                sides = [cmp.left, *cmp.comparators]
                for op, left, right in zip(cmp.ops, sides[:-1], sides[1:], strict=True):
                    pair = ast.Compare(left=left, ops=[op], comparators=[right])
                    dl = _depends_on_clock(left, tainted, deadlines, helpers)
                    dr = _depends_on_clock(right, tainted, deadlines, helpers)
                    if _is_guard(pair, deadlines) or not (dl or dr) or isinstance(op, ast.Is | ast.IsNot):
                        continue
                    other = right if dl and not dr else left if dr and not dl else None
                    if isinstance(other, ast.Constant) and other.value in (0, None):
                        continue
                    if dl and dr and _timings_of(left) is not None and _timings_of(left) == _timings_of(right):
                        continue
                    found.append(f"{filename}:{node.lineno}")
    return sorted(set(found))


def test_no_unit_test_asserts_on_the_wall_clock() -> None:
    """tests/unit, and tests/integration too (one real model's timings on a shared machine are no steadier)."""
    paths = sorted(UNIT.glob("test_*.py")) + sorted((UNIT.parent / "integration").glob("test_*.py"))
    found = [hit for path in paths
             for hit in wall_clock_asserts(path.read_text(), str(path.relative_to(UNIT.parent.parent)))]
    assert not found, ("unit tests assert on wall-clock time (flaky on a loaded machine): test the behaviour "
                       "through the pure scheduler, counted events or an injected clock, and move a timing claim "
                       f"to a `kvrag bench` command: {found}")


@pytest.mark.parametrize("body", [
    "t0 = time.monotonic()\n    work()\n    assert time.monotonic() - t0 < 5",
    "t0 = time.perf_counter()\n    work()\n    elapsed = time.perf_counter() - t0\n    assert elapsed < 2.0",
    "stamps = []\n    stamps.append(time.monotonic())\n    gaps = [b - a for a, b in zip(stamps, stamps[1:])]\n"
    "    assert max(gaps) < 1.0",
    "full_t = statistics.median(ttft() for _ in range(5))\n    r = time.time() / full_t\n    assert r > 4",
    "from time import perf_counter\n    t = perf_counter()\n    assert perf_counter() - t < 1",
    "full_t = statistics.median(_ttft(eng.prepare(p)) for _ in range(5))\n    ratios = []\n"
    "    ratios.append(_ttft(eng.prepare(q)) / full_t)\n    assert max(ratios[1:]) < ratios[0] / 2",
    "r = eng.answer(q)\n    assert r.timings.ttft_s < 0.5",
])
def test_the_check_flags_wall_clock_asserts(body: str) -> None:
    helper = "def _ttft(prep):\n    return prep.timings.fetch_s + prep.timings.repair_s\n\n"
    assert wall_clock_asserts(f"{helper}def test_x():\n    {body}\n")


@pytest.mark.parametrize("body", [
    "deadline = time.monotonic() + 60\n    while not done():\n        assert time.monotonic() < deadline, 'hung'",
    "deadline = time.monotonic() + 60\n    assert alive() and time.monotonic() < deadline",
    "end = time.monotonic() + 5\n    while time.monotonic() < end:\n        time.sleep(0.01)\n    assert done()",
    "steps = count()\n    assert steps >= 5",
    "end, seed = time.monotonic() + 9, 0\n    n, m = run(seed)\n    assert n > 50",
    "r = eng.answer(q)\n    assert r.timings.ttft_s is not None and 0 < r.timings.ttft_s <= r.timings.total_s",
    "t = time.perf_counter()\n    assert time.perf_counter() - t >= 0",
])
def test_the_check_lets_deadline_guards_and_counts_pass(body: str) -> None:
    assert wall_clock_asserts(f"def test_x():\n    {body}\n") == []
    injected = "def test_x(clock):\n    t = clock.perf_counter()\n    assert engine_ttft(clock) == 0.2\n"
    assert wall_clock_asserts(injected) == []
