"""What the kvrag wheel ships: the product only (issue: a wheel without lab code).

The wheel is built from a copy of the source (``pip wheel --no-deps --no-build-isolation``, offline, seconds) and its
listing checked: no test helpers (kvrag-testing, ``testing/``), no ablation controls (kvrag-bench), no learning
curves, plots or model cards (docs/repairers/); but the type marker, the C sources of the kernels compiled on first
use, the shipped repairer's weights and the calibration data that runtime code reads.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    src = tmp_path_factory.mktemp("src")
    shutil.copy2(ROOT / "pyproject.toml", src)
    shutil.copy2(ROOT / "README.md", src)
    shutil.copytree(ROOT / "kvrag", src / "kvrag", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, text=True)
    (whl,) = out.glob("kvrag-*.whl")
    with zipfile.ZipFile(whl) as zf:
        return zf.namelist()


def test_the_wheel_holds_no_lab_code_nor_curves(wheel_names: list[str]) -> None:
    bad = [n for n in wheel_names if "testing" in n.split("/") or "ablation" in n or n.endswith((".png", ".jsonl"))
           or n.endswith("MODEL_CARD.md") or n.split("/")[0] in ("kvrag_testing", "kvrag_bench", "tests")]
    assert bad == []


def test_the_wheel_holds_what_runtime_code_reads(wheel_names: list[str]) -> None:
    names = set(wheel_names)
    shipped = "kvrag/data/repairers/smollm2-135m-instruct/"
    need = {"kvrag/py.typed", "kvrag/kv/int4_gemm.c", "kvrag/kv/row_attention.c", "kvrag/kv/ggml_dequant.c",
            "kvrag/data/auto_cost.json",
            "kvrag/data/calibration/passages.json", "kvrag/cli.py", "kvrag/fusion/relaxkv.py",
            *(shipped + f for f in ("repair_config.json", "repair_model.safetensors", "stats.safetensors"))}
    assert need - names == set()
    # every file of the source package that is not Python is either shipped above or deliberately left out
    data = {str(p.relative_to(ROOT)) for p in (ROOT / "kvrag").rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")}
    assert data - names == set()


def test_publish_keeps_cards_out_of_the_shipped_directory(tmp_path: Path) -> None:
    """``repair.card.publish`` writes what ``cacherepair`` loads to ``dest`` and the card, curve and plot to
    ``card_dest``; publishing to the shipped location sends them to docs/repairers/ (so the wheel never holds them)."""
    from kvrag.repair import card

    run = tmp_path / "run"
    run.mkdir()
    (run / "repair_config.json").write_text(json.dumps({"target": {"model_name": "m"}}))
    for f, b in (("repair_model.safetensors", b"w"), ("stats.safetensors", b"s")):
        (run / f).write_bytes(b)
    (run / card.CURVE).write_text('{"kind": "train", "step": 1, "loss": 0.5}\n')
    dest = card.publish(run, tmp_path / "ship", card_dest=tmp_path / "docs")
    assert sorted(p.name for p in dest.iterdir()) == sorted(card.FILES)
    assert {card.CARD, card.CURVE} <= {p.name for p in (tmp_path / "docs").iterdir()}
    assert card.DOCS_DIR == ROOT / "docs" / "repairers" and (card.DOCS_DIR / "smollm2-135m-instruct" / card.CARD).is_file()
