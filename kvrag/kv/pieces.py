"""Long prepares in pieces: :class:`Pace` says when a piece should end, :func:`forward_pieces` runs one model
forward in pieces that compute exactly what the whole call computes.

The runner (:mod:`kvrag.engine.runner`) runs a prepare job that is a generator up to its next ``yield``, then one
decode step for the running requests, then the next piece. A fusion method's ``fuse_pieces``
(:meth:`kvrag.fusion.base.FusionMethod.fuse_pieces`) yields where ``pace.due()`` says the piece has used its time,
so running streams keep getting tokens while a long ``full`` / ``relaxkv`` / ``hybrid`` prepare runs. Splitting
must not change a single bit of the result, so nothing is split along tokens (a chunked prefill changes GEMM shapes
and so the rounding). Instead the work runs exactly as in one call -- a whole-model forward (``full``, the suffix
prefill) in the model's own ``forward``, with every family's masks, position embeddings and quirks as transformers
computes them, and the selective recompute's and scoring pass's layer loops (:mod:`kvrag.fusion.recompute`,
:mod:`kvrag.fusion.scoring`) as they are -- on a helper thread that the runner thread hands the model to and takes it
back from: before each linear layer and attention kernel (:data:`CHECKPOINTS`, seen through a torch function mode,
which is thread-local, so other threads' forwards and compiled graphs are untouched) the helper asks the pace and,
when the piece is due, parks until the next piece. Only one of the two threads ever runs model work; the other
waits, so the runner's "one forward at a time" holds. What must not be in effect while other requests step (the
attention probe of :func:`kvrag.kv.hf_cache.capture_attention`) is entered around each piece, not around the call.

When nobody is decoding (the pace's budget is None) a piece never ends for time. A prepare whose caller can leave
(a pace with ``cancelled``, the runner's) still runs at the checkpoints, so that a cancellation -- a client that
disconnected or timed out -- ends the piece at the next one and the runner drops the prepare there instead of
finishing a long prefill nobody waits for; a question-sized forward (at most :data:`SHORT_FORWARD` tokens) runs whole.
Without ``cancelled`` and with nobody decoding the forward runs whole, in the calling thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Generator, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from kvrag.threads import set_own_threads

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel

    from kvrag.kv.batched import Row

T = TypeVar("T")

PIECE_OF_STEP = 0.5
"""A prepare piece's budget as a share of the recent decode step (:meth:`kvrag.engine.runner.Runner.piece_budget_s`):
while a prepare runs in pieces, a running stream waits one step plus one piece per token, so its inter-token
latency stays near one and a half steady steps (a piece may pass its budget when a unit of work takes longer than it did
in the previous decoder layer)."""

SHORT_FORWARD = 64
"""A forward of at most this many tokens runs whole while nobody decodes, even when it could be cancelled: a
question-sized forward ends soon anyway, and the checkpoints' per-call cost would be a larger share of it."""

Budget = Callable[[], "float | None"]
"""``budget()``: the seconds a piece may take now, or None when no other request waits for the model (then a
prepare runs as one piece)."""


