"""The ways to run one batched step (a decode, verify or suffix-prefill step of :mod:`kvrag.kv.batched`), behind one
protocol, and the one check that chooses among them per model.

A backend names itself, says by name why it does not serve a model (``why_not``) and runs a step. The registry
(:data:`REGISTRY`, best first):

* ``fused`` -- :mod:`kvrag.kv.fused_step`: fused products and one kernel call per layer for RoPE, the K/V write and
  the attention (decode and verify steps);
* ``direct`` -- :mod:`kvrag.kv.direct`: the model's own modules in a loop of kvrag's (every step kind);
* ``hf`` -- the model's own forward with a pass-through cache, the row attention hooked in through ``kvrag_sdpa``:
  the reference every other backend must reproduce (the oracle), and what serves when none does.

The first step of each kind ("decode": plain and verify steps; "prefill": suffix prefills, from the first that
packs several rows, :func:`kvrag.kv.batched.prefill_rows`) of each model runs the oracle, then each backend that says
it serves the model, in registry order, over the same rows: the first whose
logits and written K/V are the oracle's bit for bit serves that kind from then on. A backend that fails or differs
is logged as a warning with the reason; where none matches, the oracle's K/V are put back and the oracle serves. A
module with forward hooks (which kvrag's own loops would skip) makes every step run the oracle while it has them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers.cache_utils import Cache

from kvrag.kv import direct, fused_step

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

KINDS = ("decode", "prefill")


@dataclasses.dataclass
class Step:
    """One step's inputs: ``ids`` / ``pos`` [B, 1] (one token per row) or [1, T] (rows packed), the 4D all-true mask
    transformers' mask builders pass through, ``keep`` (logits to keep: 0 all, n the last n, a 1D tensor those
    positions), the rows (:class:`kvrag.kv.batched.Row`) and how many tokens each feeds, each layer's window, and
    the attention function the model's own layers call (:func:`kvrag.kv.batched.attention`)."""

    model: PreTrainedModel
    ids: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    keep: int | torch.Tensor
    rows: Sequence[fused_step.StepRow]
    counts: Sequence[int]
    windows: Sequence[tuple[str, int | None]]
    attention: Callable[..., tuple[torch.Tensor, None]]


class Backend(Protocol):
    """A way to run a step: ``run`` returns the logits [B, kept, V] the model's forward returns for it."""

    @property
    def name(self) -> str: ...

    @property
    def kinds(self) -> tuple[str, ...]: ...

    def why_not(self, model: PreTrainedModel) -> str | None: ...

    def run(self, step: Step) -> torch.Tensor: ...


class _PassThroughCache(Cache):
    """The cache the oracle hands the model: ``update`` returns the fresh K/V unchanged (the attention writes them
    into each row's buffer)."""

    def __init__(self) -> None:
        super().__init__(layers=[])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


@dataclasses.dataclass(frozen=True)
class _Fused:
    name: str = "fused"
    kinds: tuple[str, ...] = ("decode",)

    def why_not(self, model: PreTrainedModel) -> str | None:
        return fused_step.why_not(model)

    def run(self, step: Step) -> torch.Tensor:
        return fused_step.forward(step.model, step.ids, step.pos, step.keep, step.rows, step.counts, step.windows)


@dataclasses.dataclass(frozen=True)
class _Direct:
    name: str = "direct"
    kinds: tuple[str, ...] = ("decode", "prefill")

    def why_not(self, model: PreTrainedModel) -> str | None:
        return direct.why_not(model)

    def run(self, step: Step) -> torch.Tensor:
        return direct.forward(step.model, step.ids, step.pos, step.keep, step.attention)


@dataclasses.dataclass(frozen=True)
class _Oracle:
    name: str = "hf"
    kinds: tuple[str, ...] = ("decode", "prefill")

    def why_not(self, model: PreTrainedModel) -> str | None:
        return None

    def run(self, step: Step) -> torch.Tensor:
        out = step.model(input_ids=step.ids, position_ids=step.pos, attention_mask=step.mask,
                         cache=_PassThroughCache(), use_cache=True, logits_to_keep=step.keep)
        return out.logits  # type: ignore[no-any-return]


ORACLE: Backend = _Oracle()
REGISTRY: tuple[Backend, ...] = (_Fused(), _Direct(), ORACLE)
"""Every backend, best first; the last is the oracle."""
BY_NAME = {b.name: b for b in REGISTRY}

