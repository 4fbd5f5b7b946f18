"""What the endpoints call (:class:`KVRAGService`): the engine, the registered chunks, admission, limits, metrics.

A completion's path: the body validated (pydantic, :mod:`kvrag.serve.protocol`), the limits and the kvrag options
checked (:meth:`KVRAGService.check`), then, inside the request's :class:`~kvrag.serve.outcome.Outcome`: admission,
the plan and the prepare in worker threads (raced against the client leaving and the drain timeout), the decode in
the engine's batch. Nothing is reserved for a request that fails a check.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import statistics
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvrag import adapters
from kvrag.config import GenerationConfig
from kvrag.engine.cancel import current_token
from kvrag.errors import ConfigError, ContextLengthError, RequestCancelledError
from kvrag.serve import bodies
from kvrag.serve.bodies import Job, JSONObject, Kind
from kvrag.serve.config import ServeConfig, default_model_id
from kvrag.serve.errors import HTTPProblem
from kvrag.serve.method_files import refuse_paths
from kvrag.serve.metrics import Metrics
from kvrag.serve.outcome import Outcome
from kvrag.serve.protocol import ChatCompletionRequest, CompletionRequest
from kvrag.serve.quota import StoreQuota

if TYPE_CHECKING:
    from starlette.requests import Request

    from kvrag.engine.chunks import RegisteredChunk
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.engine.planner import Plan
    from kvrag.fusion.base import FusionMethod

T = TypeVar("T")

REGISTER_BATCH = 8
"""Most texts cached per step of a registration (a client that leaves stops it at the next piece of a step)."""
REGISTER_TOKENS = 2048
"""Most tokens a step of a registration prefills (a longer text is a step alone); each step counts as progress for
``/health``. A step's forward runs in the engine's turn, in pieces between running streams' decode steps
(:meth:`kvrag.engine.caching.ChunkCaching._model_work`)."""


class ChunkSync(Protocol):
    """A chunk table shared with other replicas (:class:`kvrag.serve.ray_serve.RayChunkSync`)."""

    async def push(self, texts: list[str]) -> None: ...

    async def pull(self) -> list[str]: ...


def _steps(texts: Sequence[T], lengths: list[int]) -> Iterator[list[T]]:
    """``texts`` in registration steps of at most :data:`REGISTER_BATCH` texts and :data:`REGISTER_TOKENS` tokens."""
    part: list[T] = []
    tokens = 0
    for t, n in zip(texts, lengths, strict=True):
        if part and (len(part) == REGISTER_BATCH or tokens + n > REGISTER_TOKENS):
            yield part
            part, tokens = [], 0
        part.append(t)
        tokens += n
    if part:
        yield part


class KVRAGService:
    """The endpoints' state and work.

    Args:
        engine: a :class:`~kvrag.engine.engine.KVRAGEngine` (one per process; it batches the requests itself).
        config: server settings.
    """

    def __init__(self, engine: KVRAGEngine, config: ServeConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServeConfig()
        self.model_id = self.config.model_id or default_model_id(str(getattr(engine.loaded, "name", "kvrag")))
        self.chunks = adapters.RecentChunks(self.config.max_registered_chunks, self.config.max_registered_chars)
        self.index_chunks: adapters.RecentChunks | None = None
        """The ``--persist`` index's chunks (:meth:`register_index`), apart from the clients' registrations, which
        are bounded by the server's limits and so could otherwise push the index's texts out."""
        self.index_passages = 0
        self.metrics = Metrics(engine)
        self.held = 0
        self.outcomes: set[Outcome] = set()
        self.durations: collections.deque[float] = collections.deque(maxlen=64)
        self.sync: ChunkSync | None = None
        """Optional table shared with other replicas: ``push(texts)`` after a registration, ``pull()`` before a
        plan (texts registered elsewhere since the last pull)."""
        self.registered_bytes = 0
        self._known: set[int] = set()
        self._reserved_bytes = 0  # new bytes of registrations checked and still running (check_texts)
        self.register_steps = 0  # registration steps done (progress for /health)
        self.draining = False
        self.aborted = asyncio.Event()
        self._progress: tuple[int, float] = (-1, time.monotonic())
        self._store_failed_at: float | None = None
        self.store_quota = StoreQuota(engine, self.config.max_store_bytes)
        # a request's own misses are stored only within the quota (this server's engine: its gate is this one)
        engine.store_gate = self.store_quota.room if self.config.max_store_bytes is not None else None
        self.default_method = engine.method(self.config.method) if self.config.method else None

    def outcome(self, endpoint: str, request: Request | None = None) -> Outcome:
        return Outcome(self, endpoint, request)

    def retry_after(self) -> int:
        return max(1, math.ceil(statistics.median(self.durations))) if self.durations else 1

    # ------------------------------------------------------------------------------------------- shutdown
    def drain(self) -> None:
        """Shutdown began: new requests are refused (503)."""
        self.draining = True

    def abort(self) -> None:
        """The drain timeout passed: every request in flight is cancelled and answered 503 / an error event."""
        self.draining = True
        self.aborted.set()
        for out in list(self.outcomes):
            out.token.cancel()

    # ------------------------------------------------------------------------------------------- chunks
    def check_sizes(self, texts: list[str], param: str = "texts") -> list[bytes]:
        """413 for more than ``--max-texts`` texts or one over ``--max-text-bytes`` (a registration's texts, a
        request's ``kvrag.chunks``: both are cached and stored). Returns the texts' UTF-8 bytes."""
        cfg = self.config
        if len(texts) > cfg.max_texts:
            raise HTTPProblem(413, f"{len(texts)} texts in {param}; the limit is {cfg.max_texts} "
                                   "(--max-texts): send them in several requests", param=param,
                              code="too_many_texts")
        encoded = [t.encode() for t in texts]
        for i, b in enumerate(encoded):
            if len(b) > cfg.max_text_bytes:
                raise HTTPProblem(413, f"{param}[{i}] has {len(b)} bytes; the limit is {cfg.max_text_bytes} "
                                       "(--max-text-bytes): register passages, not documents", param=f"{param}.{i}",
                                  code="text_too_large")
        return encoded

    def check_texts(self, texts: list[str]) -> int:
        """A registration's limits (:meth:`check_sizes`, ``--max-registered-bytes``), checked and its new bytes
        reserved at once (on the event loop, so concurrent registrations cannot all pass one check); give the
        returned reservation back with :meth:`unreserve` when the registration ends."""
        encoded = self.check_sizes(texts)
        cfg = self.config
        new = sum(len(b) for t, b in zip(texts, encoded, strict=True) if hash(t) not in self._known)
        used = self.registered_bytes + self._reserved_bytes
        if used + new > cfg.max_registered_bytes:
            raise HTTPProblem(413, f"registering {new} new bytes would pass the server's quota of "
                                   f"{cfg.max_registered_bytes} registered bytes ({used} used or being registered; "
                                   "--max-registered-bytes)", param="texts", code="registered_bytes_quota")
        self._reserved_bytes += new
        return new

    def unreserve(self, reserved: int) -> None:
        self._reserved_bytes -= reserved

    def check_lengths(self, texts: list[str], param: str = "texts") -> list[RegisteredChunk | None]:
        """400 naming the first text longer than ``--max-text-tokens`` or than a chunk can be (the context window
        less the chunk prefix), or holding a control token of the chat template, before any of them is cached; else
        the texts' identities (``KVRAGEngine.identify``: token ids and keys, which caching and planning then use
        without tokenizing again; None for whitespace)."""
        eng = self.engine
        room = int(eng.max_context) - len(eng.chunk_prefix_ids)
        limit = min(room, self.config.max_text_tokens)
        refs: list[RegisteredChunk | None] = []
        for i, t in enumerate(texts):
            if (hit := self.control_token_in(t)) is not None:
                raise HTTPProblem(400, f"{param}[{i}] contains {hit!r}, a control token of the model's chat template; "
                                       "register passages, not template text", param=f"{param}.{i}",
                                  code="control_token_in_content")
            try:
                (ref,) = eng.identify([t])
            except ContextLengthError:  # over the context window: counted again only to say by how much
                ref, n = None, len(eng.tokenize(t))
            else:
                n = 0 if ref is None or ref.token_ids is None else len(ref.token_ids)
            if n > limit:
                why = "--max-text-tokens" if limit < room else "a chunk of this model"
                raise HTTPProblem(400, f"{param}[{i}] has {n} tokens; at most {limit} ({why}): split it into "
                                       "passages", param=f"{param}.{i}", code="text_too_long")
            refs.append(ref)
        return refs

    def register(self, texts: list[str]) -> list[JSONObject]:
        """Cache (when missing) and register passages, :data:`REGISTER_BATCH` at a time, stopping when the request's
        cancel token is cancelled; one ``{"key", "cached", "tokens"}`` per text (key None for whitespace-only texts,
        which are neither cached nor registered)."""
        refs = self.check_lengths(texts)
        lengths = [0 if r is None or r.token_ids is None else len(r.token_ids) for r in refs]
        held = self.store_quota.reserve(sum(lengths))
        stored = 0  # tokens of the caches this registration stored
        token = current_token()
        out: list[JSONObject] = []
        try:
            for part in _steps([t if r is None else r for t, r in zip(texts, refs, strict=True)], lengths):
                if token is not None and token.cancelled:
                    raise RequestCancelledError("the registration was cancelled (its client left)")
                got = adapters.ensure_chunks(self.engine, part)
                self.register_steps += 1
                self.chunks.add([c for c, _ in got if c is not None])
                for c, was in got:
                    if c is not None and hash(c.text) not in self._known:
                        self._known.add(hash(c.text))
                        self.registered_bytes += len(c.text.encode())
                    if c is not None and not was and c.token_ids is not None:
                        stored += len(c.token_ids)
                out += [{"key": None if c is None else c.key, "cached": bool(was),
                         "tokens": 0 if c is None or c.token_ids is None else len(c.token_ids)} for c, was in got]
        finally:
            self.store_quota.settle(held, stored)
        return out

    def register_index(self, persist: str) -> int:
        """Register the chunks of a ``kvrag ingest`` index as ``kvrag ask`` renders them into prompts
        (:func:`kvrag.prompting.render_passage`; their caches are the ones ingest stored) and as their text alone
        (a client's template that writes a passage after one newline or a label, as LlamaIndex's QA template does
        its first node; cached when first found). Returns the count of passages."""
        from kvrag.index import ChunkIndex
        from kvrag.prompting import render_passage

        index = ChunkIndex.load(persist)
        texts = [render_passage(c.text) for c in index.chunks] + [c.text.strip() for c in index.chunks]
        table = adapters.RecentChunks(max(1, len(texts)), max(1, sum(map(len, texts))))  # holds them all
        table.add(texts)
        self.index_chunks = table
        self.index_passages = len(index.chunks)
        return self.index_passages

    def found_chunks(self, prompt: str) -> tuple[RegisteredChunk, ...]:
        """The registered chunks whose text occurs in ``prompt``: the clients' (most recent first), then the
        ``--persist`` index's."""
        refs = self.chunks.found_in(prompt)
        if self.index_chunks is None:
            return refs
        mine = {c.text for c in refs}
        found = [c for c in self.index_chunks.found_in(prompt) if c.text not in mine]
        # a passage's text alone inside its rendered form found too is the same passage: offered once
        return refs + tuple(c for c in found if not any(c.text != o.text and c.text in o.text for o in found))

    @property
    def registered(self) -> int:
        """Texts registered: the clients' and the ``--persist`` index's."""
        return len(self.chunks) + self.index_passages

    # ------------------------------------------------------------------------------------------- completions
    @functools.cached_property
    def control_tokens(self) -> tuple[str, ...]:
        """The tokenizer's special tokens that its chat template writes around turns (``<|im_start|>``, ...)."""
        tok = self.engine.tokenizer
        sample = adapters.render_chat(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                            {"role": "user", "content": "c"}])
        specials = set(tok.all_special_tokens) | {t.content for t in tok.added_tokens_decoder.values() if t.special}
        return tuple(sorted(t for t in specials if t and t in sample))

    def control_token_in(self, text: str) -> str | None:
        """The first of :attr:`control_tokens` that ``text`` holds, else None."""
        return next((t for t in self.control_tokens if t in text), None)

    def check_messages(self, messages: list[dict[str, str]]) -> None:
        """400 for a message whose text holds one of the chat template's control tokens: tokenized as the token
        itself, it would let a client write turns of its own (a forged system message)."""
        for i, m in enumerate(messages):
            hit = self.control_token_in(m["content"])
            if hit is not None:
                raise HTTPProblem(400, f"messages[{i}].content contains {hit!r}, a control token of the model's chat "
                                       "template; remove it (send raw prompts to /v1/completions)",
                                  param=f"messages.{i}.content", code="control_token_in_content")

    def check(self, body: ChatCompletionRequest | CompletionRequest) -> tuple[FusionMethod | None, GenerationConfig]:
        """Everything about a completion that can be checked before anything is reserved: the model, the limits,
        the method and its parameters, the sampling fields. Returns the method and a provisional generation config
        (its ``max_new_tokens`` is cut to the room left once the prompt is planned)."""
        if body.model != self.model_id:
            raise HTTPProblem(404, f"model {body.model!r} is not served here; this server serves {self.model_id!r} "
                                   "(GET /v1/models)", param="model", code="model_not_found")
        if isinstance(body, ChatCompletionRequest) and len(body.messages) > self.config.max_messages:
            raise HTTPProblem(400, f"{len(body.messages)} messages; the limit is {self.config.max_messages} "
                                   "(--max-messages)", param="messages", code="too_many_messages")
        opts = body.kvrag
        method = self.default_method
        if opts is not None and (opts.method is not None or opts.params):
            refuse_paths(opts.method, opts.params)
            try:
                method = self.engine.method(opts.method or self.config.method, **opts.params)
            except (ConfigError, TypeError, ValueError, ArithmeticError) as e:
                raise HTTPProblem(400, f"kvrag.method: {e}", param="kvrag.method") from e
        requested = body.requested_tokens()
        try:
            gen = adapters.generation_config(
                max_new_tokens=requested if requested is not None else self.config.default_max_tokens,
                temperature=body.temperature if body.temperature is not None else 0.0,
                top_p=body.top_p if body.top_p is not None else 1.0, top_k=max(0, body.top_k or 0), seed=body.seed,
                stop=body.stops())
        except ConfigError as e:
            raise HTTPProblem(400, str(e)) from e
        return method, gen

    @functools.cached_property
    def most_chars(self) -> int:
        """The most characters a prompt that fits the context window can have: the window times the longest token's
        characters (a vocabulary entry's length bounds the text it decodes to)."""
        vocab = self.engine.tokenizer.get_vocab()
        return int(self.engine.max_context) * max((len(t) for t in vocab), default=1)

    def _plan(self, prompt: str, explicit: list[str] | None) -> Plan:
        """The request's plan (in a worker thread: searching the prompt for every registered text and tokenizing it
        take time that the event loop must not wait for). Registered texts found by content splice only where their
        own ids are the prompt's (``KVRAGEngine.plan(exact=...)``); a client's explicit ``kvrag.chunks`` as given,
        within the registration limits (their missing caches are stored within ``--max-store-bytes`` only)."""
        if explicit is not None:
            self.check_sizes(explicit, "kvrag.chunks")  # the store quota: their caches are stored within it only
            own = [r for r in self.check_lengths(explicit, "kvrag.chunks") if r is not None]
            return self.engine.plan(prompt, adapters.resolve_chunks(prompt, own, use_context=False))
        refs = self.found_chunks(prompt)
        return self.engine.plan(prompt, refs, exact=[c.text for c in refs])

    async def start(self, out: Outcome, body: ChatCompletionRequest | CompletionRequest, prompt: str,
                    kind: Kind) -> Job:
        """Admit, plan and prepare a checked request (400 for a prompt over the context window)."""
        method, gen = self.check(body)
        out.admit()
        eng = self.engine
        explicit = body.kvrag.chunks if body.kvrag is not None else None
        if self.sync is not None:
            self.chunks.add(await out.guard(self.sync.pull()))
        where = "messages" if kind == "chat" else "prompt"
        if len(prompt) > self.most_chars:  # refused before tokenizing it (seconds for megabytes)
            raise HTTPProblem(400, f"the prompt has {len(prompt)} characters, more than the model's context window "
                                   f"({eng.max_context} tokens) can hold; send fewer or shorter passages or earlier "
                                   "turns", param=where, code="context_length_exceeded")
        plan = await out.run(self._plan, prompt, explicit)
        room = int(eng.max_context) - int(plan.total_len)
        if room < 1:
            raise HTTPProblem(400, f"the prompt has {plan.total_len} tokens but the model's context window is "
                                   f"{eng.max_context}; send fewer or shorter passages or earlier turns", param=where,
                              code="context_length_exceeded")
        gen.max_new_tokens = min(gen.max_new_tokens, room)
        try:
            prep = await out.run(functools.partial(eng.prepare, plan, method, reserve=gen.max_new_tokens))
        except ContextLengthError as e:
            raise HTTPProblem(400, str(e), param=where, code="context_length_exceeded") from e
        job = Job(kind, self.model_id, prep, gen, body.include_usage())
        out.hold(job)
        self.metrics.observe_prepared(prep, out.arrived)
        return job

    def store_recomputing(self) -> bool:
        """True while the engine's :class:`~kvrag.store.fallback.FallbackStore` answers without the store
        (``on_store_error="recompute"``): responses carry the ``Warning`` header."""
        return bool(getattr(self.engine.serving_store, "degraded", False))

    def store_degraded(self) -> bool:
        """True while the store is down (``/health``'s ``store``): the engine recomputes (:meth:`store_recomputing`),
        or, with ``on_store_error="raise"``, a request failed on the store (:meth:`store_failed`) and no request that
        arrived since has succeeded (:meth:`store_worked`)."""
        return self._store_failed_at is not None or self.store_recomputing()

    def store_failed(self) -> None:
        """A request failed on the store (a :class:`~kvrag.errors.StoreError` reached the server)."""
        self._store_failed_at = time.perf_counter()

    def store_worked(self, since: float) -> None:
        """A request that arrived at ``since`` (``time.perf_counter()``) succeeded: a store failure before then is
        over."""
        failed = self._store_failed_at
        if failed is not None and since > failed:
            self._store_failed_at = None

    async def tokens(self, job: Job, arrived: float) -> AsyncGenerator[str, None]:
        """The request's text deltas, decoded in the engine's batch (one worker thread drives the stream; closing
        this iterator takes the request out of the batch)."""
        last: float | None = None
        prep, gen = job.prep, job.gen

        def stream() -> Iterator[str]:
            return self.engine.stream(prep, gen)

        it: AsyncGenerator[str, None] = adapters.aiter_in_thread(stream)  # type: ignore[assignment]
        try:
            async for delta in it:
                now = time.perf_counter()
                if last is None:
                    self.metrics.ttft.observe(now - arrived)
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                yield delta
        finally:
            await it.aclose()

    async def collect(self, out: Outcome, job: Job) -> str:
        """The whole answer (guarded: a client that leaves cancels it)."""

        async def gather() -> str:
            parts = []
            async for delta in self.tokens(job, out.arrived):
                parts.append(delta)
            return "".join(parts)

        text = await out.guard(gather())
        self.metrics.completion_tokens.inc(len(job.prep.token_ids))
        return text

    async def events(self, out: Outcome, job: Job) -> AsyncGenerator[bytes, None]:
        """The SSE events of a streamed response (OpenAI's chunk objects, then ``[DONE]``); a failure after the
        first byte ends the stream with an error event (OpenAI's error object) and sets the outcome's status."""
        try:
            if job.kind == "chat":
                yield bodies.sse(bodies.chunk_body(job, None, role=True))
            toks = self.tokens(job, out.arrived)
            try:
                async for delta in toks:
                    yield bodies.sse(bodies.chunk_body(job, delta))
            finally:
                await toks.aclose()
        except Exception as e:  # noqa: BLE001 - answered as an error event
            problem = out.problem(e)
            out.result = problem.status
            yield bodies.sse(problem.body)
            return
        self.metrics.completion_tokens.inc(len(job.prep.token_ids))
        yield bodies.sse(bodies.chunk_body(job, None, bodies.finish_reason(job)))
        if job.include_usage:
            yield bodies.sse(bodies.chunk_body(job, None, with_usage=True))
        yield bodies.DONE

    # ------------------------------------------------------------------------------------------- health
    def health(self) -> tuple[list[str], JSONObject]:
        """(problems, the ``/health`` body): a problem when the engine made no progress for ``stall_timeout_s``
        while requests wait, or when KV memory is held with nothing running while requests wait for it."""
        st = self.engine.runner.stats()
        kv = st.get("kv", {})
        now = time.monotonic()
        progress = int(st.get("steps", 0)) + int(st.get("prepare_pieces", 0)) + int(st.get("suffix_prefills", 0)) \
            + self.register_steps
        if progress != self._progress[0]:
            self._progress = (progress, now)
        states = st.get("states", {})
        waiting = int(kv.get("waiting", 0))
        work = self.held > 0 or waiting > 0
        stalled = work and now - self._progress[1] > self.config.stall_timeout_s
        running = int(st.get("decoding", 0)) + int(st.get("joining", 0)) + int(states.get("preparing", 0))
        wedged = waiting > 0 and running == 0 and int(kv.get("leases", 0)) > 0 and \
            now - self._progress[1] > min(1.0, self.config.stall_timeout_s)
        problems = (["the engine made no progress for "
                     f"{now - self._progress[1]:.0f} s with requests waiting (stall_timeout_s "
                     f"{self.config.stall_timeout_s:g})"] if stalled else []) + \
            (["KV memory is held by requests that are not running while others wait for it"] if wedged else [])
        body: JSONObject = {
            "status": "unhealthy" if problems else ("draining" if self.draining else "ok"), "model": self.model_id,
            "in_flight": self.held, "max_queue": self.config.max_queue,
            "store": "degraded" if self.store_degraded() else "ok", "registered_chunks": self.registered,
            "kv_bytes_used": int(kv.get("used", 0)), "kv_bytes_cached": int(kv.get("cached", 0)),
            "kv_bytes_limit": int(kv.get("limit", 0))}
        if problems:
            body["problems"] = problems
        return problems, body


__all__ = ["REGISTER_BATCH", "REGISTER_TOKENS", "ChunkSync", "KVRAGService"]
