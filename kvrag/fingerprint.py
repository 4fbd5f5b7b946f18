"""Model, weights and tokenizer fingerprints: what a cache key and a learned repairer are tied to.

* :func:`model_fingerprint` — architecture config + compute dtype + a cheap digest of the weights (cache keys,
  :class:`kvrag.kv.spec.KVSpec`);
* :func:`weights_fingerprint` — architecture + weights, independent of the compute dtype (learned repairers);
* :func:`tokenizer_fingerprint` — the tokenizer's serialized backend, special tokens and chat template.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvrag.kv.spec import dtype_from_name

if TYPE_CHECKING:
    from collections.abc import Callable

    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

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
_SUM_CHUNK = 1 << 24  # elements per chunk of the exact integer checksum (bounds the int64 temporary of a uint8 sum)


def _config_for_fingerprint(config: PretrainedConfig) -> dict[str, object]:  # (some values are not JSON: dtypes)
    d = config.to_dict()
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in _FINGERPRINT_IGNORED_CONFIG_KEYS}


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor_digest(h: hashlib._Hash, name: str, tensor: torch.Tensor) -> None:
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


_DIGEST_ROWS = 1 << 22  # weights de-quantized at a time when digesting a GGUF-resident weight


def _resident_digest(h: hashlib._Hash, name: str, module: Any, dtype: torch.dtype) -> None:
    """:func:`_tensor_digest` of a GGUF-resident weight (:mod:`kvrag.kv.gguf_quant`) as the float tensor it stands
    for, in ``dtype``, de-quantized a few rows at a time: the digest of the same weights held as floats."""
    rows, cols = int(module.blocks.shape[0]), int(module.weight.shape[1])
    numel = rows * cols
    h.update(f"{name}|{(rows, cols)}|{dtype}|".encode())
    step = max(1, numel // _SAMPLE_ELEMENTS)
    per = max(1, _DIGEST_ROWS // cols)
    checksum, samples, last = 0, [], None
    int_view = _INT_VIEW[torch.empty((), dtype=dtype).element_size()]
    for r0 in range(0, rows, per):
        t = module.rows(torch.arange(r0, min(r0 + per, rows))).to(dtype).reshape(-1)
        bits = t.view(int_view)
        checksum += int(bits.sum(dtype=torch.int64).item())
        o = r0 * cols
        samples.append(t[(-o) % step :: step])
        last = t[-1:]
    sample = torch.cat([*samples, last]) if last is not None else torch.empty(0, dtype=dtype)
    h.update(str(checksum).encode())
    h.update(sample.contiguous().view(torch.uint8).numpy().tobytes())


def _state_digest(h: hashlib._Hash, model: PreTrainedModel, cast: torch.dtype | None = None) -> None:
    """Feed every parameter and persistent buffer into ``h`` in name order (floating ones cast to ``cast``).

    A GGUF-resident weight (a module holding a file's ``blocks``, :mod:`kvrag.kv.gguf_quant`) is digested as the
    float weight it stands for, in the compute dtype, under the parameter's name: the same weights held as floats
    (a de-quantized checkpoint of the same file) have the same digest."""
    resident = {n: m for n, m in model.named_modules() if hasattr(m, "qtype") and hasattr(m, "blocks")}
    state: dict[str, Any] = {}
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in resident and leaf in ("blocks", "ggml_type"):
            if leaf == "blocks":
                state[f"{prefix}.weight"] = resident[prefix]
            continue
        state[name] = tensor
    seen: dict[tuple[object, ...], str] = {}  # (device, address, dtype, shape, stride) -> the first name
    for name, item in sorted(state.items()):
        tensor = item if isinstance(item, torch.Tensor) else item.blocks
        # Tied weights (e.g. lm_head = embed_tokens) share storage: digest once, record the alias.
        ident = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and ident in seen:
            h.update(f"{name}|alias-of|{seen[ident]}|".encode())
            continue
        seen[ident] = name
        if not isinstance(item, torch.Tensor):
            _resident_digest(h, name, item, cast or item.dtype)
            continue
        _tensor_digest(h, name, tensor.to(cast) if cast is not None and tensor.is_floating_point() else tensor)


def _memo(model: PreTrainedModel, h: hashlib._Hash, compute: Callable[[hashlib._Hash], None]) -> str:
    """``compute(h)``'s digest, memoized in the file ``model._kvrag_digest_memo`` names (a GGUF model's prepared
    folder: its weights are fixed by the file) under the digest of what ``h`` holds so far."""
    path = getattr(model, "_kvrag_digest_memo", None)
    if path is None:
        compute(h)
        return str(h.hexdigest())
    key = h.copy().hexdigest()
    got = _memo_read(path).get(key)
    if isinstance(got, str):
        return got
    compute(h)
    return _memo_write(path, key, h.hexdigest())


def _memo_read(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        memo = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def _memo_write(path: str | os.PathLike[str], key: str, digest: str) -> str:
    """Record ``digest`` under ``key`` (written whole and renamed into place; a failed write only loses the memo)."""
    memo = _memo_read(path)
    memo[key] = digest
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, path)
    return digest


MODEL_FP_VERSION = b"kvrag-model-fp-v2\x00"
"""Bumped when what a model computes for the same weights changes in its bits, so caches computed before are not
reused: v2, prefill attention computed alike however a prompt is split (:func:`kvrag.kv.aligned.aligned_attention`)."""


@torch.no_grad()
def model_fingerprint(model: PreTrainedModel, dtype: torch.dtype | str | None = None,
                      quantize: str | None = None) -> str:
    """sha256 hex digest identifying what a model computes: architecture, compute dtype, weights and the weight
    quantization of its short products (:mod:`kvrag.kv.quant`; dense models hash as they always did).

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
        quantize: the quantization mode of its linear layers ("int4" / "int8"), None when dense.
    """
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    elif isinstance(dtype, str):
        dtype = dtype_from_name(dtype.removeprefix("torch."))
    h = hashlib.sha256()
    h.update(MODEL_FP_VERSION)
    h.update(json.dumps(_config_for_fingerprint(model.config), sort_keys=True, default=str).encode())
    h.update(f"\x00compute_dtype={dtype}\x00".encode())
    if quantize is not None:
        h.update(f"quantize={quantize}\x00".encode())
    return _memo(model, h, lambda hh: _state_digest(hh, model))


_WEIGHTS_FP: weakref.WeakKeyDictionary[PreTrainedModel, str] = weakref.WeakKeyDictionary()


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
    fp = _memo(model, h, lambda hh: _state_digest(hh, model, cast=torch.bfloat16))
    _WEIGHTS_FP[model] = fp
    return fp


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase, memo: str | os.PathLike[str] | None = None) -> str:
    """sha256 hex digest of everything that decides a tokenizer's token ids and rendered prompts.

    Covers the serialized backend (``backend_tokenizer.to_str()``: vocab, merges, normalizer, pre-tokenizer,
    post-processor, added tokens — with the runtime padding/truncation settings removed) or, for slow tokenizers,
    the sorted vocab; the special tokens; and the chat template.

    ``memo``: a JSON file in the folder the tokenizer was loaded from (a GGUF model's prepared folder) that keeps
    the digest, so a large vocabulary (Gemma 3's 262K tokens) is not serialized into memory again on every load. It
    is keyed by the folder's tokenizer files (name, size, modification time), the tokenizers and transformers
    versions and the tokenizer's cheap runtime state (its length, added tokens, special tokens, chat template,
    padding / truncation); a tokenizer loaded from elsewhere is digested as without it.
    """
    key = None if memo is None else _tokenizer_memo_key(tokenizer, memo)
    if memo is None or key is None:
        return _tokenizer_digest(tokenizer)
    got = _memo_read(memo).get(key)
    return got if isinstance(got, str) else _memo_write(memo, key, _tokenizer_digest(tokenizer))


def _tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
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
    h.update(json.dumps(_special_tokens(tokenizer), sort_keys=True).encode())
    h.update(b"\x00")
    h.update(json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True, default=str).encode())
    return h.hexdigest()


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, str]:
    return {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}


_TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "chat_template", "vocab", "merges",
                    "spiece", "sentencepiece")


def _tokenizer_memo_key(tokenizer: PreTrainedTokenizerBase, memo: str | os.PathLike[str]) -> str | None:
    """The memo key of a tokenizer loaded from ``memo``'s folder (see :func:`tokenizer_fingerprint`); None for
    one loaded from elsewhere or without a backend to serialize."""
    import tokenizers
    import transformers

    folder = Path(memo).parent
    source = getattr(tokenizer, "name_or_path", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not source or backend is None or not Path(source).is_dir() or Path(source).resolve() != folder.resolve():
        return None
    try:
        files = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.iterdir())
                 if p.name.startswith(_TOKENIZER_FILES)]
    except OSError:
        return None
    state = {"files": files, "versions": [tokenizers.__version__, transformers.__version__], "length": len(tokenizer),
             "added": {str(i): str(t) for i, t in sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())},
             "special": _special_tokens(tokenizer), "chat_template": getattr(tokenizer, "chat_template", None),
             "runtime": [str(getattr(backend, "padding", None)), str(getattr(backend, "truncation", None))]}
    raw = json.dumps(state, sort_keys=True, default=str).encode()
    return "tokenizer-fp-v1:" + hashlib.sha256(raw).hexdigest()


__all__ = ["model_fingerprint", "tokenizer_fingerprint", "weights_fingerprint"]