_chosen: weakref.WeakKeyDictionary[PreTrainedModel, dict[str, str]] = weakref.WeakKeyDictionary()
_all_modules: weakref.WeakKeyDictionary[PreTrainedModel, list[dict[int, Any]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def hooked(model: PreTrainedModel) -> bool:
    """Whether ``model`` or any of its modules has forward hooks now (kvrag's loops call ``forward`` and would skip
    them). Asked every step: one pass of C over the modules' hook dictionaries, kept in a list per model."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    dicts = _all_modules.get(model)
    if dicts is None:
        dicts = _all_modules[model] = [d for m in model.modules() for d in (m._forward_hooks, m._forward_pre_hooks)]
    return any(map(len, dicts))


def why_not(model: PreTrainedModel, kind: str) -> dict[str, str | None]:
    """Per backend serving ``kind``: None where it says it serves ``model``, else why not (the oracle always
    serves)."""
    return {b.name: b.why_not(model) for b in REGISTRY if kind in b.kinds}


def chosen(model: PreTrainedModel, kind: str) -> str | None:
    """The backend serving ``kind`` steps of ``model`` (None: no such step has run yet)."""
    return _chosen.get(model, {}).get(kind)


def serves(model: PreTrainedModel, kind: str, name: str) -> bool:
    """Whether backend ``name`` serves ``model``'s ``kind`` steps now (chosen, and no hooks in the way)."""
    return chosen(model, kind) == name and (name == ORACLE.name or not hooked(model))


def choose(model: PreTrainedModel, kind: str, name: str | None) -> None:
    """Set (``name``) or forget (None: the next step checks again) the backend of ``model``'s ``kind`` steps."""
    if kind not in KINDS:
        raise ValueError(f"step kind {kind!r}: one of {KINDS}")
    if name is not None and (name not in BY_NAME or kind not in BY_NAME[name].kinds):
        raise ValueError(f"no backend {name!r} for {kind} steps ({[b.name for b in REGISTRY if kind in b.kinds]})")
    per = _chosen.setdefault(model, {})
    if name is None:
        per.pop(kind, None)
    else:
        per[kind] = name


def run(step: Step, kind: str) -> torch.Tensor:
    """``step`` through the backend chosen for ``model``'s ``kind`` steps (chosen now, on the first such step)."""
    name = chosen(step.model, kind)
    if name is None:
        with _lock:
            name = chosen(step.model, kind)
            if name is None:
                return _first(step, kind)
    b = BY_NAME[name]
    if b is not ORACLE and hooked(step.model):
        b = ORACLE
    return b.run(step)


def _written(step: Step) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(r.buffer.keys[:, :, r.length : r.length + n].clone(), r.buffer.values[:, :, r.length : r.length + n]
             .clone()) for r, n in zip(step.rows, step.counts, strict=True)]


def _same_kv(step: Step, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return all(torch.equal(k, r.buffer.keys[:, :, r.length : r.length + n])
               and torch.equal(v, r.buffer.values[:, :, r.length : r.length + n])
               for (k, v), r, n in zip(kv, step.rows, step.counts, strict=True))


def _first(step: Step, kind: str) -> torch.Tensor:
    """The first ``kind`` step of a model: the oracle, then each backend that serves the model until one computes
    the oracle's bits (its logits and the K/V it writes); that one is chosen."""
    model, name = step.model, type(step.model).__name__
    cands = []
    for b in REGISTRY:
        if kind not in b.kinds or b is ORACLE:
            continue
        why = b.why_not(model)
        if why is None and hooked(model):
            why = "forward hooks on the model or its modules"
        if why is None:
            cands.append(b)
        else:
            log.debug("%s %s steps: %s does not serve it: %s", name, kind, b.name, why)
    ref = ORACLE.run(step)
    if not cands:
        choose(model, kind, ORACLE.name)
        return ref
    kv = _written(step)
    for b in cands:
        try:
            got = b.run(step)
        except Exception:  # noqa: BLE001 -- any failure of a backend on this model: the next one
            log.warning("%s: the %s step failed; %s steps try the next backend", name, b.name, kind, exc_info=True)
            continue
        if torch.equal(got, ref) and _same_kv(step, kv):
            choose(model, kind, b.name)
            log.debug("%s %s steps: %s", name, kind, b.name)
            return ref
        log.warning("%s: the %s step differs from the model's forward with this torch / transformers version; %s "
                    "steps try the next backend", name, b.name, kind)
    for (k, v), r, n in zip(kv, step.rows, step.counts, strict=True):  # the oracle's K/V back
        r.buffer.keys[:, :, r.length : r.length + n].copy_(k)
        r.buffer.values[:, :, r.length : r.length + n].copy_(v)
    choose(model, kind, ORACLE.name)
    return ref


__all__ = ["BY_NAME", "KINDS", "ORACLE", "REGISTRY", "Backend", "Step", "choose", "chosen", "hooked", "run",
           "serves", "why_not"]
