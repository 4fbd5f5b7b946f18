"""The manual's references resolve: links between README.md / docs/*.md (files and heading anchors), every
``docs/...md#anchor`` cited in a docstring or comment, and every paper section (``RelaxKV §3.2``, ``Table 4``) cited in
the code is explained in docs/methods.md's "Papers and section numbers". Every file under docs/results/ is linked
from a document, so that no measurement sits where no reader finds it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("kvrag", "integrations", "tests", "benchmarks", "examples")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    """A Markdown file's link targets: its headings' anchors and explicit ``<a name="...">`` / ``<a id="...">``."""
    text = re.sub(r"^```.*?^```", "", md.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    explicit = set(re.findall(r"<a (?:name|id)=\"([\w-]+)\"", text))
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE)} | explicit


def code_files() -> list[Path]:
    """Every Python file of the repository except this one (whose docstrings show the patterns it checks)."""
    me = Path(__file__).resolve()
    return [p for d in CODE_DIRS if (ROOT / d).is_dir() for p in (ROOT / d).rglob("*.py") if p.resolve() != me]


def test_slug() -> None:
    assert slug("A chunk's way through a request") == "a-chunks-way-through-a-request"
    assert slug("CPU with AMX / AVX512-BF16, bfloat16") == "cpu-with-amx--avx512-bf16-bfloat16"


def local_links(md: Path) -> list[str]:
    """The targets of a Markdown file's links and images outside fenced code, other sites' URLs left out."""
    text = re.sub(r"^```.*?^```", "", md.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", t)]


RESULTS = ROOT / "docs" / "results"


def linked_results() -> set[Path]:
    """Every file under docs/results/ that a reader reaches by following links from README.md, CHANGELOG.md and
    docs/*.md, through the result pages they link. A file also counts as reached when a reached file of the same
    folder shares its stem: ``decode.md`` linked brings ``decode.json`` and ``decode.png`` (what ``kvrag bench``
    writes side by side). A link to a folder reaches nothing by itself."""
    seen: set[Path] = set()
    todo = [p.resolve() for p in DOCS if p.exists()]
    while todo:
        md = todo.pop()
        for target in local_links(md):
            dest = (md.parent / target.partition("#")[0]).resolve()
            if dest.is_file() and dest.is_relative_to(RESULTS.resolve()) and dest not in seen:
                seen.add(dest)
                if dest.suffix == ".md":
                    todo.append(dest)
    stems = {(p.parent, p.name.split(".")[0]) for p in seen}
    return seen | {p.resolve() for p in RESULTS.rglob("*") if p.is_file()
                   and (p.resolve().parent, p.name.split(".")[0]) in stems}


def test_every_results_file_is_linked() -> None:
    files = sorted(p for p in RESULTS.rglob("*") if p.is_file())
    assert files, "docs/results/ holds no files"
    unlinked = [str(p.relative_to(ROOT)) for p in files if p.resolve() not in linked_results()]
    assert unlinked == [], (
        "files under docs/results/ that no document links (directly, through a linked result page, or as the "
        ".json/.png beside a linked .md of the same stem): " + ", ".join(unlinked) + ". Link each from the section of "
        "docs/results.md (or of the result page) that quotes its figures, e.g. [decode](results/<topic>.md), or "
        "`git rm` it if a newer run replaced it (git keeps it; say so in CHANGELOG.md).")


@pytest.mark.parametrize("md", DOCS + sorted(RESULTS.rglob("*.md")), ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_links_resolve(md: Path) -> None:
    if not md.exists():
        pytest.skip(f"{md.name} not written")
    bad = []
    for target in local_links(md):
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor")
    assert bad == []


def test_code_cites_docs_that_exist() -> None:
    bad = []
    for p in code_files():
        for path, anchor in re.findall(r"\b(docs/[\w./-]+\.md)(?:#([\w-]+))?", p.read_text(encoding="utf-8")):
            dest = ROOT / path
            if not dest.exists() or (anchor and anchor not in anchors(dest)):
                bad.append(f"{p.relative_to(ROOT)}: {path}#{anchor}")
    assert bad == []


# design notes and paper reconstructions that are not part of the repository (spelt in pieces so that a grep of the
# repository for them finds no false hit here)
OUTSIDE_FILES = re.compile("baselines" + r"\.md" + "|" + r"\b" + "DES" + "IGN" + r"\b")


def test_no_references_to_files_outside_the_repository() -> None:
    bad = [f"{p.relative_to(ROOT)}:{i}" for p in code_files()
           for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE_FILES.search(line)]
    assert bad == []


def test_cited_paper_sections_are_explained() -> None:
    """Every ``§X`` / ``Table N`` / ``Appendix X`` a module cites has a row in docs/methods.md's papers tables."""
    methods = (ROOT / "docs" / "methods.md").read_text(encoding="utf-8")
    papers = methods[methods.index("## Papers and section numbers"):]
    rows = set(re.findall(r"^\| ([^|]+?) \|", papers, flags=re.MULTILINE))
    cited = set()
    for p in code_files():
        text = p.read_text(encoding="utf-8")
        cited |= set(re.findall(r"§[0-9A-Z](?:\.[0-9]+)?", text))
        cited |= set(re.findall(r"\b(?:RelaxKV|CacheRepair|CacheBlend|EPIC) (Table \d+)", text))
    explained = {c for c in cited if c in rows or any(r.startswith(f"{c} ") for r in rows)}
    assert cited - explained == set()


#: The placeholder for the reader's own model that marks a code block as a template.
PLACEHOLDER = "path/to/"


@pytest.mark.parametrize("md", [ROOT / "README.md", ROOT / "docs" / "usage.md"], ids=lambda p: p.name)
def test_templates_are_marked(md: Path) -> None:
    """A block the reader cannot run as printed (it names ``path/to/...``, their own model) is a template: info string
    ``<lang> template`` (so tests/integration/test_readme.py runs it on a real file) and a first line
    ``# template: ...`` that tells the reader what to replace. Every other block runs as printed."""
    bad = []
    for info, body in re.findall(r"^```([^\n]*)\n(.*?)^```", md.read_text(encoding="utf-8"), flags=re.DOTALL | re.MULTILINE):
        template = info.endswith(" template")
        first = body.splitlines()[0] if body.strip() else ""
        if template and not first.startswith("# template: "):
            bad.append(f"```{info} block without a first line '# template: <what to replace>': {first!r}")
        if template and "path/to/model.gguf" not in body:
            bad.append(f"```{info} block without the placeholder path/to/model.gguf that the test replaces: {first!r}")
        if not template and PLACEHOLDER in body:
            bad.append(f"```{info} block names {PLACEHOLDER}... but is not marked '```{info} template': {first!r}")
    assert bad == []
