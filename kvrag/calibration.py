"""What kind of machine this is, and what ``kvrag calibrate`` measured on it (``$KVRAG_HOME/calibration/``).

kvrag's speed trade-offs depend on the machine kind and the compute dtype: on a CPU without native bfloat16 units
bfloat16 is several times slower than float32; with AMX or AVX512-BF16 prefill is about twice as fast in bfloat16,
but decode may be slower; every fusion method's overhead over its FLOPs changes with both. :func:`machine_kind`
names the kind ('cpu-amx', 'cpu-avx512bf16', 'cpu-avx2', 'cpu', 'cuda-<device name>'); ``kvrag calibrate``
(:mod:`kvrag.calibrate`) times the model on it and writes one :class:`Calibration` file per kind, holding per
dtype the prefill and decode speeds, each method's TTFT and end-to-end time, and ``auto``'s cost model for that
kind and dtype. :func:`load_calibration` reads it back (the default dtype policy and ``auto`` use it).

This module is light on purpose (no model, engine or fusion imports): the model loader reads it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from kvrag.paths import kvrag_home

if TYPE_CHECKING:
    from kvrag.jsontypes import JSONObject, JSONValue

log = logging.getLogger(__name__)

CALIBRATION_FORMAT = "kvrag-calibration"
CALIBRATION_VERSION = 1
ANSWER_TOKENS = 32
"""Tokens of the typical answer in the end-to-end time (TTFT + ANSWER_TOKENS x decode time per token)."""
DEFAULT_METHOD = "stale"
"""The method whose end-to-end time decides :attr:`Calibration.preferred_dtype` (the engine's default method)."""
KV_BATCH = 8
"""Rows decoding at once when calibrate times each K/V dtype (the engine's default ``max_batch_size``): K/V
precision matters where many rows read their own K/V in one step."""
KV_KL_BUDGET = 1e-3
"""Most mean next-token KL (nats) a narrower K/V dtype may cost against the compute dtype's K/V to be preferred."""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from the kernel (Linux ``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[-1].split())
    return frozenset()


def machine_kind(device: torch.device | str | None = None) -> str:
    """The kind of machine a model runs on, as far as kvrag's speed trade-offs go.

    CPU: 'cpu-amx' (AMX bf16 tiles), 'cpu-avx512bf16' (AVX512-BF16), 'cpu-avx2' (neither: bfloat16 runs through
    conversions), 'cpu' (flags unknown, e.g. not Linux). The bf16 flags are the ones ``kvrag.models`` reads for
    its dtype default. CUDA: 'cuda-' + the device name, lower case, e.g. 'cuda-nvidia-h100-80gb-hbm3'.
    Other devices: their type.

    Args:
        device: the device the model runs on (default: cuda when available, else cpu).
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev.index if dev.index is not None else torch.cuda.current_device())
        return "cuda-" + (re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown")
    if dev.type != "cpu":
        return dev.type
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "cpu-amx"
    if "avx512_bf16" in flags:
        return "cpu-avx512bf16"
    return "cpu-avx2" if "avx2" in flags else "cpu"


def calibration_dir() -> Path:
    """Where ``kvrag calibrate`` writes: ``$KVRAG_HOME/calibration``."""
    return kvrag_home() / "calibration"


def calibration_path(kind: str) -> Path:
    """The calibration file of a machine kind."""
    return calibration_dir() / f"{kind}.json"


@dataclasses.dataclass
class DtypeCalibration:
    """What calibrate measured in one compute dtype.

    Attributes:
        dtype: 'float32' | 'bfloat16' | 'float16'.
        prefill_tokens_per_s: a full prefill's speed at ~1.5K tokens (median over the workload's requests).
        decode_ms_per_token: one greedy decode step at ~1.5K tokens of context.
        ttft_s: median TTFT per method spec (warm store).
        e2e_s: per method, TTFT + :data:`ANSWER_TOKENS` x ``decode_ms_per_token`` (decode costs the same after
            every method: the cache has the same shape).
        cost_model: ``auto``'s cost model for this machine kind and dtype (the JSON form of
            :class:`kvrag.fusion.cost_model.CostModel`), or None.
        kv_decode_ms_per_token: per K/V dtype decode may read in this compute dtype (``EngineConfig.kv_dtype``:
            the compute dtype, bfloat16 under float32, int8), ms per token of :data:`KV_BATCH` rows decoding at once at
            ~1.5K tokens of context, interleaved (empty: only the compute dtype serves).
        kv_kl: per narrower K/V dtype, the mean next-token KL against the compute dtype's K/V along a greedy answer.
    """

    dtype: str
    prefill_tokens_per_s: float
    decode_ms_per_token: float
    ttft_s: dict[str, float] = dataclasses.field(default_factory=dict)
    e2e_s: dict[str, float] = dataclasses.field(default_factory=dict)
    cost_model: CostModelRecord | None = None
    kv_decode_ms_per_token: dict[str, float] = dataclasses.field(default_factory=dict)
    kv_kl: dict[str, float] = dataclasses.field(default_factory=dict)

    def preferred_kv_dtype(self) -> str | None:
        """The K/V dtype to decode over in this compute dtype: the fastest of those within :data:`KV_KL_BUDGET`
        of the compute dtype's K/V at :data:`KV_BATCH` rows; None when calibrate did not compare any."""
        ok = {k: t for k, t in self.kv_decode_ms_per_token.items()
              if k == self.dtype or self.kv_kl.get(k, math.inf) <= KV_KL_BUDGET}
        return min(ok, key=ok.__getitem__) if len(self.kv_decode_ms_per_token) > 1 and ok else None

    def end_to_end(self, method: str = DEFAULT_METHOD) -> float | None:
        """TTFT + :data:`ANSWER_TOKENS` decode steps of ``method`` (None: not measured)."""
        return self.e2e_s.get(method)


