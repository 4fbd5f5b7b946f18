"""README.md and docs/usage.md run as printed: every fenced ``python`` block, and the cheap ``kvrag`` lines of their
``bash`` blocks.

Each Python block runs in its own interpreter (``HF_HUB_OFFLINE=1``, ``-W error``: any Python warning, e.g. a
library's DeprecationWarning, is an error) in a scratch directory that holds an ``examples`` link to the
repository's examples, i.e. as a user would run it from the repository root, and must exit 0, print something, and
print no warning to stderr (a library's logged warning would reach the user just the same). The ``bash`` blocks'
command lines run in document order in another scratch directory (a line both documents show runs once); lines that
are too long or need outside services are listed in :data:`SKIPPED` with the reason, and a line that is neither run
nor listed fails the test, so a new command cannot go unchecked.

A block whose info string is ``python template`` or ``bash template`` is a template: it stands for the reader's own
model by the placeholder ``path/to/model.gguf`` (tests/unit/test_docs.py checks that templates, and only they, carry
it, marked for the reader by a first line ``# template: ...``). Here the placeholder is replaced by a real GGUF file,
the embedded default model's (:func:`kvrag.default_model.default_gguf_path`), so a template runs as the reader's
copy with their own file would.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The documents whose code blocks are run, in order (the README's commands first).
DOCUMENTS = (README, ROOT / "docs" / "usage.md")
PY_TIMEOUT_S = 300
CLI_TIMEOUT_S = 180

#: README command lines not run here, matched by regular expression against the line (comments stripped), with why.
SKIPPED: list[tuple[str, str]] = [
    (r"^make demo MODEL=", "make demo on the reader's model; test_examples.py runs the demo on a GGUF file"),
    (r"^make demo$", "sets up .venv and installs every package from PyPI (minutes); the test runs inside that setup"),
    (r"^make test$", "runs the whole suite, this test included"),
    (r"^pip install ", "installs packages from PyPI; the test runs in the environment those commands built"),
    (r"^kvrag bench( |$)", "a benchmark run (tens of minutes) on the qa_dev.jsonl data, with kvrag-bench installed"),
    (r"^kvrag train-repairer ", "trains a CacheRepair network (CPU-hours) on a passage corpus"),
    (r"^kvrag calibrate( |$)", "runs benchmark requests for minutes to fit this machine's cost model"),
    (r"^kvrag ingest .* --ray( |$)", "needs Ray workers and a shared store (a Redis Cluster)"),
    (r"^kvrag serve( |$)", "a server that runs until stopped; tests/integration/test_serve_clients.py starts and stops it"),
    (r"^curl ", "queries a running kvrag serve (the Python block after it does the same against a server it starts)"),
]

#: The placeholder for the reader's own model (a GGUF file) in template blocks; a real GGUF file replaces it here.
OWN_MODEL = "path/to/model.gguf"

#: A warning line on stderr: Python's ``warnings`` format (``...: DeprecationWarning: ...``) or a logged warning.
WARNING = re.compile(r"\b\w*Warning\b|^WARNING\b|\bwarn(ing)?:", re.IGNORECASE | re.MULTILINE)

#: ``kvrag`` subcommands cheap enough to run (seconds on the default model and the sample collection).
RUN_SUBCOMMANDS = ("pull", "ingest", "ask", "store")


def fenced_blocks(lang: str, doc: Path = README, *, template: bool = False) -> list[str]:
    """The bodies of a document's fenced code blocks of one language, in order: plain blocks (info string ``lang``),
    or with ``template=True`` the templates (info string ``lang template``)."""
    text = doc.read_text(encoding="utf-8")
    info = f"{lang} template" if template else lang
    return re.findall(rf"^```{info}\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def command_lines() -> list[str]:
    """Every command of the documents' bash blocks, templates included: continuations joined, comments and blank
    lines dropped, a line shown twice kept once."""
    out: list[str] = []
    for doc in DOCUMENTS:
        text = doc.read_text(encoding="utf-8")
        for block in re.findall(r"^```bash(?: template)?\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words and shlex.join(words) not in out:
                    out.append(shlex.join(words))
    return out


def skip_reason(line: str) -> str | None:
    return next((why for pattern, why in SKIPPED if re.search(pattern, line)), None)


def runnable(line: str) -> bool:
    words = shlex.split(line)
    return words[0] == "kvrag" and len(words) > 1 and words[1] in RUN_SUBCOMMANDS and skip_reason(line) is None


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # the repository (and, in a development checkout, the adapter sources) first, as `make test` imports them
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _scratch(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    d = tmp_path_factory.mktemp(name)
    (d / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    return d


@pytest.fixture(scope="module")
def own_model() -> str:
    """A real GGUF file for the templates' ``path/to/model.gguf``: the embedded default model's."""
    pytest.importorskip("gguf", reason="gguf not installed (pip install 'kvrag[gguf]')")
    from kvrag.default_model import default_gguf_path

    return str(default_gguf_path())


@pytest.fixture(scope="module")
def python_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One scratch 'repository root' for all Python blocks (they may share a store, as a user's runs would)."""
    return _scratch(tmp_path_factory, "readme-python")


