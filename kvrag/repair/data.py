"""Paired stale / joint KV for training CacheRepair (CacheRepair §4.2), from a passage-group JSONL corpus.

Corpus: one JSON object a line, ``{"id": ..., "titles": [...], "passages": [...]}`` (``id`` optional). Each group
becomes one ordered multi-chunk document: chunk ``i`` is ``renderer(titles[i], passages[i])`` (by default
``"\\n\\nTitle: {title}\\n{passage}"``, as the benchmark renders context passages), tokenized alone like the engine
tokenizes a chunk, taken in order under a token budget (2-20 chunks).

Conditioning, as the engine does it: every chunk cache is computed after a fixed prefix P (the chat template's
system header, ``KVRAGEngine.chunk_prefix_ids``), whose own KV is discarded. The joint reference is one prefill
of ``lead + chunk_1 + ... + chunk_m`` where ``lead`` is the exact leading text placed before the first chunk: with
``lead_kinds`` one of the leads real prompts produce (:mod:`kvrag.repair.leads`, picked per group), else P itself.
Both are put in canonical coordinates. With ``exact_lead`` (v2, what the engine serves) the lead is part of the
example as chunk 0: its stale KV *is* its joint KV (the engine prefills it exactly), the repairer reads it and the
loss skips it (``num_exact`` tokens), so chunk 1 is repaired like any later chunk. Without it (v1) the lead is
dropped from the example and chunk 1 is the first chunk.

The corpus is streamed: an index keeps byte offsets only, and each example is built (or read from the optional
on-disk pair cache, one safetensors file per document) when it is asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvrag.engine.assemble import compute_chunk_kv
from kvrag.errors import ConfigError
from kvrag.kv import hf_cache
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec
from kvrag.prompting import chat_preamble
from kvrag.repair.model import pack_kv

log = logging.getLogger(__name__)

DEFAULT_CHUNK_FORMAT = "\n\nTitle: {title}\n{passage}"
"""How the benchmark renders one retrieved passage into the prompt."""

PAIR_FORMAT_VERSION = 2
BOUNDARY_TOKENS = 8
"""Tokens at the start of a later chunk counted as its boundary (CacheRepair Table 16)."""


# ---------------------------------------------------------------------------------------------------------------
# Rendering and documents
# ---------------------------------------------------------------------------------------------------------------


class ChunkRenderer:
    """Render (title, passage) to chunk text with a ``str.format`` template using ``{title}`` and ``{passage}``."""

    def __init__(self, fmt: str = DEFAULT_CHUNK_FORMAT) -> None:
        if "{passage}" not in fmt:
            msg = f"chunk format must contain '{{passage}}' (and may contain '{{title}}'), got {fmt!r}"
            raise ConfigError(msg)
        self.fmt = fmt

    def __call__(self, title: str, passage: str) -> str:
        return self.fmt.format(title=title.strip(), passage=passage.strip())

    @property
    def identity(self) -> str:
        return f"format:{self.fmt}"


Renderer = Callable[[str, str], str]


def renderer_identity(renderer: Renderer) -> str:
    """A string identifying a renderer (part of the pair-cache manifest)."""
    ident = getattr(renderer, "identity", None)
    if isinstance(ident, str):
        return ident
    return f"callable:{getattr(renderer, '__module__', '?')}.{getattr(renderer, '__qualname__', repr(renderer))}"


def template_prefix_ids(tokenizer: Any, mode: str = "template") -> tuple[int, ...]:
    """The chunk-conditioning prefix the engine uses (``KVRAGEngine.chunk_prefix_ids``).

    Args:
        mode: 'template' (the chat template's fixed text before a user message; the BOS token without a template)
            or 'none'.
    """
    if mode == "none":
        return ()
    if mode != "template":
        msg = f"chunk prefix mode must be 'template' or 'none', got {mode!r}"
        raise ConfigError(msg)
    pre = chat_preamble(tokenizer)
    return tuple(tokenizer(pre, add_special_tokens=False)["input_ids"]) if pre else ()


def build_document(
    titles: Sequence[str],
    passages: Sequence[str],
    tokenize: Callable[[str], list[int]],
    *,
    renderer: Renderer | None = None,
    max_tokens: int = 1024,
    max_chunks: int = 20,
    min_chunks: int = 2,
    min_chunk_tokens: int = 8,
) -> list[list[int]] | None:
    """Token ids of the ordered chunks of one group under a budget.

    Chunks are taken in order while they fit in ``max_tokens``; to reach ``min_chunks`` the chunk that does not
    fit is cut to the remaining budget (the first chunk is cut so that a second one can follow).

    Returns:
        ``min_chunks``..``max_chunks`` chunk id lists, or None when the group cannot make such a document.
    """
    renderer = renderer or ChunkRenderer()
    chunks: list[list[int]] = []
    total = 0
    for title, passage in zip(titles, passages, strict=False):
        if not passage or not passage.strip():
            continue
        ids = list(tokenize(renderer(title, passage)))
        if not ids:
            continue
        room = max_tokens - total
        if len(chunks) < min_chunks:
            room -= min_chunk_tokens * (min_chunks - 1 - len(chunks))  # keep room for the required chunks
        if len(ids) > room:
            if len(chunks) >= min_chunks or room < min_chunk_tokens:
                break
            ids = ids[:room]
        chunks.append(ids)
        total += len(ids)
        if len(chunks) >= max_chunks or total >= max_tokens:
            break
    return chunks if len(chunks) >= min_chunks else None


# ---------------------------------------------------------------------------------------------------------------
# Paired examples
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PairedExample:
    """One document's stale and joint KV over its chunk tokens, in canonical coordinates.

    Attributes:
        token_ids: [N] ids of the chunk tokens (the lead/prefix excluded).
        chunk_index: [N] chunk ordinal 0..m-1 of every token.
        stale: [N, S, D] stale canonical KV packed by :func:`kvrag.repair.model.pack_kv`.
        delta: [N, S, D] joint minus stale (the residual target, CacheRepair §4.2).
        group_id: the corpus group it came from.
        num_exact: leading tokens that are exact context (the lead as chunk 0: read by the repairer, never
            repaired, no loss); 0 for v1 examples.
        lead_kind: which lead the joint reference used ('' for the conditioning prefix P).
    """

    token_ids: torch.Tensor
    chunk_index: torch.Tensor
    stale: torch.Tensor
    delta: torch.Tensor
    group_id: str = ""
    num_exact: int = 0
    lead_kind: str = ""

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_index.max().item()) + 1 if self.num_tokens else 0

    @property
    def joint(self) -> torch.Tensor:
        return self.stale.float() + self.delta.float()

    def positions(self) -> torch.Tensor:
        """[N] document positions 0..N-1 (the repairer's RoPE positions)."""
        return torch.arange(self.num_tokens)


@torch.no_grad()  # not inference_mode: the tensors feed autograd-tracked training
def make_pair(
    model: torch.nn.Module,
    rope: Rope,
    spec: KVSpec,
    chunks: Sequence[Sequence[int]],
    prefix_ids: Sequence[int] = (),
    lead_ids: Sequence[int] | None = None,
    group_id: str = "",
    *,
    exact_lead: bool = False,
    lead_kind: str = "",
) -> PairedExample:
    """Compute stale and joint KV of one document with the frozen target.

    Args:
        chunks: the chunks' token ids in document order.
        prefix_ids: P, what every chunk cache is conditioned on (``compute_chunk_kv(..., prefix_ids=P)``).
        lead_ids: exact leading tokens before the first chunk in the joint prefill (default: ``prefix_ids``).
        exact_lead: keep the lead in the example as exact chunk 0 (``num_exact`` tokens, stale == joint there).
        lead_kind: recorded on the example.

    Returns:
        A float32 :class:`PairedExample` on the CPU.
    """
    lead = list(prefix_ids if lead_ids is None else lead_ids)
    spec32 = spec.with_dtype("float32")
    sk, sv = [], []
    for ch in chunks:  # stale: each chunk alone after P, exactly as the engine computes a cache
        c = compute_chunk_kv(model, rope, spec32, list(ch), list(prefix_ids))
        sk.append(c.keys)
        sv.append(c.values)
    stale_k, stale_v = torch.cat(sk, dim=2), torch.cat(sv, dim=2)  # [L, H_kv, N, D]
    ids = [t for ch in chunks for t in ch]
    n, p = len(ids), len(lead)
    jk, jv = hf_cache.prefill_kv(model, torch.tensor(lead + ids, dtype=torch.long))  # one joint prefill
    first = 0 if exact_lead else p  # v2 keeps the lead as exact chunk 0
    jk = rope.canonicalize(jk[:, :, first:].float(), torch.arange(first, p + n, device=jk.device)).cpu()
    jv = jv[:, :, first:].float().cpu()
    if exact_lead and p:  # the lead's stale KV is its joint KV: the engine prefills the lead exactly
        stale_k = torch.cat([jk[:, :, :p], stale_k], dim=2)
        stale_v = torch.cat([jv[:, :, :p], stale_v], dim=2)
    stale = pack_kv(stale_k, stale_v).contiguous()  # [N, S, D]
    delta = (pack_kv(jk, jv) - stale).contiguous()
    spans = ([lead] if exact_lead and p else []) + [list(ch) for ch in chunks]
    chunk_index = torch.cat([torch.full((len(ch),), i, dtype=torch.long) for i, ch in enumerate(spans)])
    token_ids = torch.tensor((lead if exact_lead else []) + ids, dtype=torch.long)
    return PairedExample(token_ids, chunk_index, stale, delta, group_id,
                         num_exact=p if exact_lead else 0, lead_kind=lead_kind)


@dataclasses.dataclass
class PairBuilder:
    """Everything that turns a corpus group into a :class:`PairedExample`.

    Attributes:
        model, rope, spec: the frozen target and its KV layout (``spec.model_fingerprint`` identifies the target).
        tokenize: text -> ids without special tokens (how the engine tokenizes a chunk).
        prefix_ids: chunk-conditioning prefix P.
        lead_ids: exact text before the first chunk in the joint prefill (None: P); ignored with ``lead_kinds``.
        lead_kinds: leads to draw from per group (:data:`kvrag.repair.leads.LEAD_KINDS`); needs ``tokenizer``.
        exact_lead: keep the lead in each example as exact chunk 0 (v2; what the engine serves).
        tokenizer: renders the leads through its chat template.
        renderer: (title, passage) -> chunk text.
        max_tokens: document token budget (chunk tokens, lead excluded).
        max_chunks / min_chunks: chunks per document.
    """

    model: torch.nn.Module
    rope: Rope
    spec: KVSpec
    tokenize: Callable[[str], list[int]]
    prefix_ids: tuple[int, ...] = ()
    lead_ids: tuple[int, ...] | None = None
    lead_kinds: tuple[str, ...] = ()
    exact_lead: bool = False
    tokenizer: Any = None
    renderer: Renderer = dataclasses.field(default_factory=ChunkRenderer)
    max_tokens: int = 1024
    max_chunks: int = 20
    min_chunks: int = 2

    def __post_init__(self) -> None:
        if self.max_tokens < 16 * self.min_chunks:
            msg = f"max_tokens={self.max_tokens} is too small for {self.min_chunks} chunks (need >= {16 * self.min_chunks})"
            raise ConfigError(msg)
        if not 2 <= self.min_chunks <= self.max_chunks:
            msg = f"need 2 <= min_chunks <= max_chunks, got {self.min_chunks} and {self.max_chunks}"
            raise ConfigError(msg)
        if self.lead_kinds and self.tokenizer is None:
            msg = "lead_kinds need the tokenizer (to render the leads through its chat template)"
            raise ConfigError(msg)

    def lead(self, group: dict[str, Any]) -> tuple[str, tuple[int, ...] | None]:
        """(lead kind, lead ids) of one group: a drawn real-prompt lead, else ``lead_ids`` (None: P)."""
        if not self.lead_kinds:
            return "", self.lead_ids
        from kvrag.repair.leads import group_question, pick_lead, render_lead

        kind = pick_lead(self.lead_kinds, str(group.get("id", "")))
        text = render_lead(self.tokenizer, kind, group_question(group))
        return kind, tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chunks(self, group: dict[str, Any]) -> list[list[int]] | None:
        passages = group.get("passages") or []
        titles = group.get("titles") or [""] * len(passages)
        return build_document(titles, passages, self.tokenize, renderer=self.renderer, max_tokens=self.max_tokens,
                              max_chunks=self.max_chunks, min_chunks=self.min_chunks)

    def build(self, group: dict[str, Any]) -> PairedExample | None:
        chunks = self.chunks(group)
        if chunks is None:
            return None
        kind, lead_ids = self.lead(group)
        return make_pair(self.model, self.rope, self.spec, chunks, self.prefix_ids, lead_ids,
                         group_id=str(group.get("id", "")), exact_lead=self.exact_lead, lead_kind=kind)

    def identity(self) -> dict[str, Any]:
        """What the examples depend on (the pair-cache manifest)."""
        return {
            "format_version": PAIR_FORMAT_VERSION,
            "model_fingerprint": self.spec.model_fingerprint,
            "kv_shape": [self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim],
            "prefix_ids": list(self.prefix_ids),
            "lead_ids": None if self.lead_ids is None else list(self.lead_ids),
            "lead_kinds": list(self.lead_kinds),
            "exact_lead": self.exact_lead,
            "renderer": renderer_identity(self.renderer),
            "max_tokens": self.max_tokens,
            "max_chunks": self.max_chunks,
            "min_chunks": self.min_chunks,
        }


# ---------------------------------------------------------------------------------------------------------------
# Corpus index (streaming) and dataset
# ---------------------------------------------------------------------------------------------------------------


def _hash64(s: str) -> int:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "big")


def group_split(group_id: str, eval_modulus: int = 50) -> str:
    """'eval' for about 1/eval_modulus of the groups (by a hash of the id), else 'train'. Deterministic."""
    return "eval" if _hash64("split|" + group_id) % eval_modulus == 0 else "train"


class CorpusIndex:
    """Byte offsets of the usable groups of one split of a JSONL corpus, in a fixed hash order.

    Only offsets and ids are kept in memory; groups are read from disk on demand.

    Args:
        path: JSONL file.
        split: 'train', 'eval' or 'all'.
        eval_modulus: about 1/eval_modulus of the groups are held aside for 'eval' (see :func:`group_split`).
        max_groups: keep the first ``max_groups`` of the split in hash order (a fixed pseudo-random subset).
        min_passages: skip groups with fewer passages.
        sources: keep only groups whose ``source`` is in this set (None: all).
    """

    def __init__(self, path: str | os.PathLike[str], split: str = "train", *, eval_modulus: int = 50,
                 max_groups: int | None = None, min_passages: int = 2, sources: Iterable[str] | None = None) -> None:
        if split not in ("train", "eval", "all"):
            msg = f"split must be 'train', 'eval' or 'all', got {split!r}"
            raise ConfigError(msg)
        self.path = Path(path)
        if not self.path.is_file():
            msg = f"corpus {self.path} not found; expected a JSONL file of {{\"titles\": [...], \"passages\": [...]}}"
            raise ConfigError(msg)
        keep = set(sources) if sources is not None else None
        entries: list[tuple[int, int, str]] = []
        with self.path.open("rb") as f:
            lineno = 0
            while True:
                off = f.tell()
                line = f.readline()
                if not line:
                    break
                lineno += 1
                if not line.strip():
                    continue
                try:
                    g = json.loads(line)
                except ValueError as e:
                    msg = f"{self.path}:{lineno} is not valid JSON: {e}"
                    raise ConfigError(msg) from e
                gid = str(g.get("id", f"line-{lineno}"))
                if keep is not None and g.get("source") not in keep:
                    continue
                if len([p for p in g.get("passages") or [] if p and p.strip()]) < min_passages:
                    continue
                if split != "all" and group_split(gid, eval_modulus) != split:
                    continue
                entries.append((_hash64("order|" + gid), off, gid))
        entries.sort()
        if max_groups is not None:
            entries = entries[:max_groups]
        self.offsets = [e[1] for e in entries]
        self.ids = [e[2] for e in entries]
        self.split = split

    def __len__(self) -> int:
        return len(self.offsets)

    def read(self, i: int) -> dict[str, Any]:
        with self.path.open("rb") as f:
            f.seek(self.offsets[i])
            g = json.loads(f.readline())
        g.setdefault("id", self.ids[i])
        return g


class PairDataset:
    """Paired examples of a :class:`CorpusIndex`, built on demand, optionally memoized on disk.

    Args:
        index: the groups.
        builder: how a group becomes an example.
        cache_dir: directory for the pair cache (one safetensors file per document, written atomically; a
            ``manifest.json`` pins the builder identity). None: rebuild on every access.
        cache_dtype: storage dtype of cached stale/delta ('float16' halves disk use; 'float32' is exact).
    """

    def __init__(self, index: CorpusIndex, builder: PairBuilder, cache_dir: str | os.PathLike[str] | None = None,
                 cache_dtype: str = "float16") -> None:
        self.index = index
        self.builder = builder
        dtypes = {"float16": torch.float16, "float32": torch.float32}
        if cache_dtype not in dtypes:
            msg = f"cache_dtype must be 'float16' or 'float32', got {cache_dtype!r}"
            raise ConfigError(msg)
        self.cache_dtype = dtypes[cache_dtype]
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        if self.cache_dir is not None:
            self._check_manifest({**builder.identity(), "cache_dtype": cache_dtype})

    def _check_manifest(self, ident: dict[str, Any]) -> None:
        assert self.cache_dir is not None
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.cache_dir / "manifest.json"
        if path.is_file():
            have = json.loads(path.read_text())
            if have != ident:
                diff = sorted(k for k in set(have) | set(ident) if have.get(k) != ident.get(k))
                msg = (f"the pair cache {self.cache_dir} was built with different settings ({', '.join(diff)}); "
                       "use another --pairs directory or delete this one")
                raise ConfigError(msg)
        else:
            _atomic_write_text(path, json.dumps(ident, indent=2, sort_keys=True))

    def __len__(self) -> int:
        return len(self.index)

    def _cache_path(self, i: int) -> Path | None:
        if self.cache_dir is None:
            return None
        key = hashlib.sha256(self.index.ids[i].encode()).hexdigest()[:20]
        return self.cache_dir / self.index.split / f"{key}.safetensors"

    def is_cached(self, i: int) -> bool:
        p = self._cache_path(i)
        return p is not None and p.is_file()

    def __getitem__(self, i: int) -> PairedExample:
        if not 0 <= i < len(self):
            raise IndexError(i)
        path = self._cache_path(i)
        if path is not None and path.is_file():
            try:
                return _load_pair(path)
            except Exception as e:  # a corrupt entry is reported, dropped and recomputed
                log.warning("dropping unreadable cached pair %s: %s", path, e)
                path.unlink(missing_ok=True)
        ex = self.builder.build(self.index.read(i))
        if ex is None:
            msg = f"group {self.index.ids[i]!r} does not make a document of >= {self.builder.min_chunks} chunks"
            raise ConfigError(msg)
        if path is not None:
            dtype = _save_pair(path, ex, self.cache_dtype)
            # return what a later read returns, so that training does not depend on whether the pair was cached
            ex = dataclasses.replace(ex, stale=ex.stale.to(dtype).float(), delta=ex.delta.to(dtype).float())
        return ex


def _save_pair(path: Path, ex: PairedExample, dtype: torch.dtype) -> torch.dtype:
    """Write one pair atomically; returns the dtype used (float32 when float16 would overflow)."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    if dtype == torch.float16 and max(ex.stale.abs().max().item(), ex.delta.abs().max().item()) > 6e4:
        dtype = torch.float32  # out of float16 range: keep this document exact
    tensors = {
        "token_ids": ex.token_ids.contiguous(),
        "chunk_index": ex.chunk_index.contiguous(),
        "stale": ex.stale.to(dtype).contiguous(),
        "delta": ex.delta.to(dtype).contiguous(),
    }
    tmp = str(_tmp_sibling(path))
    try:
        save_file(tensors, tmp, metadata={"group_id": ex.group_id, "format_version": str(PAIR_FORMAT_VERSION),
                                          "num_exact": str(ex.num_exact), "lead_kind": ex.lead_kind})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dtype


def _load_pair(path: Path) -> PairedExample:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        t = {k: f.get_tensor(k) for k in ("token_ids", "chunk_index", "stale", "delta")}
    return PairedExample(t["token_ids"], t["chunk_index"], t["stale"].float(), t["delta"].float(),
                         meta.get("group_id", ""), num_exact=int(meta.get("num_exact", 0)),
                         lead_kind=meta.get("lead_kind", ""))


def _tmp_sibling(path: Path) -> Path:
    """A unique temp path next to ``path`` (created later with the umask's permissions, unlike mkstemp's 0600)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = _tmp_sibling(path)
    tmp.write_text(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------------
# Statistics and regions
# ---------------------------------------------------------------------------------------------------------------


def compute_stats(examples: Iterable[PairedExample], num_layers: int, num_kv_heads: int,
                  floor: float = 1e-3) -> dict[str, Any]:
    """sigma_stale and sigma_delta: RMS over document tokens per (layer, K/V, head, coordinate) (CacheRepair §4.2).

    Args:
        examples: the documents to pool (all their tokens, the first chunk included).
        floor: each scale is at least ``floor`` times the mean scale of its K/V component, so that coordinates
            with (near) zero residual do not blow up the normalized loss.

    Returns:
        {"sigma_stale": [L, 2, H_kv, D], "sigma_delta": [L, 2, H_kv, D], "tokens": int, "documents": int}
    """
    ss = sd = None
    n = docs = 0
    for ex in examples:
        st, de = ex.stale[ex.num_exact:].double(), ex.delta[ex.num_exact:].double()  # repaired tokens only
        ss = st.pow(2).sum(0) if ss is None else ss + st.pow(2).sum(0)  # [S, D]
        sd = de.pow(2).sum(0) if sd is None else sd + de.pow(2).sum(0)
        n += ex.num_tokens - ex.num_exact
        docs += 1
    if ss is None or sd is None or n == 0:
        msg = "cannot compute normalization statistics from zero documents"
        raise ConfigError(msg)
    out: dict[str, Any] = {"tokens": n, "documents": docs}
    for name, acc in (("sigma_stale", ss), ("sigma_delta", sd)):
        rms = (acc / n).sqrt().reshape(num_layers, 2, num_kv_heads, -1)  # [L, 2, H, D]
        comp_mean = rms.mean(dim=(0, 2, 3), keepdim=True)  # per K/V component
        out[name] = torch.maximum(rms, floor * comp_mean).clamp_min(1e-12).float()
    return out


def region_masks(chunk_index: torch.Tensor, boundary: int = BOUNDARY_TOKENS, num_exact: int = 0) -> dict[str, torch.Tensor]:
    """Token regions of one document (CacheRepair Table 16), over its repaired tokens.

    Args:
        chunk_index: [N] chunk ordinals (non-decreasing).
        num_exact: leading exact tokens (the lead as chunk 0); in no region.

    Returns:
        {"first": first repaired chunk, "boundary": first ``boundary`` tokens of later chunks, "interior": the rest}
        ([N] bool).
    """
    n = chunk_index.shape[0]
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = chunk_index[1:] != chunk_index[:-1]
    idx = torch.arange(n)
    start_pos = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=0).values
    pos_in_chunk = idx - start_pos
    exact = idx < num_exact
    first_rep = chunk_index[num_exact] if n > num_exact else chunk_index.new_tensor(-1)
    first = (chunk_index == first_rep) & ~exact if n else torch.zeros(0, dtype=torch.bool)
    bnd = ~first & ~exact & (pos_in_chunk < boundary)
    return {"first": first, "boundary": bnd, "interior": ~first & ~exact & ~bnd}


__all__ = [
    "BOUNDARY_TOKENS",
    "DEFAULT_CHUNK_FORMAT",
    "ChunkRenderer",
    "CorpusIndex",
    "PairBuilder",
    "PairDataset",
    "PairedExample",
    "build_document",
    "compute_stats",
    "group_split",
    "make_pair",
    "region_masks",
    "template_prefix_ids",
]
