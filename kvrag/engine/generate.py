"""Token selection and per-request decoding state (greedy or sampling, EOS, stop strings, incremental text).

:class:`DecodeState` is what one request needs between decode steps, whoever runs the forward: it picks the next
token from that request's logits (its own seeded generator), ends on EOS, ``max_new_tokens`` or a stop string, and
turns the new token into a text delta. The batched scheduler (:mod:`kvrag.engine.runner`) keeps one per request;
:func:`decode` is the one-request loop over a transformers cache.

Text is decoded incrementally, as vLLM's detokenizer does (``prefix_offset`` / ``read_offset``): each step
decodes only the ids since the last emitted text plus the chunk before it, and emits what the new ids add, so a
step costs the same at token 10 and token 1000 (no whole-answer decode per step). The window keeps decoders that
strip a leading space (SentencePiece ``▁``) and byte-level merges right: both decodes start at the same id. A
window that ends inside a multi-byte character (``\\ufffd``) emits nothing until the character completes. Stop
strings are searched only where the new text could complete one, and a tail that could begin one is held back.
The concatenated deltas equal ``tokenizer.decode(ids, skip_special_tokens=True)`` of the whole answer (tested).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from kvrag.config import GenerationConfig
from kvrag.kv import hf_cache

if TYPE_CHECKING:
    from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase


def select_token(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None) -> int:
    """Pick the next token from logits [V]: argmax, or sample after temperature / top-k / top-p."""
    if not cfg.do_sample:
        return int(torch.argmax(logits))
    x = logits.float() / cfg.temperature
    if not bool(torch.isfinite(x.max())):  # a temperature so small that logits / T overflow: its limit, greedy
        return int(torch.argmax(logits))
    if cfg.top_k > 0:
        kth = torch.topk(x, min(cfg.top_k, x.shape[-1])).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        # stable: tied tokens keep index order, so the top token is argmax's (top_p -> 0 is greedy, ties too)
        probs_sorted, idx = torch.sort(torch.softmax(x, -1), descending=True, stable=True)
        cum = probs_sorted.cumsum(-1)
        drop = cum - probs_sorted > cfg.top_p  # keep the smallest set whose mass reaches top_p
        x[idx[drop]] = float("-inf")
    probs = torch.softmax(x, -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class IncrementalDetokenizer:
    """Generated ids -> text, decoding only a short window of recent ids per token (vLLM's offsets scheme).

    ``prefix`` .. ``read`` are the ids of the last emitted piece (context for the decoder), ``read`` .. end the ids
    not emitted yet.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def push(self, token: int) -> str:
        """Add one id; return the text it completes ("" while a multi-byte character is incomplete)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever the ids not emitted yet decode to (an incomplete character included), at the end."""
        if self.read >= len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]


class StopText:
    """The emitted text of one answer with its stop strings: cuts at the first stop, holds back a possible start."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.sent = 0

    def _hit(self, start: int) -> int | None:
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _holdback(self) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best

    def add(self, piece: str, final: bool = False) -> tuple[str, bool]:
        """Append decoded text; returns (what may be shown now, whether a stop string ended the answer)."""
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        cut = self._hit(start) if self.stops else None
        if cut is not None:
            out = self.text[self.sent : cut] if cut > self.sent else ""
            self.sent = max(self.sent, cut)
            return out, True
        safe = len(self.text) if final or not self.stops else len(self.text) - self._holdback()
        out = self.text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out, False


def generator_seed(seed: int) -> int:
    """The 32-bit seed of torch's CPU generator (a Mersenne Twister, which keeps a seed's low 32 bits) for any
    integer seed: 0 .. 2**32 - 1 as they are, every other (negative, or 2**32 and above, as OpenAI clients send)
    hashed, so that seeds equal in their low 32 bits (-1 and 2**63 - 1) no longer sample alike."""
    if 0 <= seed < 2**32:
        return seed
    digest = hashlib.blake2b(seed.to_bytes(seed.bit_length() // 8 + 1, "little", signed=True), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class DecodeState:
    """One request's decoding between steps: token choice, end conditions and text deltas.

    Call :meth:`advance` with the logits [V] of the request's next token; it returns the ``(token, delta)`` items
    to hand to the consumer (``token`` -1 for a final flush of withheld text) and sets :attr:`finished`. EOS ends
    the answer and is not returned; a stop string ends it before the stop. :attr:`needs_forward` says whether the
    chosen token must be fed back (the last allowed token is not).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, cfg: GenerationConfig, eos_ids: Sequence[int]) -> None:
        self.cfg = cfg
        self.eos = {int(e) for e in eos_ids}
        seed = cfg.seed if cfg.do_sample else None
        self.generator = None if seed is None else torch.Generator().manual_seed(generator_seed(seed))
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = StopText(cfg.stop)
        self.steps = 0
        self.last: int | None = None
        self.finished = False
        self.reason: str | None = None
        """Why the answer ended: ``"stop"`` (EOS or a stop string) or ``"length"`` (``max_new_tokens``)."""

    def advance(self, logits: torch.Tensor | None, token: int | None = None) -> list[tuple[int, str]]:
        """Choose the next token from ``logits`` [V] (or take ``token``, a greedy choice the caller made for a
        whole batch in one operation); the items to emit for it."""
        tok = int(token) if token is not None else select_token(logits, self.cfg, self.generator)  # type: ignore[arg-type]
        self.steps += 1
        if tok in self.eos:
            self.finished, self.reason = True, "stop"
            return self._flush()
        self.last = tok
        delta, stopped = self.stop.add(self.detok.push(tok))
        if stopped:  # a stop string completed, also at the last allowed token: OpenAI's finish_reason "stop"
            self.finished, self.reason = True, "stop"
            return [(tok, delta)]
        items = [(tok, delta)]
        if self.steps >= self.cfg.max_new_tokens:
            self.finished, self.reason = True, "length"
            items += self._flush()
        return items

    def _flush(self) -> list[tuple[int, str]]:
        rest, _ = self.stop.add(self.detok.flush(), final=True)
        return [(-1, rest)] if rest else []


@torch.inference_mode()
def decode(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cache: Cache,
    first_logits: torch.Tensor,
    cfg: GenerationConfig,
    eos_ids: Sequence[int],
    on_first_token: Callable[[], None] | None = None,
) -> Iterator[tuple[int, str]]:
    """Generate tokens for one request after a prefilled ``cache`` whose next-token logits are ``first_logits`` [V].

    Yields (token_id, text_delta) per generated token (and (-1, rest) for text withheld until the end); stop
    strings are withheld and cut. EOS ends generation and is not yielded. ``on_first_token`` is called once the
    first token is chosen (TTFT). The engine decodes through its batched scheduler instead; this loop serves
    callers with a plain transformers cache.
    """
    state = DecodeState(tokenizer, cfg, eos_ids)
    logits = first_logits
    while True:
        items = state.advance(logits)
        if state.steps == 1 and on_first_token is not None:
            on_first_token()
        yield from items
        if state.finished:
            return
        out, cache = hf_cache.forward(model, torch.tensor([state.last]), cache)
        logits = out[-1]


__all__ = ["DecodeState", "IncrementalDetokenizer", "StopText", "decode", "select_token"]