class Pace:
    """When a prepare running in pieces should end its current piece (see the module docstring).

    Args:
        budget: the seconds a piece may take, asked at every check (None: never end a piece).
        device: the model's device; on an accelerator each check waits for the queued kernels, so the clock
            measures work done, not work launched.
        cancelled: whether the work was cancelled, asked at every check: then the piece ends there (the runner
            drops the prepare at that boundary). With it the work runs at the checkpoints also while nobody decodes.

    Attributes:
        paused_s: seconds spent between pieces (other requests' decode steps): callers subtract them from the
            prepare's own timings.
        pieces: how many times a piece ended.
    """

    def __init__(self, budget: Budget | None = None, device: torch.device | str = "cpu",
                 cancelled: Callable[[], bool] | None = None) -> None:
        self._budget = budget
        self._cancelled = cancelled
        self.device = torch.device(device)
        self.paused_s = 0.0
        self.pieces = 0
        self._start = self._last = time.perf_counter()
        self._paused_at = 0.0

    def waited_for(self) -> bool:
        """Whether another request waits for the model now (the budget is a number)."""
        return self._budget is not None and self._budget() is not None

    def active(self) -> bool:
        """Whether to run at the checkpoints: another request waits for the model, or the work can be cancelled."""
        return self._cancelled is not None or self.waited_for()

    def clock(self) -> float:
        """``time.perf_counter()``, after the queued kernels on an accelerator."""
        if self.device.type != "cpu":
            from kvrag.kv import hf_cache

            hf_cache.sync(self.device)
        return time.perf_counter()

    def due(self, next_s: float | None = None) -> bool:
        """Whether the piece should end here: someone waits for the model and the next unit of work -- ``next_s``
        seconds when the caller knows (e.g. the same linear layer's time in the previous decoder layer), else
        estimated as long as the time since the previous check -- would take the piece past its budget; or the work
        was cancelled."""
        if self._cancelled is not None and self._cancelled():
            return True
        if self._budget is None:
            return False
        budget = self._budget()
        if budget is None:
            return False
        now = self.clock()
        unit, self._last = (now - self._last if next_s is None else next_s), now
        return (now - self._start) + unit >= budget

    def pause(self) -> None:
        """The piece ends now (called right before the ``yield``)."""
        self.pieces += 1
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """The next piece starts now (called right after the ``yield``)."""
        now = time.perf_counter()
        self.paused_s += now - self._paused_at
        self._start = self._last = now

    def boundary(self) -> Generator[None, None, None]:
        """A possible piece boundary: ``yield from pace.boundary()`` yields once when the piece is due."""
        if self.due():
            self.pause()
            yield
            self.resume()


WHOLE = Pace()
"""A pace that never ends a piece (the unsplit call)."""


@dataclasses.dataclass(frozen=True)
class SuffixPrefill:
    """What a prepare job yields at its question suffix prefill: ``ids`` to prefill after ``row`` (a
    :class:`kvrag.kv.batched.Row` over the request's repaired cache). The runner prefills it
    (:func:`kvrag.kv.batched.prefill_rows`) -- alone, or in one forward with other parked requests' suffixes
    (``EngineConfig.pack_suffixes``) -- and sends the job back ``(logits [V], seconds)``: its next-token logits and
    its share of the forward's time (by tokens)."""

    row: Row
    ids: tuple[int, ...]


PrepareJob = Generator[SuffixPrefill | None, tuple[torch.Tensor, float], T]
"""A prepare job in pieces: it yields None at a piece boundary (resumed with ``next``) or a :class:`SuffixPrefill`
at its suffix prefill (resumed with ``send((logits [V], seconds))``), and returns its result."""


def run_whole(pieces: Generator[None, None, T]) -> T:
    """Drive a piece generator to its end (a generator given :data:`WHOLE` never yields) and return its value."""
    try:
        while True:
            next(pieces)
    except StopIteration as stop:
        return stop.value


class _Abort(BaseException):
    """Unwinds a parked forward whose prepare was closed between two pieces."""


CHECKPOINTS = frozenset({"linear", "_linear_pointwise", "_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm",
                         "scaled_dot_product_attention"})
"""The calls a forward in pieces may park before (by name): every linear layer -- ``F.linear``, and the packed
bfloat16 and int4 / int8 products that :mod:`kvrag.kv.linear` and :mod:`kvrag.kv.quant` give small inputs -- and
the attention kernel (SDPA): the units of a prefill's time, each short against a decode step, so a piece can end
close to its budget."""


class _Checkpoints(TorchFunctionMode):
    """Calls ``at(key)`` before every :data:`CHECKPOINTS` call of the forward it is active in (this thread only);
    ``key`` tells calls of the same shape apart (the same unit of work in every decoder layer)."""

    def __init__(self, at: Callable[[Hashable], None]) -> None:
        super().__init__()
        self.at = at

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", None)
        if name in CHECKPOINTS:
            shape = getattr(args[1], "shape", None) if len(args) > 1 else None
            self.at((name, None if shape is None else tuple(shape)))
        return func(*args, **(kwargs or {}))


