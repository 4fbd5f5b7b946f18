"""Token selection and the decode loop (greedy or sampling, stop strings, streaming)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvrag.config import GenerationConfig
from kvrag.kv import hf_cache


def select_token(logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None) -> int:
    """Pick the next token from logits [V]: argmax, or sample after temperature / top-k / top-p."""
    if not cfg.do_sample:
        return int(torch.argmax(logits))
    x = logits.float() / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(x, min(cfg.top_k, x.shape[-1])).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        probs_sorted, idx = torch.sort(torch.softmax(x, -1), descending=True)
        cum = probs_sorted.cumsum(-1)
        drop = cum - probs_sorted > cfg.top_p  # keep the smallest set whose mass reaches top_p
        x[idx[drop]] = float("-inf")
    probs = torch.softmax(x, -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _stop_hit(text: str, stops: Sequence[str]) -> int | None:
    idx = [text.find(s) for s in stops]
    found = [i for i in idx if i >= 0]
    return min(found) if found else None


def _holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing chars could begin a stop string (kept back while streaming)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best


@torch.inference_mode()
def decode(
    model: Any,
    tokenizer: Any,
    cache: Any,
    first_logits: torch.Tensor,
    cfg: GenerationConfig,
    eos_ids: Sequence[int],
    on_first_token: Callable[[], None] | None = None,
) -> Iterator[tuple[int, str]]:
    """Generate tokens after a prefilled ``cache`` whose next-token logits are ``first_logits`` [V].

    Yields (token_id, text_delta) per generated token; the delta is the newly decodable text (stop strings are
    withheld and cut). EOS ends generation and is not yielded. ``on_first_token`` is called once the first token is
    chosen (TTFT).
    """
    gen = None
    if cfg.do_sample and cfg.seed is not None:
        gen = torch.Generator().manual_seed(cfg.seed)
    eos = set(int(e) for e in eos_ids)
    tokens: list[int] = []
    emitted = ""
    logits = first_logits
    for step in range(cfg.max_new_tokens):
        tok = select_token(logits, cfg, gen)
        if step == 0 and on_first_token is not None:
            on_first_token()
        if tok in eos:
            break
        tokens.append(tok)
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        cut = _stop_hit(text, cfg.stop) if cfg.stop else None
        if cut is not None:
            if cut > len(emitted):
                yield tok, text[len(emitted) : cut]
            return
        safe = len(text) - (_holdback(text, cfg.stop) if cfg.stop else 0)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            safe = min(safe, len(text) - 1)
        delta = text[len(emitted) : safe] if safe > len(emitted) else ""
        emitted += delta
        yield tok, delta
        if step + 1 < cfg.max_new_tokens:
            out, cache = hf_cache.forward(model, torch.tensor([tok]), cache)
            logits = out[-1]
    # flush anything withheld for a stop-string prefix that never completed
    if tokens:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if len(text) > len(emitted) and (_stop_hit(text, cfg.stop) is None):
            yield -1, text[len(emitted) :]
