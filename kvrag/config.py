"""Validated configuration dataclasses."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvrag.errors import ConfigError

DEFAULT_MODEL = "smollm2-135m-instruct"
"""Alias of the embedded default model (``load_model()`` / ``load_model(DEFAULT_MODEL)``; :mod:`kvrag.default_model`
prepares it)."""


def names_default_model(model: object) -> bool:
    """Whether ``model`` names the embedded default model: None, ``"default"`` (as the CLI's ``--model``) or
    :data:`DEFAULT_MODEL`."""
    return model is None or str(model) in ("default", DEFAULT_MODEL)

DEFAULT_METHOD = "auto:agree=0.9"
"""The engine's default fusion method (and the CLI's, the server's and the adapters'): the one that keeps the answer
``full`` gives (by measurement, see docs/results/fidelity.md), escalating the repair per request, up to ``full``,
where the first decode step is unsure (:mod:`kvrag.fusion.escalate`)."""
CHUNK_PREFIX_MODES = ("none", "template")
ON_STORE_ERROR = ("recompute", "raise")
KV_DTYPES = ("auto", "float32", "bfloat16", "int8")


def _whole(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _flag(v: object) -> bool:
    """A yes/no value: a bool, numpy's bool, or the integers 0 and 1 (JSON configs write them)."""
    return isinstance(v, bool | np.bool_) or (_whole(v) and v in (0, 1))


