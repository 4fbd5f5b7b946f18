"""No timing figures in kvrag's comments and docstrings (docs/architecture.md#conventions; issue: comments that
explain instead of measure).

A measured figure goes stale in code: it lives in docs/results/ with the command that produced it, and the code says
why it does what it does. The pattern is narrow on purpose -- durations (``38 ms``, ``110 us``, ``60.5 s``), speed-up
ratios (``0.88x``), rates (``GB/s``, ``12.3 tokens/s``) and machine descriptions (``2-core``) -- and reads only
comments (``tokenize``) and string statements (docstrings, attribute docstrings), never code, messages or help texts.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "kvrag"

TIMING = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:ms|us|µs|s)\b"  # a duration
    r"|(?<![\w.])\d+\.\d+x\b"  # a measured ratio
    r"|(?<![\w.])\d+(?:\.\d+)?\s?(?:GB|MB|tokens|chunks|requests|req)/s\b"  # a rate
    r"|\b\d+-core\b"  # a machine description
)



def figures(source: str) -> list[tuple[int, str]]:
    """(line, text) of every timing figure in the comments and string statements of ``source``."""
    found: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found += [(tok.start[0], m.group(0)) for m in TIMING.finditer(tok.string)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for m in TIMING.finditer(node.value.value):
                found.append((node.lineno + node.value.value[: m.start()].count("\n"), m.group(0)))
    return found


def test_no_timing_figures_in_comments_or_docstrings() -> None:
    bad = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for p in sorted(PKG.rglob("*.py"))
           for line, text in figures(p.read_text())]
    assert bad == [], "move these figures to docs/results/ with their command; say why in the code:\n" + "\n".join(bad)


def test_the_pattern_finds_figures_and_only_figures() -> None:
    src = ('"""A step took 38 ms; packed: 62 us (1.75x) on a 2-core VM at 12 GB/s and 60.5 s; 4.3 tokens/s."""\n'
           "x = 1  # 3.8 ms -> 2.2 ms\n"
           'msg = "About 20 ms"  # a message, not a comment: only the comment is read\n'
           '"""Not figures: float32, 1e-4, p50 s, the 2nd pass, layers 0..3, TTFT x, v0.1.0, 8 chunks."""\n')
    assert sorted(t for _, t in figures(src)) == sorted(
        ["38 ms", "62 us", "1.75x", "2-core", "12 GB/s", "60.5 s", "4.3 tokens/s", "3.8 ms", "2.2 ms"])
