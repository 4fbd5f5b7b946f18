"""The forwards a plan runs, apart from the loop that runs plans (:mod:`kvrag.engine.runner`): one decode step of
the running requests (a verify step when some have drafts) and one packed prefill of parked requests' question
suffixes.

Both take the model's lock for the forward itself only; choosing tokens from the logits (greedy choices for the
whole batch in one operation, drafts accepted or dropped, text deltas) happens after it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvrag.engine.handle import Handle
from kvrag.engine.speculate import SpeculationConfig, accept_row, draft_rows
from kvrag.kv import batched, hf_cache
from kvrag.kv.pieces import SuffixPrefill

if TYPE_CHECKING:
    import threading

    from transformers import PreTrainedModel


class Forwards:
    """One engine's decode steps and packed suffix prefills.

    Args:
        model: the engine's model; lock: its lock (held for each forward).
        unbatchable: why the model cannot run a batched step (then each row is stepped alone), or None.
        speculation: prompt-lookup drafting (:mod:`kvrag.engine.speculate`).
    """

    def __init__(self, model: PreTrainedModel, lock: threading.RLock, unbatchable: str | None,
                 speculation: SpeculationConfig) -> None:
        self.model = model
        self.lock = lock
        self.unbatchable = unbatchable
        self.speculation = speculation
        self.windows = batched.windows(model)

    def step(self, rows: Sequence[Handle], stats: collections.Counter[str]) -> None:
        """One forward for every row (with drafts: a verify forward), then each row's token choices and text; a
        failure goes to every row's consumer."""
        drafts = draft_rows(rows, self.speculation) if self.unbatchable is None else None
        feeds = [[int(h.state.last)] + (drafts[i] if drafts else [])  # type: ignore[union-attr,arg-type]
                 for i, h in enumerate(rows)]
        try:
            with self.lock:
                if self.unbatchable is not None:
                    logits = torch.stack([self._single(h) for h in rows])
                elif drafts is None:
                    logits = batched.decode_step(self.model, [h.row for h in rows],  # type: ignore[misc]
                                                 [f[0] for f in feeds], self.windows)
                else:
                    logits = batched.verify_step(self.model, [h.row for h in rows], feeds,  # type: ignore[misc]
                                                 self.windows)
            greedy = logits.argmax(-1).tolist()  # every row's greedy choice at every position, in one operation
        except BaseException as e:  # noqa: BLE001 - each consumer gets the failure
            for h in rows:
                h.items.put(e)
                h.state = None
            return
        stats["steps"] += 1
        stats["rows_stepped"] += len(rows)
        stats["max_rows"] = max(stats["max_rows"], len(rows))
        stats["verify_steps"] += drafts is not None
        at = 0
        for h, feed in zip(rows, feeds, strict=True):
            stats["accepted"] += accept_row(h, feed, logits, greedy, at) - 1
            stats["drafted"] += len(feed) - 1
            at += len(feed)

    def _single(self, h: Handle) -> torch.Tensor:
        assert h.row is not None and h.state is not None and h.state.last is not None
        cache = h.row.buffer.as_cache(h.row.length)
        out, _ = hf_cache.forward(self.model, torch.tensor([h.state.last]), cache)
        return out[-1]

    def prefill_suffixes(self, suffixes: Sequence[SuffixPrefill]) -> tuple[torch.Tensor | None, BaseException | None,
                                                                            float]:
        """Parked requests' suffixes in one forward (:func:`kvrag.kv.batched.prefill_rows`): ``(logits [B, V], None,
        seconds)``, or ``(None, the failure, seconds)``."""
        t = time.perf_counter()
        try:
            with torch.inference_mode(), self.lock:
                logits = batched.prefill_rows(self.model, [s.row for s in suffixes], [s.ids for s in suffixes],
                                              self.windows)
        except BaseException as e:  # noqa: BLE001 - each request's caller gets it
            return None, e, time.perf_counter() - t
        return logits, None, time.perf_counter() - t


__all__ = ["Forwards"]
