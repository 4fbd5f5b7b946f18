"""Fusion methods: how the stale concatenation of independently computed chunk caches is repaired.

A method receives the *stale* KV of the reusable context (chunk caches placed at their global positions and
concatenated) and returns the cache the question suffix is prefilled against. Methods are registered by name and
built from specs such as ``"relaxkv:r=0.15"``.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import importlib
import threading
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from kvrag.errors import ConfigError
from kvrag.fusion.stats import MethodStats
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel

    from kvrag.jsontypes import JSONScalar
    from kvrag.kv.hf_cache import KVBuffer
    from kvrag.kv.pieces import Pace

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


class Bool:
    """Parameter type for flags given as strings in method specs ("true"/"false", "1"/"0", "yes"/"no").

    ``bool("false")`` is True, so ``FusionMethod.params`` entries use this instead of ``bool``.
    """

    def __new__(cls, raw: object) -> bool:  # type: ignore[misc]
        if isinstance(raw, bool | int):
            return bool(raw)
        s = str(raw).strip().lower()
        if s in _TRUE:
            return True
        if s in _FALSE:
            return False
        msg = f"expected a boolean (true/false/1/0/yes/no), got {raw!r}"
        raise ValueError(msg)


@dataclasses.dataclass(frozen=True)
class Span:
    """A contiguous run of context positions [start, end) with one origin.

    kind: 'prefix' (leading text computed exactly: position 0 onwards, nothing before it), 'chunk' (a stored,
    independently computed chunk cache) or 'text' (non-chunk text between chunks, computed independently on the
    fly like a chunk but not stored) or 'kept' (an earlier request's K/V computed in its context, moved to a new
    offset: :mod:`kvrag.engine.relocate`; stale like a chunk, but a learned repairer leaves it as it is).
    """

    start: int
    end: int
    kind: str
    key: str | None = None

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclasses.dataclass
class FusionInput:
    """Everything a fusion method may use.

    Attributes:
        model: the frozen transformers causal LM.
        rope: the model's RoPE (place / canonicalize keys).
        spec: the KV layout.
        token_ids: [Tc] context token ids (prefix + chunks + text), positions 0..Tc-1.
        keys: [L, H_kv, Tc, D] stale keys, RoPE applied at global positions (model dtype, model device).
        values: [L, H_kv, Tc, D] stale values.
        spans: ordered spans covering 0..Tc.
        suffix_ids: [S] question suffix ids, positions Tc..Tc+S-1 (the tokens prefilled after repair).
        canonical_keys: [L, H_kv, Tc, D] the same keys without RoPE (what a learned repairer consumes), when the
            caller has them; None: methods canonicalize the positions they need.
        buffer: the request's own :class:`~kvrag.kv.hf_cache.KVBuffer` when ``keys``/``values`` are views of it
            (the engine's zero-copy path): methods then write their fresh K/V into ``keys``/``values`` in place
            and the suffix prefill appends into the same buffer. None (e.g. tensors a test built): methods work
            on copies and never modify the inputs. Use :meth:`working_kv` and :meth:`cache_over`.
        chunk_prefix_ids: the ids every chunk cache was conditioned on (the engine's ``chunk_prefix_ids``), so a
            learned repairer can check it was trained on caches computed the same way.
        prompt_ids: [T] the prompt string's own ids, when they differ from ``token_ids`` + ``suffix_ids`` (a chunk
            spliced where its boundary falls inside a token, :attr:`kvrag.engine.planner.Plan.inexact_chunks`):
            a computation of the whole prompt (``full``, ``auto``'s last level) runs over them, as ``full`` does
            for the same prompt, and says so in :attr:`FusionOutput.prompt_tokenized`. The buffer has room for
            them.
    """

    model: PreTrainedModel
    rope: Rope
    spec: KVSpec
    token_ids: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    spans: list[Span]
    suffix_ids: torch.Tensor
    canonical_keys: torch.Tensor | None = None
    buffer: KVBuffer | None = None
    chunk_prefix_ids: tuple[int, ...] = ()
    prompt_ids: torch.Tensor | None = None

    def working_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values [L, H_kv, Tc, D] a method may overwrite: the request's buffer in place, else copies."""
        if self.buffer is not None:
            return self.keys, self.values
        return self.keys.clone(), self.values.clone()

    def owned(self) -> FusionInput:
        """This input if it owns its buffer, else one over copies of the stale KV in a buffer of their own (so
        several repair steps can each write in place, e.g. ``hybrid``)."""
        if self.buffer is not None:
            return self
        from kvrag.kv import hf_cache

        keys, values = self.keys.contiguous().clone(), self.values.contiguous().clone()
        return dataclasses.replace(self, keys=keys, values=values, buffer=hf_cache.KVBuffer.wrap(keys, values))

    def cache_over(self, keys: torch.Tensor, values: torch.Tensor) -> Cache:
        """The transformers cache holding the repaired context KV ``keys``/``values`` (from :meth:`working_kv`)
        that the suffix is prefilled against: the buffer itself (no copy) on the zero-copy path."""
        from kvrag.kv import hf_cache

        if self.buffer is not None and keys.data_ptr() == self.keys.data_ptr():
            return self.buffer.as_cache(self.context_len)
        return hf_cache.make_cache(keys, values, self.model.config)

    @property
    def context_len(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def reusable_mask(self) -> torch.Tensor:
        """[Tc] bool: True at positions whose KV was computed without the preceding context (may be stale)."""
        m = torch.zeros(self.context_len, dtype=torch.bool)
        for s in self.spans:
            if s.kind != "prefix":
                m[s.start : s.end] = True
        return m

@dataclasses.dataclass
class FusionOutput:
    """The repaired cache.

    Attributes:
        cache: a transformers cache covering the context (and the suffix when ``last_logits`` is set).
        last_logits: [V] next-token logits after the suffix, when the method already prefilled it (e.g. ``full``);
            None means the engine prefills the suffix against ``cache``.
        stats: what the method computed (:class:`~kvrag.fusion.stats.MethodStats`; ``to_dict()`` for JSON).
        prompt_tokenized: the cache covers :attr:`FusionInput.prompt_ids` (the prompt's own ids) instead of
            context + suffix; ``last_logits`` is then set.
    """

    cache: Cache
    last_logits: torch.Tensor | None = None
    stats: MethodStats = dataclasses.field(default_factory=MethodStats)
    prompt_tokenized: bool = False

    def reused(self, fetched: int) -> int:
        """How many of the ``fetched`` context tokens (their K/V read from the store or a kept conversation) still
        reach the answer with some of that K/V: none when the whole prompt was recomputed, else all but those
        recomputed at every layer (a selective method's targets nest, so the last layer's are recomputed at every
        layer: ``relaxkv:r=1`` leaves only the exact prefix reused)."""
        if self.prompt_tokenized or self.stats.recomputed_fraction >= 1:
            return 0
        per_layer = self.stats.recomputed_per_layer
        return max(0, fetched - (per_layer[-1] if per_layer else 0))


@dataclasses.dataclass(frozen=True)
class Observation:
    """What one request cost, as the engine measured it after the suffix prefill (:meth:`FusionMethod.observe`).

    Attributes:
        model: the model the request ran on.
        context_tokens / suffix_tokens: the request's shape (Tc, S).
        ttft_s: fetch + assemble + repair + suffix prefill seconds: the method's time to first token without
            computing missing chunk caches (what ``kvrag bench`` measures with a warm store).
        stats: the method's statistics for the request.
    """

    model: PreTrainedModel
    context_tokens: int
    suffix_tokens: int
    ttft_s: float
    stats: MethodStats


class FusionMethod(abc.ABC):
    """A registered repair strategy. Subclasses declare ``name`` and parse their parameters in ``__init__``."""

    name: ClassVar[str] = ""
    #: parameter name -> (type, default)
    params: ClassVar[dict[str, tuple[type, object]]] = {}
    #: False for methods that ignore the stale KV (``full``): the engine then skips fetching and assembling the
    #: chunk caches, and ``FusionInput.keys`` / ``values`` are empty ([L, H_kv, 0, D]).
    reads_cache: ClassVar[bool] = True
    #: True for methods that read the stale keys without RoPE (a learned repairer): the engine then also gathers
    #: the fetched chunks' canonical keys into ``FusionInput.canonical_keys`` (one copy, instead of the method
    #: rotating every placed key back).
    reads_canonical_keys: ClassVar[bool] = False

    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(self.params)
        if unknown:
            valid = ", ".join(f"{k} ({t.__name__}, default {d})" for k, (t, d) in self.params.items()) or "none"
            msg = f"method {self.name!r} got unknown parameter(s) {sorted(unknown)}; valid parameters: {valid}"
            raise ConfigError(msg)
        for k, (typ, default) in self.params.items():
            raw = kwargs.get(k, default)
            try:
                val = typ(raw) if raw is not None else None
            except (TypeError, ValueError, ArithmeticError) as e:  # int(inf): OverflowError
                msg = f"method {self.name!r}: parameter {k}={raw!r} is not a valid {typ.__name__}"
                raise ConfigError(msg) from e
            setattr(self, k, val)
        self.validate()

    def validate(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Raise ConfigError for out-of-range parameters."""

    @property
    def config(self) -> dict[str, JSONScalar]:
        return {k: getattr(self, k) for k in self.params}

    @abc.abstractmethod
    def fuse(self, inp: FusionInput) -> FusionOutput:
        """Repair ``inp``'s stale KV: in place when ``inp.buffer`` is set, else on copies (see
        :meth:`FusionInput.working_kv`); stored chunk caches are never modified."""

    def fuse_pieces(self, inp: FusionInput, pace: Pace) -> Generator[None, None, FusionOutput]:
        """:meth:`fuse` in pieces: a generator whose ``yield`` s are piece boundaries (the engine's runner runs a
        decode step of the running requests at each, :mod:`kvrag.kv.pieces`), returning what :meth:`fuse` returns
        -- bit for bit. Methods yield only where ``pace.due()`` (``yield from pace.boundary()``), so with no one
        else decoding they run as one piece. Default: :meth:`fuse` in one piece."""
        return self.fuse(inp)
        yield  # a generator  # pragma: no cover

    def observe(self, obs: Observation) -> None:  # noqa: B027 (optional hook, not abstract)
        """Called by the engine once per request this method served, after the suffix prefill; methods that
        adapt to the machine they run on (``auto``) learn from it. Default: nothing."""

    def kept_context_threshold(self, level: str | None, model: torch.nn.Module | None = None) -> float | None:
        """For the next turn of a kept conversation (:mod:`kvrag.engine.conversation`) of ``model``, whose context
        this method left at ``level`` (the request's ``MethodStats.auto_choice``): the first decode step's top-1
        probability the new turn must reach over the kept context, below which the request is computed with ``full``
        instead. None: the kept context is used as it is (default)."""
        return None

    def __repr__(self) -> str:
        args = ",".join(f"{k}={v}" for k, v in self.config.items())
        return f"{self.name}:{args}" if args else self.name


_REGISTRY: dict[str, type[FusionMethod]] = {}


def register(cls: type[FusionMethod]) -> type[FusionMethod]:
    """Class decorator registering a method under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


BUILTIN_METHODS = ("full", "stale", "relaxkv", "cacheblend", "epic", "prophetkv", "cacherepair", "hybrid", "auto", "ape")
"""Built-in method modules of :mod:`kvrag.fusion`; each registers itself on import."""


def load_builtin_methods() -> None:
    """Import (and so register) every built-in method module; a module not written yet is simply skipped."""
    for mod in BUILTIN_METHODS:
        try:
            importlib.import_module(f"kvrag.fusion.{mod}")
        except ModuleNotFoundError as e:  # a method under construction is simply not registered
            if e.name != f"kvrag.fusion.{mod}":
                raise


def available_methods() -> list[str]:
    load_builtin_methods()
    return sorted(_REGISTRY)


def parse_method_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Parse ``"name:k=v,k2=v2"`` into (name, {k: v}).

    Raises:
        ConfigError: ``spec`` is not a string, a parameter is not ``key=value``, or one is given twice."""
    if not isinstance(spec, str):
        msg = f"a method is named by a string such as 'stale' or 'relaxkv:r=0.15', got {spec!r}"
        raise ConfigError(msg)
    name, _, rest = spec.strip().partition(":")
    params: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = part.partition("=")
        if not eq or not k:
            msg = f"bad method parameter {part!r} in {spec!r}; expected name:key=value[,key=value]"
            raise ConfigError(msg)
        if k.strip() in params:
            msg = f"method parameter {k.strip()!r} given twice in {spec!r}; give it once"
            raise ConfigError(msg)
        params[k.strip()] = v.strip()
    return name, params


_SHARED: collections.OrderedDict[str, FusionMethod] = collections.OrderedDict()
_SHARED_LOCK = threading.Lock()
SHARED_METHODS = 256
"""Most instances :func:`shared_method` keeps (least recently used dropped: a server's clients may ask for many
parameter values)."""


def shared_method(spec: str | FusionMethod, **overrides: Any) -> FusionMethod:
    """The process's one instance for a method's canonical spec (``repr``), built on first use.

    Methods may carry loaded state (CacheRepair resolves, hashes and loads its checkpoint once per model and
    device), so the engine, the adapters, ``hybrid`` and ``auto`` all get their instances here instead of building
    new ones. Instances are safe to share between engines and models (per-model state is keyed by the model).
    """
    built = spec if isinstance(spec, FusionMethod) and not overrides else get_method(spec, **overrides)
    key = repr(built)
    with _SHARED_LOCK:
        kept = _SHARED.setdefault(key, built)
        _SHARED.move_to_end(key)
        while len(_SHARED) > SHARED_METHODS:
            _SHARED.popitem(last=False)
        return kept


def get_method(spec: str | FusionMethod, **overrides: Any) -> FusionMethod:
    """Build a method from a spec string (``"relaxkv:r=0.15"``) or return an instance unchanged."""
    if isinstance(spec, FusionMethod):
        return spec
    name, params = parse_method_spec(spec)
    valid = available_methods()
    if name not in _REGISTRY:
        hint = (" (ablation controls such as relaxkv-fullctx are registered by "
                "kvrag_bench.ablations.register_ablations())" if "-" in name else "")  # only where one was meant
        msg = f"unknown fusion method {name!r}; valid methods: {', '.join(valid)}{hint}"
        raise ConfigError(msg)
    params.update(overrides)
    return _REGISTRY[name](**params)