class CandidateRecord(TypedDict, total=False):
    """A :class:`~kvrag.fusion.cost_model.Candidate`'s JSON form (an entry of a cost model's ``methods``)."""

    spec: str
    kl: float
    ttft_ratio: float
    flop_share: float
    overhead: float
    overhead_p90: float | None  # absent (or None) in files fitted before the p90: the median is used
    stats: JSONObject  # MethodStats.to_dict(); version 1 also holds repairer_flops_per_token here
    repairer_flops_per_token: float | None


class ModelCostRecord(TypedDict):
    """A :class:`~kvrag.fusion.cost.ModelCost`'s JSON form."""

    num_layers: int
    state_flops: float
    pair_flops: float
    head_flops: float


class CostModelRecord(TypedDict, total=False):
    """A cost model's JSON form (an ``auto_cost.json`` file, or a calibration's ``cost_model`` of one dtype): what
    :meth:`kvrag.fusion.cost_model.CostModel.to_dict` writes; ``hardware`` .. ``model`` are its ``info``."""

    format: str
    version: int
    source: str
    machine_kind: str | None
    dtype: str | None
    methods: dict[str, CandidateRecord]
    seconds_per_flop: float | None
    torch_threads: int | None
    model_cost: ModelCostRecord | None
    hardware: JSONValue  # what it was fitted on (a bench summary's hardware record)
    git_sha: JSONValue
    n_requests: int | None
    model: str


class _DtypeMeasured(TypedDict):
    dtype: str
    prefill_tokens_per_s: float
    decode_ms_per_token: float


class DtypeRecord(_DtypeMeasured, total=False):
    """A :class:`DtypeCalibration`'s JSON form."""

    ttft_s: dict[str, float]
    e2e_s: dict[str, float]
    cost_model: CostModelRecord | None
    kv_decode_ms_per_token: dict[str, float]
    kv_kl: dict[str, float]


class MachineDescription(TypedDict, total=False):
    """The machine a calibration was measured on (:func:`kvrag.calibrate.describe_machine`)."""

    cpu: str | None
    cores: int | None
    bf16_units: list[str]
    gpu: str | None


class CalibrationRecord(TypedDict, total=False):
    """A calibration file (:meth:`Calibration.to_dict`)."""

    format: str
    version: int
    machine_kind: str
    model: str
    torch_threads: int
    dtypes: dict[str, DtypeRecord]
    hardware: MachineDescription