#: (document, block body, is a template) for every Python block of the documents.
PY_BLOCKS = [(doc, code, template) for doc in DOCUMENTS for template in (False, True)
             for code in fenced_blocks("python", doc, template=template)]
PY_IDS = [f"{doc.stem}-python-{i}{'-template' if template else ''}" for i, (doc, _, template) in enumerate(PY_BLOCKS)]


def test_readme_has_code() -> None:
    plain = fenced_blocks("python")
    assert len(plain) >= 3, "README.md should show the engine, LlamaIndex and LangChain snippets"
    assert fenced_blocks("python", template=True), "README.md should show how to load one's own model (a template)"
    assert any(runnable(line) for line in command_lines()), "README.md should show runnable kvrag CLI lines"


def test_every_command_line_is_run_or_skipped_with_a_reason() -> None:
    lines = command_lines()
    unclassified = [line for line in lines if not runnable(line) and skip_reason(line) is None]
    assert unclassified == [], f"add these README lines to SKIPPED (with the reason) or make them runnable: {unclassified}"
    unused = [pattern for pattern, _ in SKIPPED if not any(re.search(pattern, line) for line in lines)]
    assert unused == [], f"SKIPPED entries that match no README line (remove them): {unused}"


@pytest.mark.parametrize("index", range(len(PY_BLOCKS)), ids=PY_IDS)
def test_python_block_runs(index: int, python_dir: Path, request: pytest.FixtureRequest) -> None:
    doc, code, template = PY_BLOCKS[index]
    if template:
        code = code.replace(OWN_MODEL, request.getfixturevalue("own_model"))
    name = f"{doc.relative_to(ROOT)} python block {PY_IDS[index]}"
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=python_dir, env=_env(),
                          capture_output=True, text=True, timeout=PY_TIMEOUT_S)
    assert proc.returncode == 0, f"{name} failed:\n{PY_BLOCKS[index][1]}\n--- stderr ---\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip(), f"{name} printed nothing"
    warned = [line for line in proc.stderr.splitlines() if WARNING.search(line)]
    assert warned == [], f"{name} printed warnings:\n" + "\n".join(warned)


def test_cli_lines_run(tmp_path_factory: pytest.TempPathFactory, own_model: str) -> None:
    """The runnable lines in document order (ingest before ask), each exiting 0 with output; in template lines the
    placeholder stands for the real GGUF file."""
    work = _scratch(tmp_path_factory, "readme-cli")
    ran = []
    for line in filter(runnable, command_lines()):
        argv = [sys.executable, "-m", "kvrag.cli", *shlex.split(line.replace(OWN_MODEL, own_model))[1:]]
        proc = subprocess.run(argv, cwd=work, env=_env(), capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        assert proc.returncode == 0, f"`{line}` exited {proc.returncode}:\n{proc.stderr[-4000:]}"
        assert (proc.stdout + proc.stderr).strip(), f"`{line}` printed nothing"
        ran.append(line)
    assert any(" ask " in f" {line} " for line in ran), "no `kvrag ask` line ran"
    assert any(OWN_MODEL in line for line in ran), "no template line ran on the reader's own model (a GGUF file)"
