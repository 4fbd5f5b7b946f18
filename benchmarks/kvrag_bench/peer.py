"""Peer runners: the same model answering the same prompt text through another stack (no cache reuse).

``llamaindex-hf``: ``llama_index.llms.huggingface.HuggingFaceLLM`` wrapping the already-loaded model and tokenizer
(no download), greedy, the same ``max_new_tokens``, the prompt passed as already formatted (it is the exact string
kvrag's template renders, chat template included). Its TTFT is measured on its stream: ``ttft_s`` is the time to
the first non-empty text delta (what a user of ``stream_complete`` sees; ``TextIteratorStreamer`` may hold a token
back until a word is complete), ``first_token_s`` the time until ``generate`` chose its first token (read from a
logits processor), which is the number comparable with kvrag's ``ttft_s``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kvrag.errors import ConfigError

log = logging.getLogger(__name__)

PEERS = ("llamaindex-hf",)
_INSTALL = "pip install llama-index-core llama-index-llms-huggingface"


class _FirstTokenClock:
    """A transformers LogitsProcessor that records when generate first asks for next-token scores."""

    def __init__(self) -> None:
        self.t: float | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.t is None:
            self.t = time.perf_counter()
        return scores


class LlamaIndexHFPeer:
    """``HuggingFaceLLM`` over kvrag's loaded model.

    Args:
        engine: a :class:`kvrag.engine.engine.KVRAGEngine` whose model and tokenizer are reused.
    """

    name = "llamaindex-hf"

    def __init__(self, engine: Any) -> None:
        try:
            from llama_index.llms.huggingface import HuggingFaceLLM
        except ImportError as e:
            msg = f"the llamaindex-hf peer needs llama-index-llms-huggingface; install it with `{_INSTALL}`"
            raise ImportError(msg) from e
        self._cls = HuggingFaceLLM
        self.engine = engine
        self._llms: dict[int, Any] = {}

    def _llm(self, max_new_tokens: int) -> Any:
        if max_new_tokens not in self._llms:
            eng = self.engine
            eos = eng._eos_ids()
            tok = eng.tokenizer
            pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if eos else None)
            self._llms[max_new_tokens] = self._cls(
                model=eng.model,
                tokenizer=tok,
                model_name=str(getattr(eng.loaded, "name", "kvrag-model")),
                tokenizer_name=str(getattr(eng.loaded, "name", "kvrag-model")),
                context_window=int(eng.max_context),
                max_new_tokens=max_new_tokens,
                stopping_ids=list(eos),
                generate_kwargs={"do_sample": False, "pad_token_id": pad, "temperature": None, "top_p": None, "top_k": None},
                device_map=str(eng.model.device),
                is_chat_model=False,
            )
        return self._llms[max_new_tokens]

    def run(self, prompt: str, max_new_tokens: int) -> dict[str, Any]:
        """Stream one completion of the formatted ``prompt``; returns text and timings (seconds)."""
        llm = self._llm(max_new_tokens)
        clock = _FirstTokenClock()
        t0 = time.perf_counter()
        ttft = None
        text = ""
        for r in self._stream(llm, prompt, clock):
            if ttft is None and r.delta:
                ttft = time.perf_counter() - t0
            text = r.text
        total = time.perf_counter() - t0
        return {
            "text": text,
            "ttft_s": ttft if ttft is not None else total,
            "first_token_s": (clock.t - t0) if clock.t is not None else None,
            "total_s": total,
        }

    @staticmethod
    def _stream(llm: Any, prompt: str, clock: _FirstTokenClock) -> Any:
        from transformers import LogitsProcessorList

        saved = dict(llm.generate_kwargs)
        llm.generate_kwargs = {**saved, "logits_processor": LogitsProcessorList([clock])}
        try:
            yield from llm.stream_complete(prompt, formatted=True)
        finally:
            llm.generate_kwargs = saved


def make_peer(name: str, engine: Any) -> Any:
    """Build a peer runner by name (see :data:`PEERS`)."""
    if name == "llamaindex-hf":
        return LlamaIndexHFPeer(engine)
    msg = f"unknown peer {name!r}; valid peers: {', '.join(PEERS)}"
    raise ConfigError(msg)


def peer_available(name: str) -> bool:
    """Whether the packages a peer needs are importable."""
    if name == "llamaindex-hf":
        import importlib.util

        try:
            return importlib.util.find_spec("llama_index.llms.huggingface") is not None
        except ModuleNotFoundError:
            return False
    return False