@dataclasses.dataclass
class GenerationConfig:
    """Decoding settings.

    Attributes:
        max_new_tokens: upper bound on generated tokens (>= 1).
        do_sample: sample instead of greedy argmax.
        temperature, top_p, top_k: sampling filters (top_k=0 disables it).
        seed: RNG seed for sampling (None: nondeterministic).
        stop: stop strings (one string is one stop); generation ends before the first occurrence, which is not
            returned.
    """

    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, ok, want in (("max_new_tokens", _whole(self.max_new_tokens), "a whole number of tokens"),
                               ("do_sample", _flag(self.do_sample), "True or False"),
                               ("temperature", _real(self.temperature), "a finite number"),
                               ("top_p", _real(self.top_p), "a finite number"),
                               ("top_k", _whole(self.top_k), "a whole number"),
                               ("seed", self.seed is None or _whole(self.seed), "a whole number or None")):
            if not ok:
                raise ConfigError(f"{name} must be {want}, got {getattr(self, name)!r}")
        self.max_new_tokens, self.top_k = int(self.max_new_tokens), int(self.top_k)
        self.do_sample, self.temperature, self.top_p = bool(self.do_sample), float(self.temperature), float(self.top_p)
        self.seed = None if self.seed is None else int(self.seed)  # torch's generator takes Python ints only
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ConfigError(f"temperature must be > 0, got {self.temperature} (use do_sample=False for greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        given = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop  # str: one stop
        stop = tuple(given) if isinstance(given, Iterable) else (given,)
        if not all(isinstance(s, str) for s in stop):
            raise ConfigError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = tuple(str(s) for s in stop if s)

    @classmethod
    def of(cls, gen: GenerationConfig | None = None, **kwargs: Any) -> GenerationConfig:
        """``gen``, or a config from keywords (``max_new_tokens=16, do_sample=True, temperature=0.7``): what a call
        that takes either (:meth:`KVRAGEngine.answer`) decodes with.

        Raises:
            ConfigError: ``gen`` and keywords together (the keywords would be ignored), or ``temperature`` /
                ``top_p`` / ``top_k`` without ``do_sample=True`` (greedy decoding would ignore them)."""
        if gen is not None and kwargs:
            msg = (f"pass either gen= or generation keywords, not both (got gen and {sorted(kwargs)}): the keywords "
                   "would be ignored")
            raise ConfigError(msg)
        if not kwargs.get("do_sample") and kwargs.get("temperature") == 0:  # how frameworks write greedy decoding
            kwargs = {k: v for k, v in kwargs.items() if k != "temperature"}
        sampling = sorted(k for k in ("temperature", "top_p", "top_k") if k in kwargs)
        if sampling and not kwargs.get("do_sample"):
            verb = "takes" if len(sampling) == 1 else "take"
            msg = (f"{', '.join(sampling)} {verb} effect only when sampling: pass do_sample=True to sample, or leave "
                   "them out for greedy decoding (the default)")
            raise ConfigError(msg)
        return gen if gen is not None else cls(**kwargs)


@dataclasses.dataclass
class EngineConfig:
    """Engine settings.

    Attributes:
        method: default fusion method spec (e.g. "relaxkv:r=0.15"); default :data:`DEFAULT_METHOD`
            (``auto:agree=0.9``), the method that keeps ``full``'s answers by measurement; ``stale`` is the fastest
            and changes the most answers.
        chunk_prefix: what each chunk is conditioned on when its cache is computed: "none" (the chunk alone) or
            "template" (after the chat template's fixed system header, which then also serves as attention sink).
            Part of the cache key. Default "template", by measurement (SmolLM2-135M-Instruct, qa_dev rows 0-19,
            ``kvrag bench --limit 20 --chunk-prefix none`` vs the same requests with "template"): KL(full || m)
            of ``stale`` 0.69 -> 0.60 and of ``relaxkv:r=0.15`` 0.129 -> 0.106 with the header; same TTFT.
        store_dtype: storage dtype name or None for the model dtype.
        max_context: override of the model's context window (None: from the config).
        on_store_error: what answering does when the KV store fails (Redis down, disk full): "recompute" logs a
            warning once, computes the needed caches on demand and uses the store again once it works;
            "raise" lets the StoreError propagate. ``ingest()`` always raises: storing is its purpose.
        store_retry_s: with "recompute", seconds to leave a failed store alone before trying it again.
        max_batch_size: most requests decoded together in one batched step (continuous batching,
            :mod:`kvrag.engine.scheduler`); further requests wait for a free place at a step boundary. Default 8: a
            step reads every weight once whatever the batch, while each row adds its own attention over its context
            (batch sizes measured in docs/results.md#many-users-at-once).
        kv_memory_bytes: bound on the KV bytes of the requests in flight (prompt + reserved answer tokens of each
            request buffer); a request that does not fit waits, in arrival order, until others finish (:mod:`kvrag.engine.lease`).
            None (default): ``max_batch_size`` requests of the full context window, capped at half the memory
            available on the model's device when the engine starts.
        speculative_tokens: most tokens drafted per greedy request and decode step by prompt lookup
            (:mod:`kvrag.engine.speculate`: the answer's last n-gram found in the prompt, the tokens after it
            verified in one forward); 0 turns speculative decoding off. Greedy answers are token-identical either way.
        speculative_ngram / speculative_min_ngram: the longest and the shortest answer suffix (tokens) looked up in
            the prompt, longest first (a one-token match drafts often and is accepted less; a minimum above the
            longest is capped to it).
        speculative_max_batch: drafts only while at most this many requests decode (vLLM's
            ``speculative_disable_by_batch_size``): a batch's step is no longer bound by reading the weights, and each
            drafted row adds to its products. Default 8, the default batch: a limit of 2 measured no clear win
            (docs/results.md#speculation-in-a-batch).
        runner_threads: torch intra-op threads of the runner thread, which runs every prepare and decode forward
            (:mod:`kvrag.engine.runner`; set for that thread alone, :func:`kvrag.threads.set_own_threads`); None:
            the process's setting. Give the runner the cores and the process's other threads one
            (``torch.set_num_threads(1)`` before loading the model): GNU OpenMP gives each thread that runs
            parallel work its own team, and once the teams hold more threads than the machine has cores it stops
            spinning between parallel regions, so each of a decode step's small operations pays a wake-up
            (docs/results.md#one-runner-thread-on-the-cores). ``kvrag serve`` does this
            (``--threads``). The tokens can differ from a run on another thread count (bf16 products may split
            their sums by threads); ``full`` equals ``model.generate`` run on the runner's count.
        admission_timeout_s: longest wait, in seconds, of a request in line for the KV memory bound (requests are
            admitted in arrival order); past it ``prepare`` raises :class:`~kvrag.errors.EngineBusyError` naming the
            bound. None: wait without limit.
        pack_suffixes: prefill the question suffixes of requests that arrive while nobody decodes in one forward
            (:func:`kvrag.kv.batched.prefill_rows`; each request computes exactly what it computes alone): a burst
            reads (and de-quantizes) the weights once for all its suffixes and gets its first tokens together. On by
            default, by measurement (docs/results.md#a-bursts-question-suffixes-in-one-forward-cpu-avx512bf16): a burst ends
            sooner and its TTFT p99 falls; when all its requests arrive at once, its TTFT p50 rises. The answers are
            the same either way.
        kv_dtype: the precision of the K/V a request decodes over: "auto" (default: the model's compute dtype, so
            ``full`` generates exactly what ``model.generate`` does), the compute dtype's name, or "bfloat16" under a
            float32 model (half the bytes each decode step reads per row and each request holds; the prompt's K/V
            are still computed, and chunk caches repaired, in the compute dtype, then rounded once when decoding
            starts), or "int8" (one byte a value plus a float32 scale per 32 values of a position, as llama.cpp's
            q8_0 cache: 72 bytes a position of a 64-dim head against bfloat16's 128; each position quantized once,
            when it is written; needs kvrag's row attention for int8 K/V: AVX512, head dims a multiple of 16,
            batched steps; :mod:`kvrag.kv.int8kv`).
            Stored chunk caches keep ``store_dtype``. The next-token cost of narrower K/V against the compute dtype's
            is measured in docs/results/kv_precision.md.
        strict_tokenization: a registered chunk whose own token ids do not occur in the tokenized prompt (its
            boundary token merges with the text around it, e.g. after indentation) is prefilled as text (True), or
            spliced anyway and counted as ``inexact_chunks`` in the response stats (False, default). Either way
            every other id of the plan is the tokenized prompt's (see :mod:`kvrag.engine.planner`).
        conversation_cache_bytes: most bytes of KV kept from answered requests, so that a later prompt extending
            one's prompt and answer (the next turn of a chat) reuses it and prefills only the new text
            (:mod:`kvrag.engine.conversation`); counted in ``kv_memory_bytes`` and given back when a request needs
            the room. None (default): a quarter of the KV bound; 0: off. Off with a ``kv_dtype`` narrower than the
            compute dtype: the prompt's K/V are quantized when decoding starts, so a kept turn would not have a
            prefill's bits.
        conversation_cache_entries: most answered requests kept (least recently used leave first).
        move_history: when a prompt holds a kept conversation's history after other chunks (a chat whose retrieved
            passages changed), reuse its kept K/V at the new position, repaired by the request's method, instead of
            prefilling it (:mod:`kvrag.engine.relocate`; never for ``full``).
    """

    method: str = DEFAULT_METHOD
    chunk_prefix: str = "template"
    store_dtype: str | None = None
    max_context: int | None = None
    on_store_error: str = "recompute"
    store_retry_s: float = 2.0
    strict_tokenization: bool = False
    max_batch_size: int = 8
    kv_memory_bytes: int | None = None
    runner_threads: int | None = None
    admission_timeout_s: float | None = 300.0
    speculative_tokens: int = 3
    speculative_ngram: int = 3
    speculative_min_ngram: int = 2
    speculative_max_batch: int = 8
    pack_suffixes: bool = True
    conversation_cache_bytes: int | None = None
    conversation_cache_entries: int = 64
    move_history: bool = True
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            msg = f"kv_dtype must be one of {list(KV_DTYPES)}, got {self.kv_dtype!r}"
            raise ConfigError(msg)
        if self.chunk_prefix not in CHUNK_PREFIX_MODES:
            msg = f"chunk_prefix must be one of {CHUNK_PREFIX_MODES}, got {self.chunk_prefix!r}"
            raise ConfigError(msg)
        if self.store_dtype not in (None, "float32", "float16", "bfloat16"):
            msg = f"store_dtype must be float32, float16, bfloat16 or None, got {self.store_dtype!r}"
            raise ConfigError(msg)
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"max_context must be >= 2, got {self.max_context}")
        if self.on_store_error not in ON_STORE_ERROR:
            msg = f"on_store_error must be one of {list(ON_STORE_ERROR)}, got {self.on_store_error!r}"
            raise ConfigError(msg)
        if not self.store_retry_s >= 0:
            raise ConfigError(f"store_retry_s must be >= 0 seconds, got {self.store_retry_s!r}")
        if not _whole(self.speculative_tokens) or self.speculative_tokens < 0:
            raise ConfigError(f"speculative_tokens must be an integer >= 0 (0: off), got {self.speculative_tokens!r}")
        if not _whole(self.speculative_ngram) or self.speculative_ngram < 1:
            raise ConfigError(f"speculative_ngram must be an integer >= 1, got {self.speculative_ngram!r}")
        if not _whole(self.speculative_min_ngram) or self.speculative_min_ngram < 1:
            raise ConfigError(f"speculative_min_ngram must be an integer >= 1, got {self.speculative_min_ngram!r}")
        if not isinstance(self.speculative_max_batch, int) or self.speculative_max_batch < 1:
            msg = f"speculative_max_batch must be an integer >= 1 (requests), got {self.speculative_max_batch!r}"
            raise ConfigError(msg)
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size must be an integer >= 1, got {self.max_batch_size!r}")
        if self.runner_threads is not None and (not isinstance(self.runner_threads, int) or self.runner_threads < 1):
            msg = f"runner_threads must be an integer >= 1 or None (the process's setting), got {self.runner_threads!r}"
            raise ConfigError(msg)
        if self.admission_timeout_s is not None and not self.admission_timeout_s >= 0:
            raise ConfigError(f"admission_timeout_s must be >= 0 seconds or None, got {self.admission_timeout_s!r}")
        if self.kv_memory_bytes is not None and (not isinstance(self.kv_memory_bytes, int) or self.kv_memory_bytes < 1):
            msg = f"kv_memory_bytes must be a positive number of bytes or None (automatic), got {self.kv_memory_bytes!r}"
            raise ConfigError(msg)
        cb, ce = self.conversation_cache_bytes, self.conversation_cache_entries
        if cb is not None and (not isinstance(cb, int) or cb < 0):
            raise ConfigError(f"conversation_cache_bytes must be a number of bytes >= 0 (0: off) or None, got {cb!r}")
        if not isinstance(ce, int) or ce < 1:
            raise ConfigError(f"conversation_cache_entries must be an integer >= 1, got {ce!r}")