@dataclasses.dataclass
class Calibration:
    """One machine kind's calibration (one file under :func:`calibration_dir`).

    Attributes:
        machine_kind: :func:`machine_kind` of the device it was measured on.
        model: the model it was measured with; torch_threads: the torch threads it ran with.
        dtypes: variant (:func:`variant_key`: dtype, and the weight quantization if any) -> :class:`DtypeCalibration`.
        hardware: a description of the machine (CPU model, cores, ...); path: the file it was read from.
    """

    machine_kind: str
    model: str
    torch_threads: int
    dtypes: dict[str, DtypeCalibration] = dataclasses.field(default_factory=dict)
    hardware: MachineDescription = dataclasses.field(default_factory=lambda: MachineDescription())
    path: str | None = None

    def _fastest(self, keys: list[str]) -> str | None:
        timed = {k: self.dtypes[k].end_to_end() for k in keys}
        known = {k: t for k, t in timed.items() if t is not None}
        return min(known, key=known.__getitem__) if known else None

    @property
    def preferred_dtype(self) -> str | None:
        """The dtype with the lower end-to-end time (TTFT + 32 decode steps) of the default method ``stale``, in
        whichever weight quantization it was fastest; None when no variant has it."""
        best = self._fastest(list(self.dtypes))
        return None if best is None else split_variant(best)[0]

    @property
    def timed_dtypes(self) -> set[str]:
        """The dtypes calibrate timed (in any weight quantization)."""
        return {split_variant(k)[0] for k in self.dtypes}

    def preferred_quantize(self, dtype: str) -> str | None:
        """For ``dtype``, the weight quantization ('none', 'int4', 'int8') with the lower end-to-end time, when
        calibrate timed at least two of them in that dtype; else None (no measurement decides)."""
        keys = [k for k in self.dtypes if split_variant(k)[0] == dtype]
        best = self._fastest(keys) if len(keys) >= 2 else None
        return None if best is None else split_variant(best)[1]

    def cost_model(self, dtype: str) -> CostModelRecord | None:
        """``auto``'s cost model for ``dtype`` on this machine kind (JSON form), or None: the one timed with the
        weight quantization preferred in that dtype, else with dense weights, else with any."""
        order = [variant_key(dtype, self.preferred_quantize(dtype)), dtype]
        order += sorted(k for k in self.dtypes if split_variant(k)[0] == dtype)
        c = next((self.dtypes[k] for k in order if k in self.dtypes and self.dtypes[k].cost_model), None)
        return c.cost_model if c is not None else None

    def to_dict(self) -> CalibrationRecord:
        d = dataclasses.asdict(self)
        return {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "machine_kind": d["machine_kind"],
                "model": d["model"], "torch_threads": d["torch_threads"], "dtypes": d["dtypes"],
                "hardware": d["hardware"]}

    @classmethod
    def from_dict(cls, d: CalibrationRecord, path: str | None = None) -> Calibration:
        if d.get("format") != CALIBRATION_FORMAT:
            msg = f"{path or 'the file'} is not a kvrag calibration (format {CALIBRATION_FORMAT})"
            raise ValueError(msg)
        dtypes = {k: DtypeCalibration(**v) for k, v in (d.get("dtypes") or {}).items()}
        return cls(machine_kind=str(d["machine_kind"]), model=str(d.get("model", "")),
                   torch_threads=int(d.get("torch_threads") or 1), dtypes=dtypes, hardware=d.get("hardware") or {},
                   path=path)


def variant_key(dtype: str, quantize: str | None) -> str:
    """The key of one timed variant in :attr:`Calibration.dtypes`: the dtype, plus ``+int4`` / ``+int8`` when the
    weights were quantized."""
    return dtype if quantize in (None, "none") else f"{dtype}+{quantize}"


def split_variant(key: str) -> tuple[str, str]:
    """(dtype, quantization or 'none') of a :func:`variant_key`."""
    dtype, _, quant = key.partition("+")
    return dtype, quant or "none"


def load_calibration(kind: str | None = None) -> Calibration | None:
    """The calibration ``kvrag calibrate`` wrote for a machine kind (default: this machine's), or None.

    A file that cannot be read is logged and ignored (kvrag then uses its shipped defaults).
    """
    p = calibration_path(kind or machine_kind())
    if not p.is_file():
        return None
    try:
        return Calibration.from_dict(json.loads(p.read_text()), str(p))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the calibration file %s (%s); rerun `kvrag calibrate` to rewrite it", p, e)
        return None


def save_calibration(cal: Calibration, path: str | Path | None = None) -> Calibration:
    """Write ``cal``, keeping the other dtypes of an existing file for the same kind, model and thread count.

    Returns:
        The calibration written (merged), with ``path`` set (default: :func:`calibration_path` of its kind).
    """
    p = Path(path) if path else calibration_path(cal.machine_kind)
    old = None
    if p.is_file():
        try:
            old = Calibration.from_dict(json.loads(p.read_text()), str(p))
        except (OSError, ValueError, KeyError, TypeError):
            old = None
    if old is not None and (old.machine_kind, old.model, old.torch_threads) == (cal.machine_kind, cal.model,
                                                                                cal.torch_threads):
        cal = dataclasses.replace(cal, dtypes={**old.dtypes, **cal.dtypes})
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cal.to_dict(), indent=2, sort_keys=True) + "\n")
    tmp.replace(p)
    return dataclasses.replace(cal, path=str(p))


__all__ = [
    "ANSWER_TOKENS",
    "KV_BATCH",
    "KV_KL_BUDGET",
    "Calibration",
    "DtypeCalibration",
    "calibration_dir",
    "calibration_path",
    "cpu_flags",
    "load_calibration",
    "machine_kind",
    "save_calibration",
    "split_variant",
    "variant_key",
]
