"""Settings of one QA benchmark run and the method specs it compares."""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvrag.errors import ConfigError
from kvrag.fusion import FusionMethod, available_methods, get_method, parse_method_spec
from kvrag.prompting import get_template

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BenchConfig:
    """Settings of one QA benchmark run.

    Attributes:
        data: QA JSONL path.
        out: output directory (results.jsonl, summary.json, summary.md, PNGs).
        methods: method specs as given (e.g. ``["full", "stale", "relaxkv:r=0.15"]``); unregistered methods are
            skipped with a warning, bad parameters of registered ones are errors.
        limit, offset: which rows of ``data`` (file order).
        model: HF id / path, or None for the embedded default.
        template: prompt template name (:data:`kvrag.prompting.TEMPLATES`), None for the default.
        max_new_tokens: greedy decode budget per answer.
        kl_tokens: teacher-forced positions for KL (the first tokens of the full-prefill answer).
        boundary_tokens: how many leading tokens of each later chunk count as its boundary region.
        seed: torch seed and bootstrap seed.
        bootstrap: bootstrap resamples for intervals (0 disables intervals).
        peer: optional peer runner (``"llamaindex-hf"``).
        store: KV store URL for the chunk caches.
        cache_budget_bytes: build every request's caches up front when they fit in this many bytes, else build
            each request's caches right before it (still untimed).
        chunk_prefix: engine ``chunk_prefix`` mode.
        warmup: requests run untimed first (not recorded).
        threads: torch intra-op threads (None: torch default).
        device, dtype: model placement (None: defaults).
        overwrite: discard existing results in ``out`` instead of resuming.
        plots: write the Pareto PNGs.
        progress: show progress bars.
    """

    data: str
    out: str
    methods: Sequence[str] = ("full", "stale")
    limit: int | None = None
    offset: int = 0
    model: str | None = None
    template: str | None = None
    max_new_tokens: int = 32
    kl_tokens: int = 32
    boundary_tokens: int = 8
    seed: int = 0
    bootstrap: int = 1000
    peer: str | None = None
    store: str = "memory://?max_bytes=4e9"
    cache_budget_bytes: int = 4_000_000_000
    chunk_prefix: str = "template"
    warmup: int = 1
    threads: int | None = None
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = "default"
    overwrite: bool = False
    plots: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.methods, str):
            self.methods = split_method_specs(self.methods)
        self.methods = list(self.methods)
        if not self.methods:
            raise ConfigError("no methods given; pass e.g. --methods full,stale")
        for name, v, lo in (("max_new_tokens", self.max_new_tokens, 1), ("kl_tokens", self.kl_tokens, 1),
                            ("boundary_tokens", self.boundary_tokens, 1), ("bootstrap", self.bootstrap, 0),
                            ("warmup", self.warmup, 0)):
            if v < lo:
                msg = f"{name} must be >= {lo}, got {v}"
                raise ConfigError(msg)
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1, got {self.threads}")
        if self.peer not in (None, "", "llamaindex-hf"):
            msg = f"unknown peer {self.peer!r}; valid peers: llamaindex-hf"
            raise ConfigError(msg)
        get_template(self.template)  # validates the name
        out = Path(self.out)
        for p in (out, *out.parents):  # checked before the model loads: a file where a folder must go
            if p.exists() and not p.is_dir():
                msg = f"--out {self.out!r}: {str(p)!r} is a file, not a directory; pass a directory path for the results"
                raise ConfigError(msg)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def split_method_specs(s: str) -> list[str]:
    """Split ``"full,relaxkv:r=0.15,k=2,stale"`` into ``["full", "relaxkv:r=0.15,k=2", "stale"]``.

    Commas separate methods and also parameters of one method; a token containing '=' continues the method
    before it.
    """
    out: list[str] = []
    for tok in (t.strip() for t in s.split(",")):
        if not tok:
            continue
        if "=" in tok and ":" not in tok and out:
            out[-1] += "," + tok
        else:
            out.append(tok)
    return out


def method_labels(specs: Sequence[str]) -> list[str]:
    """Labels for specs as given: the spec itself, ``spec#2``, ``spec#3`` ... for repeats."""
    seen: dict[str, int] = {}
    out = []
    for s in specs:
        seen[s] = seen.get(s, 0) + 1
        out.append(s if seen[s] == 1 else f"{s}#{seen[s]}")
    return out


def resolve_methods(specs: Sequence[str]) -> tuple[dict[str, FusionMethod], list[str]]:
    """Build the registered methods; returns ({label: method}, [skipped specs]).

    A spec whose method name is not registered (a method still being written) is skipped; a registered method
    with bad parameters raises ConfigError.
    """
    from kvrag_bench.ablations import register_ablations

    register_ablations()  # the bench compares against the ablation controls (relaxkv-fullctx)
    registered = set(available_methods())
    methods: dict[str, FusionMethod] = {}
    skipped: list[str] = []
    for label, spec in zip(method_labels(specs), specs, strict=True):
        name, _ = parse_method_spec(spec)
        if name not in registered:
            near = difflib.get_close_matches(name, sorted(registered), n=1)
            log.warning("skipping method %r: %r is not a registered fusion method%s (registered: %s)",
                        spec, name, f"; did you mean {near[0]!r}?" if near else "", ", ".join(sorted(registered)))
            skipped.append(spec)
            continue
        methods[label] = get_method(spec)
    if not methods:
        msg = f"none of the methods {list(specs)} is registered; valid methods: {', '.join(sorted(registered))}"
        raise ConfigError(msg)
    return methods, skipped


__all__ = ["BenchConfig", "method_labels", "resolve_methods", "split_method_specs"]