class _Parked:
    """One call run on a helper thread that parks at :class:`_Checkpoints` when the pace says the piece is due."""

    def __init__(self, fn: Callable[[], object], pace: Pace,
                 each_piece: Callable[[], contextlib.AbstractContextManager[object]] | None) -> None:
        self.fn, self.pace, self.each_piece = fn, pace, each_piece
        self._go = threading.Semaphore(0)  # the helper may run
        self._back = threading.Semaphore(0)  # the helper parked or finished
        self._abort = False
        self._units: dict[Hashable, float] = {}  # seconds of each kind of unit (by checkpoint key), last measured
        self._key: Hashable = None
        self._t = 0.0
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.threads = torch.get_num_threads()  # the driving thread's (the runner's own count, EngineConfig.runner_threads)
        self._own_threads = 0  # the count this helper runs on now (_fit_threads)
        self.thread = threading.Thread(target=self._run, name="kvrag-prepare-piece", daemon=True)

    def _fit_threads(self) -> None:
        """Run on the driving thread's count while nobody decodes, on one thread while others do: each OS thread
        that runs parallel work has its own OpenMP team, and once the teams outnumber the cores GNU OpenMP stops
        spinning between parallel regions, so every small operation of the decode steps between the pieces would
        pay a wake-up (see :mod:`kvrag.threads`). A count changed at a checkpoint takes effect at the next parallel
        region; a row's bits do not depend on it."""
        want = 1 if self.pace.waited_for() else self.threads
        if want != self._own_threads:
            set_own_threads(want)
            self._own_threads = want

    def _checkpoint(self, key: Hashable) -> None:
        self._fit_threads()
        now = self.pace.clock()
        if self._key is not None:
            self._units[self._key] = now - self._t  # what the unit that began at the previous checkpoint took
        self._key = key
        if self.pace.due(self._units.get(key)):
            self.pace.pause()
            self._back.release()
            self._go.acquire()
            if self._abort:
                raise _Abort
            self.pace.resume()
            self._fit_threads()
        self._t = time.perf_counter()

    def _run(self) -> None:
        try:
            if self.pace.device.type == "cuda" and self.pace.device.index is not None:  # the current device is per thread
                torch.cuda.set_device(self.pace.device)
            self._fit_threads()  # a new thread starts at torch's default count, not the runner's
            with torch.inference_mode(), _Checkpoints(self._checkpoint):
                self.result = self.fn()
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised in the driving thread
            self.error = e
        finally:
            self.done = True
            self._back.release()

    def _enter(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if self.each_piece is not None:
            stack.enter_context(self.each_piece())
        return stack

    def pieces(self) -> Generator[None, None, Any]:
        stack = self._enter()
        self.thread.start()
        try:
            while True:
                self._back.acquire()
                if self.done:
                    break
                stack.close()  # e.g. the attention probe is uninstalled while other requests step
                yield
                stack = self._enter()
                self._go.release()
        finally:
            if not self.done:  # closed between two pieces: unwind the parked call before anything else runs
                self._abort = True
                self._go.release()
                self._back.acquire()
            self.thread.join()
            stack.close()
        if self.error is not None:
            raise self.error
        return self.result


def call_pieces(
    fn: Callable[[], T], pace: Pace, each_piece: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
    *, short: bool = False,
) -> Generator[None, None, T]:
    """``fn()`` (model work) in pieces that end at :data:`CHECKPOINTS` where ``pace`` is due; the same computation
    as ``fn()`` itself, in the same order (see the module docstring). Runs ``fn()`` directly, in one piece, when the
    pace is not active, or when ``short`` work is waited for by nobody.

    ``each_piece``: a context manager factory entered (in the calling thread) around each piece, e.g.
    :func:`kvrag.kv.hf_cache.capture_attention`, which must not be in effect while other requests step."""
    if not pace.active() or (short and not pace.waited_for()):
        with contextlib.ExitStack() as stack:
            if each_piece is not None:
                stack.enter_context(each_piece())
            return fn()
    return (yield from _Parked(fn, pace, each_piece).pieces())


def forward_pieces(model: PreTrainedModel, input_ids: torch.Tensor, cache: Cache | None = None, *,
                   start: int | None = None, logits_to_keep: int = 1,
                   pace: Pace = WHOLE) -> Generator[None, None, tuple[torch.Tensor, Cache]]:
    """:func:`kvrag.kv.hf_cache.forward` in pieces (:func:`call_pieces`): bit-identical to the whole call."""
    from kvrag.kv import hf_cache

    return (yield from call_pieces(
        lambda: hf_cache.forward(model, input_ids, cache, start=start, logits_to_keep=logits_to_keep), pace,
        short=input_ids.shape[-1] <= SHORT_FORWARD))


__all__ = ["CHECKPOINTS", "PIECE_OF_STEP", "SHORT_FORWARD", "WHOLE", "Budget", "Pace", "PrepareJob", "SuffixPrefill",
           "call_pieces", "forward_pieces", "run_whole"]
