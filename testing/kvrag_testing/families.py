"""The model-family support matrix: what ``tests/unit/test_families.py`` proves per family, and the table of
``docs/models.md`` rendered from it.

Every row of :data:`SERVED` is a tiny random model of :mod:`kvrag_testing.tiny` that the family tests run in float32
and bfloat16 through the equivalence oracle (:mod:`kvrag_testing.equivalence`): ``full`` == ``model.generate`` on a
prompt whose chunk boundaries fall inside tokens; re-rotated chunk keys == the keys a prefill computes at those
positions; every selective method at its recompute-everything setting == ``full``; every reuse method runs and its
KV stays finite and bounded; the batched decode step == batch 1 (or, where :attr:`FamilySupport.decode` says so,
one row per step). Every row of :data:`REFUSED` is refused at load time with
:class:`~kvrag.errors.UnsupportedModelError` naming the reason, which the tests check too. Nothing in the docs table
comes from anywhere else: ``python -m kvrag_testing.families`` rewrites the table in ``docs/models.md`` and a test
checks that the file holds exactly what :func:`render_table` renders.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16")

FUSED = "fused step"
""":attr:`FamilySupport.step` of a family whose batched steps run the fused step (:mod:`kvrag.kv.fused_step`)."""

RECOMPUTE_ALL = ("relaxkv:r=1.0", "cacheblend:r=1.0", "epic:k=100000", "prophetkv:r=1.0")
"""The selective methods at their recompute-everything setting (each must equal ``full``)."""

REUSE = ("stale", "relaxkv:r=0.3", "cacheblend:r=0.3", "epic:k=4", "prophetkv:r=0.3")
"""The reuse methods the matrix runs (approximate by design: they reuse stale chunk caches)."""


@dataclasses.dataclass(frozen=True)
class FamilySupport:
    """One served family.

    Attributes:
        family: the :mod:`kvrag_testing.tiny` family name.
        models: the released models it stands for.
        positions: how kvrag re-positions its cached keys.
        layer: what its decoder layer adds over Llama's (kvrag runs the model's own layers, so each is followed).
        decode: 'batched' or why it decodes one request per step.
        step: which backend runs its batched steps (:mod:`kvrag.kv.step_backend`): ``FUSED`` (the fused step), or
            what runs them and why the fused step does not (its ``why_not``, by name).
        fused_in: the dtypes of :data:`DTYPES` in which the fused step serves the tiny model (tested).
    """

    family: str
    models: str
    positions: str
    layer: str
    decode: str = "batched"
    step: str = "fused step"
    fused_in: tuple[str, ...] = DTYPES


SERVED: tuple[FamilySupport, ...] = (
    FamilySupport("llama", "Llama 2/3.x, SmolLM/SmolLM2 (the default), TinyLlama", "one RoPE", "-"),
    FamilySupport("qwen2", "Qwen2, Qwen2.5", "one RoPE", "q/k/v bias; optional sliding layers"),
    FamilySupport("qwen3", "Qwen3", "one RoPE", "q/k RMSNorm"),
    FamilySupport("mistral", "Mistral, Ministral", "one RoPE", "sliding window"),
    FamilySupport("gemma", "Gemma", "one RoPE", "scaled embeddings, (1 + w) RMSNorm, GeGLU"),
    FamilySupport("gemma2", "Gemma 2", "one RoPE",
                  "alternating sliding / global layers, attention and final logit soft-capping, query "
                  "pre-attention scale, post-attention / post-MLP norms; eager attention",
                  decode="one request per step (eager attention: transformers refuses SDPA with soft-capping)",
                  step="the model's forward (attention logit soft-capping runs in eager attention only)", fused_in=()),
    FamilySupport("gemma3", "Gemma 3 (text)", "per-layer RoPE: local base 10K, global base 1M",
                  "5 local : 1 global layers, q/k norms, post norms, scaled embeddings"),
    FamilySupport("olmo2", "OLMo 2", "one RoPE", "norms after attention and MLP, q/k RMSNorm"),
    FamilySupport("granite", "Granite 3.x", "one RoPE", "embedding, residual, attention and logit multipliers"),
    FamilySupport("cohere", "Command-R, Aya (Cohere)", "one RoPE, interleaved pairs",
                  "LayerNorm, parallel attention + MLP, logit scale"),
    FamilySupport("smollm3", "SmolLM3", "RoPE, every 4th layer none (keys used as they are)", "-"),
    FamilySupport("phi", "Phi-1.5, Phi-2", "partial rotary (half of each head)",
                  "parallel attention + MLP, LayerNorm with bias, dense biases"),
    FamilySupport("gpt_neox", "GPT-NeoX, Pythia", "partial rotary (a quarter of each head)",
                  "parallel residual, LayerNorm, no GQA",
                  step="the model's forward (its fused q / k / v lay out head by head)", fused_in=()),
    FamilySupport("stablelm", "StableLM 2, StableLM-3B", "partial rotary (a quarter of each head)", "LayerNorm"),
    FamilySupport("gpt_oss", "GPT-OSS", "one RoPE (yarn in the released models)",
                  "mixture of experts, attention sinks, alternating sliding / global layers; eager attention",
                  decode="one request per step (eager attention: transformers refuses SDPA with attention sinks)",
                  step="the model's forward (attention sinks run in eager attention only)", fused_in=()),
    FamilySupport("exaone4", "EXAONE 4.0", "RoPE in the local layers, none in the global ones (keys used as they are)",
                  "3 local : 1 global layers, q/k RMSNorm, post norms"),
    FamilySupport("phi3", "Phi-3, Phi-3.5, Phi-4-mini", "one RoPE (Phi-4-mini: partial, 0.75); LongRoPE in its "
                  "short regime", "fused qkv and gate/up projections"),
)
"""Families served exactly in both dtypes (each proven by ``tests/unit/test_families.py``)."""

REFUSED: tuple[tuple[str, str, str], ...] = (
    ("LongRoPE / dynamic NTK past `original_max_position_embeddings`", "Phi-3/3.5-128K, Phi-4-mini past 4K",
     "the frequencies switch with the sequence length: prompts longer than the short regime raise "
     "`ContextLengthError`"),
    ("no RoPE", "GPT-2, OPT, BLOOM", "`UnsupportedModelError`: keys cannot be re-rotated"),
    ("multimodal RoPE (`mrope_section`)", "Qwen2-VL, Qwen2.5-VL", "`UnsupportedModelError`: several position axes"),
    ("non-attention layers", "Mamba hybrids, linear attention", "`UnsupportedModelError`: no per-token K/V"),
)
"""What stays refused, with the error and the reason."""

TABLE_BEGIN = "<!-- family table: generated by `python -m kvrag_testing.families`; tests/unit/test_families.py -->"
TABLE_END = "<!-- end of family table -->"


def render_table() -> str:
    """The markdown block between :data:`TABLE_BEGIN` and :data:`TABLE_END` in ``docs/models.md``."""
    lines = [TABLE_BEGIN, "",
             "| family (tiny test model) | released models | positions | layer specifics kvrag follows | "
             + " | ".join(f"`full` == generate ({d})" for d in DTYPES)
             + " | recompute-everything == `full` | reuse methods | decode |",
             "|---|---|---|---|" + "---|" * len(DTYPES) + "---|---|---|"]
    for f in SERVED:
        lines.append(f"| `{f.family}` | {f.models} | {f.positions} | {f.layer} | "
                     + " | ".join("exact" for _ in DTYPES)
                     + f" | exact ({', '.join(DTYPES)}) | run, approximate | {f.decode}; {f.step} |")
    lines += ["", "| refused | e.g. | how and why |", "|---|---|---|"]
    lines += [f"| {what} | {models} | {why} |" for what, models, why in REFUSED]
    lines += ["", TABLE_END]
    return "\n".join(lines)


def write_table(path: Path) -> bool:
    """Replace the table block in ``path`` with :func:`render_table`; True when the file changed."""
    text = path.read_text()
    start, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    new = text[:start] + render_table() + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


def table_in(path: Path) -> str:
    """The table block currently in ``path`` (markers included)."""
    text = path.read_text()
    return text[text.index(TABLE_BEGIN): text.index(TABLE_END) + len(TABLE_END)]


if __name__ == "__main__":  # pragma: no cover - a maintenance entry point
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("docs/models.md")
    print(("updated " if write_table(target) else "unchanged ") + str(target))  # noqa: T201


__all__ = ["DTYPES", "FUSED", "RECOMPUTE_ALL", "REFUSED", "REUSE", "SERVED", "FamilySupport", "render_table",
           "table_in", "write_table"]
