"""Paired stale / joint KV for training CacheRepair (CacheRepair §4.2): one document's example, its statistics.

Documents come from :mod:`kvrag.repair.documents`; :mod:`kvrag.repair.dataset` streams them from the corpus and
caches the pairs on disk.

Conditioning, as the engine does it: every chunk cache is computed after a fixed prefix P (the chat template's
system header, ``KVRAGEngine.chunk_prefix_ids``), whose own KV is discarded. The joint reference is one prefill
of ``lead + chunk_1 + ... + chunk_m`` where ``lead`` is the exact leading text placed before the first chunk: with
``lead_kinds`` one of the leads real prompts produce (:mod:`kvrag.repair.leads`, picked per group), else P itself.
Both are put in canonical coordinates. With ``exact_lead`` (v2, what the engine serves) the lead is part of the
example as chunk 0: its stale KV *is* its joint KV (the engine prefills it exactly), the repairer reads it and the
loss skips it (``num_exact`` tokens), so chunk 1 is repaired like any later chunk. Without it (v1) the lead is
dropped from the example and chunk 1 is the first chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from kvrag.errors import ConfigError
from kvrag.kv import hf_cache
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag.kv.spec import KVSpec
from kvrag.repair.config import pack_kv
from kvrag.repair.documents import ChunkRenderer, Renderer, build_document, renderer_identity
from kvrag.repair.records import DocumentGroup, NormStats, PairManifest

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

PAIR_FORMAT_VERSION = 2
BOUNDARY_TOKENS = 8
"""Tokens at the start of a later chunk counted as its boundary (CacheRepair Table 16)."""


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
    model: PreTrainedModel,
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
        per_lead_style: render each document as its drawn lead's prompt family does
            (:func:`kvrag.repair.leads.chunk_style`: chunk format and the separator between chunks) instead of with
            ``renderer``.
        max_tokens: document token budget (chunk tokens, lead excluded).
        max_chunks / min_chunks: chunks per document.
    """

    model: PreTrainedModel
    rope: Rope
    spec: KVSpec
    tokenize: Callable[[str], list[int]]
    prefix_ids: tuple[int, ...] = ()
    lead_ids: tuple[int, ...] | None = None
    lead_kinds: tuple[str, ...] = ()
    exact_lead: bool = False
    tokenizer: PreTrainedTokenizerBase | None = None
    renderer: Renderer = dataclasses.field(default_factory=ChunkRenderer)
    per_lead_style: bool = False
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

    def lead(self, group: DocumentGroup) -> tuple[str, tuple[int, ...] | None]:
        """(lead kind, lead ids) of one group: a drawn real-prompt lead, else ``lead_ids`` (None: P)."""
        if not self.lead_kinds:
            return "", self.lead_ids
        from kvrag.repair.leads import group_question, pick_lead, render_lead

        tok = self.tokenizer
        assert tok is not None  # __post_init__ refuses lead_kinds without a tokenizer
        kind = pick_lead(self.lead_kinds, str(group.get("id", "")))
        text = render_lead(tok, kind, group_question(group))
        return kind, tuple(tok(text, add_special_tokens=False)["input_ids"])

    def chunks(self, group: DocumentGroup, lead_kind: str = "") -> list[list[int]] | None:
        """The document's spans (chunks, and separators between them in the per-lead style)."""
        passages = group.get("passages") or []
        titles = group.get("titles") or [""] * len(passages)
        renderer, separator = self.renderer, ""
        if self.per_lead_style:
            from kvrag.repair.leads import chunk_style

            style = chunk_style(lead_kind)
            renderer, separator = ChunkRenderer(style.fmt), style.separator
        return build_document(titles, passages, self.tokenize, renderer=renderer, max_tokens=self.max_tokens,
                              max_chunks=self.max_chunks, min_chunks=self.min_chunks, separator=separator)

    def build(self, group: DocumentGroup) -> PairedExample | None:
        kind, lead_ids = self.lead(group)
        chunks = self.chunks(group, kind)
        if chunks is None:
            return None
        return make_pair(self.model, self.rope, self.spec, chunks, self.prefix_ids, lead_ids,
                         group_id=str(group.get("id", "")), exact_lead=self.exact_lead, lead_kind=kind)

    def renderer_identity(self) -> str:
        if self.per_lead_style:
            from kvrag.repair.leads import style_identity

            return style_identity()
        return renderer_identity(self.renderer)

    def identity(self) -> PairManifest:
        """What the examples depend on (the pair-cache manifest)."""
        return {
            "format_version": PAIR_FORMAT_VERSION,
            "model_fingerprint": self.spec.model_fingerprint,
            "kv_shape": [self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim],
            "prefix_ids": list(self.prefix_ids),
            "lead_ids": None if self.lead_ids is None else list(self.lead_ids),
            "lead_kinds": list(self.lead_kinds),
            "exact_lead": self.exact_lead,
            "renderer": self.renderer_identity(),
            "max_tokens": self.max_tokens,
            "max_chunks": self.max_chunks,
            "min_chunks": self.min_chunks,
        }


def compute_stats(examples: Iterable[PairedExample], num_layers: int, num_kv_heads: int,
                  floor: float = 1e-3) -> NormStats:
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

    def scale(acc: torch.Tensor) -> torch.Tensor:
        rms = (acc / n).sqrt().reshape(num_layers, 2, num_kv_heads, -1)  # [L, 2, H, D]
        comp_mean = rms.mean(dim=(0, 2, 3), keepdim=True)  # per K/V component
        return torch.maximum(rms, floor * comp_mean).clamp_min(1e-12).float()

    return {"tokens": n, "documents": docs, "sigma_stale": scale(ss), "sigma_delta": scale(sd)}


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


__all__ = ["BOUNDARY_TOKENS", "PAIR_FORMAT_VERSION", "PairBuilder", "PairedExample", "compute_stats", "make_pair",
           "region_masks"]
