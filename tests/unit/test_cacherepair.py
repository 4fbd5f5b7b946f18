"""CacheRepair: network invariants, paired data, training loop, checkpoints and the ``cacherepair`` method."""

from __future__ import annotations

import atexit
import json
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrag.engine.assemble import assemble
from kvrag.errors import CheckpointMismatchError, ConfigError
from kvrag.fusion import get_method
from kvrag.kv import hf_cache
from kvrag.kv.compute import compute_chunk_kv
from kvrag.kv.rope import Rope
from kvrag.repair.config import RepairConfig, pack_kv, unpack_kv
from kvrag.repair.dataset import CorpusIndex, PairDataset
from kvrag.repair.documents import ChunkRenderer, build_document, template_prefix_ids
from kvrag.repair.model import CONFIG_NAME, RepairModel, block_causal_mask
from kvrag.repair.pairs import PairBuilder, make_pair, region_masks
from kvrag.repair.train import Trainer
from kvrag.repair.train_config import TrainConfig, lr_factor
from kvrag_testing.fusion_suite import FusionCase, FusionMethodTests, check_suffix_fold, context_kv, fusion_case
from kvrag_testing.tiny import FAMILIES, tiny_model

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


def _cfg(**kw) -> RepairConfig:
    base = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "embed_dim": 64, "d_b": 64, "num_blocks": 2,
            "d_seg": 4, "attn_head_dim": 32}
    return RepairConfig(**{**base, **kw})


def _randomized(cfg: RepairConfig, seed: int = 0) -> RepairModel:
    torch.manual_seed(seed)
    m = RepairModel(cfg)
    torch.nn.init.normal_(m.head.weight, std=0.05)  # a non-trivial output (the real init is zero)
    m.set_stats(torch.rand(cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim) + 0.5,
                torch.rand(cfg.num_layers, 2, cfg.num_kv_heads, cfg.head_dim) + 0.1)
    return m.eval()


def _corpus(path: Path, groups: int, seed: int = 0, chunks: tuple[int, int] = (2, 4)) -> Path:
    r = random.Random(seed)
    with path.open("w") as f:
        for g in range(groups):
            n = r.randint(*chunks)
            f.write(json.dumps({
                "id": f"group-{g}",
                "titles": [f"Title {g}.{i}" for i in range(n)],
                "passages": [" ".join(r.choice(WORDS) for _ in range(r.randint(4, 10))) for _ in range(n)],
            }) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------------------
# network
# ---------------------------------------------------------------------------------------------------------------


def test_pack_unpack_roundtrip() -> None:
    k, v = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    feats = pack_kv(k, v)
    assert feats.shape == (5, 12, 8)
    k2, v2 = unpack_kv(feats, 3, 2)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.equal(feats[:, (1 * 2 + 0) * 2 + 1], k[1, 1])  # segment (l=1, K, h=1)
    assert torch.equal(feats[:, (2 * 2 + 1) * 2 + 0], v[2, 0])  # segment (l=2, V, h=0)


def test_block_causal_mask_semantics() -> None:
    ci = torch.tensor([[0, 0, 1, 1, 1, 2, -1]])
    m = block_causal_mask(ci)[0, 0]
    assert m[0, 1] and m[1, 0]  # bidirectional inside a chunk
    assert m[3, 0] and not m[0, 3]  # later chunks see earlier ones, never the reverse
    assert not m[5, 6] and m[6, 6] and not m[6, 0]  # padding is invisible and sees itself only


def test_later_chunk_never_changes_earlier_outputs() -> None:
    cfg = _cfg()
    m = _randomized(cfg)
    g = torch.Generator().manual_seed(1)
    n = 15
    ci = torch.tensor([0] * 5 + [1] * 6 + [2] * 4)
    stale = torch.randn(n, cfg.num_segments, cfg.head_dim, generator=g)
    emb = torch.randn(n, cfg.embed_dim, generator=g)
    z = m(stale, emb, ci)
    stale2, emb2 = stale.clone(), emb.clone()
    stale2[11:] += torch.randn(4, cfg.num_segments, cfg.head_dim, generator=g)
    emb2[11:] = torch.randn(4, cfg.embed_dim, generator=g)
    z2 = m(stale2, emb2, ci)
    assert torch.equal(z[:11], z2[:11])  # chunks 0 and 1 unaffected, bit for bit
    assert not torch.allclose(z[11:], z2[11:])
    stale3 = stale.clone()
    stale3[5] += 1.0  # first token of chunk 1
    z3 = m(stale3, emb, ci)
    assert torch.equal(z[:5], z3[:5])
    assert not torch.allclose(z[6:11], z3[6:11])  # bidirectional within chunk 1
    assert not torch.allclose(z[11:], z3[11:])  # and forward to chunk 2


def test_batched_padding_matches_unbatched() -> None:
    cfg = _cfg()
    m = _randomized(cfg)
    g = torch.Generator().manual_seed(2)
    s1, e1 = torch.randn(7, cfg.num_segments, 16, generator=g), torch.randn(7, 64, generator=g)
    s2, e2 = torch.randn(4, cfg.num_segments, 16, generator=g), torch.randn(4, 64, generator=g)
    c1, c2 = torch.tensor([0, 0, 0, 1, 1, 2, 2]), torch.tensor([0, 0, 1, 1])
    pad = 3
    stale = torch.stack([s1, torch.cat([s2, torch.zeros(pad, cfg.num_segments, 16)])])
    emb = torch.stack([e1, torch.cat([e2, torch.zeros(pad, 64)])])
    ci = torch.stack([c1, torch.cat([c2, torch.full((pad,), -1)])])
    z = m(stale, emb, ci)
    torch.testing.assert_close(z[0], m(s1, e1, c1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(z[1, :4], m(s2, e2, c2), atol=1e-5, rtol=1e-5)


def test_zero_head_returns_stale_exactly() -> None:
    cfg = _cfg()
    torch.manual_seed(0)
    m = RepairModel(cfg)
    m.set_stats(torch.rand(2, 2, 2, 16) + 0.5, torch.rand(2, 2, 2, 16) + 0.1)
    stale = torch.randn(9, cfg.num_segments, 16) * 3
    out = m.repair(stale, torch.randn(9, 64), torch.tensor([0] * 4 + [1] * 5))
    assert torch.equal(out, stale)


def test_fused_repair_equals_the_forward_definition() -> None:
    """repair() folds sigma_stale into the encoder and sigma_delta into the head (one addmm over the stale KV); it
    is the same map as the definition stale + sigma_delta * forward(stale / sigma_stale ...), batched or not."""
    cfg = _cfg()
    m = _randomized(cfg, seed=3)
    stale = torch.randn(2, 9, cfg.num_segments, 16) * 3
    emb, ci = torch.randn(2, 9, 64), torch.tensor([[0] * 4 + [1] * 5, [0] * 6 + [1] * 3])
    for b in (0, 1):
        want = stale[b] + m.residual(m(stale[b], emb[b], ci[b]))
        got = m.repair(stale[b], emb[b], ci[b])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert got.shape == stale[b].shape and got.dtype == torch.float32
    want = stale + m.residual(m(stale, emb, ci))
    torch.testing.assert_close(m.repair(stale, emb, ci), want, atol=1e-5, rtol=1e-5)
    # the encoder's folded scale is the definition: scaling the input or the projection is the same map
    x = torch.randn(1, 5, cfg.num_segments, 16)
    inv = torch.rand(cfg.num_segments, 16) + 0.5
    torch.testing.assert_close(m.encoder(x, inv), m.encoder(x * inv), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_repair_kv_in_the_cache_layout_equals_repair_of_the_packed_kv(dtype: torch.dtype) -> None:
    """The serving path (encoder on the [L, H, N, D] tensors, the head one layer at a time, in place, lead skipped,
    natively in the repairer's dtype) computes repair(pack_kv(k, v)) -- also when the values are a strided slice
    of a longer cache, which it writes in place and only in the repaired rows; keys given placed (rotated) are
    repaired through ``place`` from their canonical form."""
    cfg = _cfg(num_layers=3, num_kv_heads=2)
    m = _randomized(cfg, seed=5)
    L, H, N, D, lead = 3, 2, 11, 16, 3
    k, v = torch.randn(L, H, N, D) * 2, torch.randn(L, H, N, D)
    emb, ci = torch.randn(N, 64), torch.tensor([0] * lead + [1] * 4 + [2] * 4)
    pos = torch.arange(N) + 7
    want_k, want_v = unpack_kv(m.repair(pack_kv(k, v), emb, ci, pos), L, H)
    assert (want_k[:, :, lead:] - k[:, :, lead:]).abs().max() > 1e-2  # the residual is real: the checks have teeth
    m.to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    cache_v = torch.randn(L, H, N + 6, D, dtype=dtype)
    cache_v[:, :, 2:2 + N] = v.to(dtype)
    before = cache_v.clone()
    kk = k.clone().to(dtype)
    rk, rv = m.repair_kv(kk, cache_v[:, :, 2:2 + N], emb.to(dtype), ci, pos, skip=lead)
    assert rk.dtype == rv.dtype == dtype
    torch.testing.assert_close(rk.float(), want_k[:, :, lead:], **tol)
    torch.testing.assert_close(rv.float(), want_v[:, :, lead:], **tol)
    assert rv.data_ptr() == cache_v[:, :, 2 + lead].data_ptr()  # written where it lies
    untouched = torch.ones(N + 6, dtype=torch.bool)
    untouched[2 + lead:2 + N] = False
    assert torch.equal(cache_v[:, :, untouched], before[:, :, untouched])
    assert torch.equal(kk[:, :, :lead], k[:, :, :lead].to(dtype))  # the lead is read, never written
    # placed keys: the encoder reads the canonical ones, the residual is rotated into the placed ones
    rot = torch.linalg.qr(torch.randn(D, D, dtype=torch.float64))[0].float()  # any linear "placement"
    placed = (k @ rot).to(dtype)
    rk2, _ = m.repair_kv(placed, v.clone().to(dtype), emb.to(dtype), ci, pos, skip=lead, canonical_keys=k.to(dtype),
                         place=lambda r, layer: (r.float() @ rot).to(dtype))
    torch.testing.assert_close(rk2.float(), want_k[:, :, lead:] @ rot, **tol)
    if dtype == torch.float32:  # the segment-major encoder is the packed encoder
        inv = torch.rand(cfg.num_segments, 16) + 0.5
        torch.testing.assert_close(m.encoder.forward_kv(k, v, inv), m.encoder(pack_kv(k, v)[None], inv)[0],
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one shape"):
        m.repair_kv(k, v[:, :, :-1], emb, ci)


def test_preset_parameter_count_matches_paper_table_12() -> None:
    # Qwen2.5-3B (36 layers, 2 KV heads, head dim 128, hidden 2048) with Table 4 "Small": 9.46M in Table 12.
    cfg = RepairConfig.from_preset("base", num_layers=36, num_kv_heads=2, head_dim=128, embed_dim=2048)
    assert abs(RepairModel(cfg).num_parameters / 1e6 - 9.46) < 0.02


def test_save_load_roundtrip_bit_exact(tmp_path: Path) -> None:
    cfg = _cfg()
    m = _randomized(cfg)
    m.save_pretrained(tmp_path, target_fingerprint="fp-a", target_name="tiny", training={"steps": 3})
    meta = json.loads((tmp_path / "repair_config.json").read_text())
    assert meta["target"]["model_fingerprint"] == "fp-a"
    assert meta["kvrag_version"] and meta["architecture"]["d_b"] == 64 and meta["training"] == {"steps": 3}
    m2 = RepairModel.from_pretrained(tmp_path, "fp-a")
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    stale, emb, ci = torch.randn(6, cfg.num_segments, 16), torch.randn(6, 64), torch.tensor([0, 0, 0, 1, 1, 1])
    assert torch.equal(m.repair(stale, emb, ci), m2.repair(stale, emb, ci))


def test_checkpoint_for_other_model_raises(tmp_path: Path) -> None:
    _randomized(_cfg()).save_pretrained(tmp_path, target_fingerprint="fp-a")
    with pytest.raises(CheckpointMismatchError, match="train-repairer"):
        RepairModel.from_pretrained(tmp_path, expected_model_fingerprint="fp-b")
    with pytest.raises(ConfigError):
        RepairModel.from_pretrained(tmp_path / "nowhere")


# ---------------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------------


def test_build_document_budget() -> None:
    tok = lambda s: s.split()  # noqa: E731  (one "token" per word)
    r = ChunkRenderer("{title} {passage}")
    chunks = build_document(["a", "b", "c"], ["x " * 10, "y " * 10, "z " * 10], tok, renderer=r, max_tokens=25)
    assert [len(c) for c in chunks] == [11, 11]  # the third does not fit
    chunks = build_document(["a", "b"], ["x " * 40, "y " * 5], tok, renderer=r, max_tokens=30, min_chunk_tokens=8)
    assert [len(c) for c in chunks] == [22, 6]  # the first is cut so a second chunk fits; the second is cut too
    assert build_document(["a"], ["x"], tok, renderer=r) is None
    assert len(build_document(["t"] * 30, ["w"] * 30, tok, renderer=r, max_chunks=20)) == 20


def test_build_document_separator_spans() -> None:
    tok = lambda s: s.split()  # noqa: E731
    r = ChunkRenderer("{title} {passage}")
    chunks = build_document(["a", "b", "c"], ["x " * 4, "y " * 4, "z " * 4], tok, renderer=r, max_tokens=14,
                            separator="SEP")
    # chunk, separator span, chunk; the third chunk (plus its separator) does not fit
    assert chunks == [["a", *["x"] * 4], ["SEP"], ["b", *["y"] * 4]]
    # the separator is not a chunk: min_chunks counts passages, and room is kept for the separator
    assert build_document(["a"], ["x"], tok, renderer=r, separator="SEP") is None
    cut = build_document(["a", "b"], ["x " * 40, "y " * 5], tok, renderer=r, max_tokens=30, separator="S S")
    assert [len(c) for c in cut] == [20, 2, 6] and cut[1] == ["S", "S"]
    assert len([c for c in build_document(["t"] * 30, ["w"] * 30, tok, renderer=r, separator="S") if c != ["S"]]) == 20


def test_per_lead_style_renders_chunks_as_the_lead_family_does(lm) -> None:
    """With per_lead_style each document's chunks follow its lead's prompt family (LlamaIndex: title metadata line +
    blank line + text, blank-line separator spans; bench: the "Title:" format, no separators)."""
    from kvrag.repair.leads import LLAMAINDEX_STYLE, chunk_style, style_identity

    tok = lambda s: list(lm.tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    rope, spec = Rope.from_model(lm.model), lm.kv_spec()
    group = {"id": "g", "titles": ["T1", "T2"], "passages": ["alpha beta gamma delta", "epsilon zeta eta theta"]}
    kw = {"tokenizer": lm.tokenizer, "max_tokens": 256, "exact_lead": True}
    li = PairBuilder(lm.model, rope, spec, tok, lead_kinds=("llamaindex-text-qa",), per_lead_style=True, **kw)
    spans = li.chunks(group, "llamaindex-text-qa")
    assert spans == [tok("title: T1\n\nalpha beta gamma delta"), tok("\n\n"), tok("title: T2\n\nepsilon zeta eta theta")]
    ex = li.build(group)
    assert ex.lead_kind == "llamaindex-text-qa" and ex.num_chunks == 4  # lead, chunk, separator, chunk
    bench = PairBuilder(lm.model, rope, spec, tok, lead_kinds=("bench:basic",), per_lead_style=True, **kw)
    fixed = PairBuilder(lm.model, rope, spec, tok, lead_kinds=("bench:basic",), **kw)
    assert bench.chunks(group, "bench:basic") == fixed.chunks(group, "bench:basic")  # the bench family is unchanged
    assert chunk_style("langchain-rag").separator == "\n\n" and chunk_style("bare") == chunk_style("bench:terse")
    assert chunk_style("llamaindex-refine") == LLAMAINDEX_STYLE
    # the pair-cache manifest tells the two apart
    assert bench.identity()["renderer"] == style_identity() != fixed.identity()["renderer"]


def test_make_pair_matches_engine_stale_and_joint_prefill(lm) -> None:
    model, rope = lm.model, Rope.from_model(lm.model)
    spec = lm.kv_spec()
    prefix = template_prefix_ids(lm.tokenizer)
    assert prefix  # the tiny tokenizer has a chat template
    chunks = [list(range(10, 17)), list(range(40, 52)), list(range(80, 85))]
    ex = make_pair(model, rope, spec, chunks, prefix)
    assert ex.num_tokens == 24 and ex.num_chunks == 3
    # stale == the engine's chunk cache conditioned on the prefix
    c1 = compute_chunk_kv(model, rope, spec, chunks[1], prefix)
    k, v = unpack_kv(ex.stale, spec.num_layers, spec.num_kv_heads)
    assert torch.equal(k[:, :, 7:19], c1.keys) and torch.equal(v[:, :, 7:19], c1.values)
    # joint == one prefill of prefix + all chunks, canonical
    jk, jv = hf_cache.prefill_kv(model, torch.tensor([*prefix, *sum(chunks, [])]))
    p = len(prefix)
    jkc = rope.canonicalize(jk[:, :, p:], torch.arange(p, p + 24))
    k2, v2 = unpack_kv(ex.joint, spec.num_layers, spec.num_kv_heads)
    torch.testing.assert_close(k2, jkc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v2, jv[:, :, p:], atol=1e-5, rtol=1e-5)
    regions = region_masks(ex.chunk_index)
    assert regions["first"].sum() == 7 and regions["boundary"].sum() == 8 + 5 and regions["interior"].sum() == 4
    assert ex.delta[regions["first"]].abs().max() < 1e-4  # the first chunk already has its full context
    assert ex.delta[~regions["first"]].abs().mean() > 1e-2


def test_prefix_matches_engine(lm) -> None:
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.store.memory import MemoryStore

    eng = KVRAGEngine(lm, MemoryStore())
    assert template_prefix_ids(lm.tokenizer, "template") == eng.chunk_prefix_ids


def test_pair_cache_roundtrip_and_manifest(lm, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl", 6)
    rope = Rope.from_model(lm.model)
    spec = lm.kv_spec()
    tok = lambda s: list(lm.tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    builder = PairBuilder(lm.model, rope, spec, tok, prefix_ids=(3, 4), max_tokens=64)
    index = CorpusIndex(corpus, "all")
    assert len(index) == 6
    ds = PairDataset(index, builder, tmp_path / "pairs", cache_dtype="float32")
    a = ds[2]
    assert ds.is_cached(2)
    b = ds[2]
    assert torch.equal(a.stale, b.stale) and torch.equal(a.delta, b.delta) and a.group_id == b.group_id
    other = PairBuilder(lm.model, rope, spec, tok, prefix_ids=(3,), max_tokens=64)
    with pytest.raises(ConfigError, match="different settings"):
        PairDataset(index, other, tmp_path / "pairs", cache_dtype="float32")


def test_lr_schedule() -> None:
    f = [lr_factor(s, 100, 10, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[9:], f[10:], strict=False))
    assert f[-1] == pytest.approx(0.1, abs=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------------------------


def _train_cfg(tmp_path: Path, corpus: Path, **kw) -> TrainConfig:
    base = {"data": str(corpus), "out": str(tmp_path / "out"), "preset": "tiny", "steps": 6, "batch_docs": 2,
            "max_tokens": 96, "eval_docs": 0, "stats_docs": 4, "progress": False, "log_every": 1,
            "eval_every": 1000, "save_every": 1000, "lr": 3e-3, "pairs": str(tmp_path / "pairs")}
    return TrainConfig(**{**base, **kw})


def test_training_overfits_a_handful_of_documents(lm, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    corpus = _corpus(tmp_path / "c.jsonl", 3, chunks=(2, 3))
    cfg = _train_cfg(tmp_path, corpus, steps=120, batch_docs=3, max_train_docs=3, eval_modulus=10**9, d_b=128,
                     lr=3e-3, min_lr=1e-3, warmup=5, weight_decay=0.0, cache_pairs=False)
    tr = Trainer(cfg, lm)
    assert len(tr.train_set) == 3
    losses = [tr.train_step()["loss"] for _ in range(cfg.steps)]
    assert losses[-1] < losses[0] / 10, (losses[0], losses[-1])


def test_resume_continues_the_same_schedule(lm, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl", 12)
    # A: uninterrupted
    cfg_a = _train_cfg(tmp_path, corpus, out=str(tmp_path / "a"))
    tr_a = Trainer(cfg_a, lm)
    tr_a.train()
    curve_a = [json.loads(x) for x in (tmp_path / "a" / "curve.jsonl").read_text().splitlines()]
    # B: three updates, checkpoint, a new process resumes
    cfg_b = _train_cfg(tmp_path, corpus, out=str(tmp_path / "b"))
    tr_b = Trainer(cfg_b, lm)
    lrs_b = [tr_b.train_step()["lr"] for _ in range(3)]
    tr_b.save_state()
    tr_c = Trainer(cfg_b, lm, resume=True)
    assert tr_c.step == 3 and tr_c.samples == 6
    assert tr_c.optimizer.param_groups[0]["lr"] == tr_b.optimizer.param_groups[0]["lr"]
    lrs_c = [tr_c.train_step()["lr"] for _ in range(3)]
    lrs_a = [r["lr"] for r in curve_a if r["kind"] == "train"]
    assert lrs_a == lrs_b + lrs_c
    sa, sc = tr_a.model.state_dict(), tr_c.model.state_dict()
    assert all(torch.equal(sa[k], sc[k]) for k in sa)  # bit-exact continuation
    # changing a pinned setting is refused
    with pytest.raises(ConfigError, match="cannot resume"):
        Trainer(_train_cfg(tmp_path, corpus, out=str(tmp_path / "b"), steps=7), lm, resume=True)
    # the exported repairer loads for this model and is refused for another
    RepairModel.from_pretrained(tmp_path / "a", lm.fingerprint)
    with pytest.raises(CheckpointMismatchError):
        RepairModel.from_pretrained(tmp_path / "a", "0" * 64)


def test_init_from_continues_a_trained_repairer(lm, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl", 12)
    tr_a = Trainer(_train_cfg(tmp_path, corpus, out=str(tmp_path / "a")), lm)
    tr_a.train()
    tr_a.export()
    # B starts from A's weights and statistics, with its own optimizer and schedule
    cfg_b = _train_cfg(tmp_path, corpus, out=str(tmp_path / "b"), init_from=str(tmp_path / "a"), steps=2, lr=1e-3)
    tr_b = Trainer(cfg_b, lm)
    sa, sb = tr_a.model.state_dict(), tr_b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # weights and sigma buffers
    assert tr_b.optimizer.state == {}
    assert tr_b.summary()["init_from"]["steps"] == 6
    tr_b.train()
    assert not all(torch.equal(sa[k], tr_b.model.state_dict()[k]) for k in sa)
    from kvrag.repair.card import render_card
    from kvrag.repair.model import read_config

    card = render_card(read_config(tmp_path / "b"), command=None, bench=None, bench_command=None, has_plot=False)
    assert f"continued from `{tmp_path / 'a'}`" in card and "6 steps" in card
    # a resumed B keeps its own weights (not A's again) and the pinned init_from
    tr_b.save_state()
    tr_c = Trainer(cfg_b, lm, resume=True)
    assert all(torch.equal(tr_b.model.state_dict()[k], tr_c.model.state_dict()[k]) for k in sa)
    with pytest.raises(ConfigError, match="cannot resume"):
        Trainer(_train_cfg(tmp_path, corpus, out=str(tmp_path / "b"), steps=2, lr=1e-3), lm, resume=True)
    # another architecture or other conditioning is refused, naming the difference
    with pytest.raises(ConfigError, match="architecture"):
        Trainer(_train_cfg(tmp_path, corpus, out=str(tmp_path / "d"), init_from=str(tmp_path / "a"), d_b=32), lm)
    with pytest.raises(ConfigError, match="exact_lead"):
        Trainer(_train_cfg(tmp_path, corpus, out=str(tmp_path / "e"), init_from=str(tmp_path / "a"),
                           exact_lead=False), lm)


def test_eval_reports_regions(lm, tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "c.jsonl", 30)
    # v1 data (lead = the conditioning prefix, dropped): the first chunk's stale KV is exact
    tr = Trainer(_train_cfg(tmp_path, corpus, eval_docs=2, eval_modulus=3, steps=0, lead_kinds=[], exact_lead=False,
                            pairs=str(tmp_path / "pairs_v1")), lm)
    r = tr.evaluate()
    assert r["eval_docs"] == 2
    assert r["nmse"] == pytest.approx(r["nmse_stale"])  # untrained: repair == stale
    assert r["rel_rmse.boundary.K.stale"] > 0 and r["rel_rmse.first.V.stale"] < 1e-3
    # v2 (default): a real-prompt lead precedes chunk 1, so the first chunk is stale too and gets a target
    tr2 = Trainer(_train_cfg(tmp_path, corpus, eval_docs=2, eval_modulus=3, steps=0, out=str(tmp_path / "o2")), lm)
    r2 = tr2.evaluate()
    assert r2["nmse"] == pytest.approx(r2["nmse_stale"])
    assert r2["rel_rmse.first.V.stale"] > 1e-2 and r2["rel_rmse.first.K.stale"] > 1e-2


def test_v2_pair_keeps_the_exact_lead_as_chunk_zero(lm) -> None:
    """The lead is chunk 0 with stale == joint (delta 0) and the chunks' joint KV equals one joint prefill."""
    from kvrag.repair.leads import LEAD_KINDS, render_lead

    rope, spec = Rope.from_model(lm.model), lm.kv_spec("float32")
    tok = lm.tokenizer
    lead = tuple(tok(render_lead(tok, "llamaindex-text-qa", "Who?"), add_special_tokens=False)["input_ids"])
    chunks = [[5, 6, 7, 8], [9, 10, 11]]
    ex = make_pair(lm.model, rope, spec, chunks, (3, 4), lead, exact_lead=True, lead_kind="llamaindex-text-qa")
    p = len(lead)
    assert ex.num_exact == p and ex.num_tokens == p + 7 and ex.lead_kind == "llamaindex-text-qa"
    assert ex.chunk_index.tolist() == [0] * p + [1] * 4 + [2] * 3
    assert ex.token_ids.tolist() == list(lead) + [5, 6, 7, 8, 9, 10, 11]
    assert float(ex.delta[:p].abs().max()) == 0.0
    assert float(ex.delta[p:p + 4].abs().max()) > 0  # chunk 1 is stale behind a real lead
    v1 = make_pair(lm.model, rope, spec, chunks, (3, 4), lead)
    torch.testing.assert_close(ex.joint[p:], v1.joint, rtol=0, atol=1e-5)
    for kind in LEAD_KINDS:  # every lead renders and ends before the chunk would start
        assert render_lead(tok, kind, "Who?").strip()


def test_publish_writes_card_from_the_run(lm, tmp_path: Path) -> None:
    """The model card quotes the run's own numbers, and the published checkpoint loads for the same model."""
    from kvrag.repair.card import CARD, publish

    corpus = _corpus(tmp_path / "c.jsonl", 12)
    tr = Trainer(_train_cfg(tmp_path, corpus, eval_docs=2, eval_modulus=3, steps=3, eval_every=3), lm)
    tr.train()
    tr.export()
    dest = publish(tmp_path / "out", tmp_path / "shipped", command="kvrag train-repairer --steps 3")
    card = (dest / CARD).read_text()
    ev = json.loads((dest / CONFIG_NAME).read_text())["training"]["final_eval"]
    assert f"{ev['nmse']:.4f}" in card and "kvrag train-repairer --steps 3" in card
    assert f"{tr.summary()['train_documents']} documents for training" in card
    RepairModel.from_pretrained(dest, lm.fingerprint)
    with pytest.raises(FileNotFoundError, match="train-repairer"):
        publish(tmp_path / "nothing-here")
    # publishing the same run again is fine; another run over it needs replace=True (no silent re-shipping)
    publish(tmp_path / "out", dest)
    shipped = (dest / "repair_model.safetensors").read_bytes()
    tr.model.head.bias.data += 1.0
    tr.export(tmp_path / "other")
    with pytest.raises(ConfigError, match="already holds another repairer"):
        publish(tmp_path / "other", dest)
    assert (dest / "repair_model.safetensors").read_bytes() == shipped  # untouched
    publish(tmp_path / "other", dest, replace=True)
    assert (dest / "repair_model.safetensors").read_bytes() != shipped


# ---------------------------------------------------------------------------------------------------------------
# fusion method
# ---------------------------------------------------------------------------------------------------------------


def _fusion_input(lm, canonical: bool = False):
    model, rope = lm.model, Rope.from_model(lm.model)
    spec = lm.kv_spec()
    prefix = template_prefix_ids(lm.tokenizer)
    pieces = [("prefix", compute_chunk_kv(model, rope, spec, prefix), None)]
    for i, ids in enumerate((range(10, 19), range(30, 42), range(60, 66))):
        pieces.append(("chunk", compute_chunk_kv(model, rope, spec, list(ids), prefix), f"c{i}"))
    return assemble(model, rope, spec, pieces, [5, 6, 7], canonical=canonical), len(prefix)


def test_the_stored_canonical_keys_serve_the_repairer_as_the_rotated_back_ones(lm, tmp_path: Path) -> None:
    """The engine hands cacherepair the fetched chunks' canonical keys (assemble(canonical=True)) instead of letting
    it rotate the placed keys back: the same keys to fp32 rounding, and the same repair."""
    inp, _ = _fusion_input(lm, canonical=True)
    plain, _ = _fusion_input(lm)
    assert inp.canonical_keys is not None and plain.canonical_keys is None
    pos = torch.arange(inp.context_len)
    torch.testing.assert_close(inp.canonical_keys, inp.rope.canonicalize(inp.keys, pos), rtol=0, atol=2e-6)
    method = get_method(f"cacherepair:checkpoint={_checkpoint(lm, tmp_path / 'r', zero=False)}")
    k, v = hf_cache.cache_to_tensors(method.fuse(inp).cache)
    kp, vp = hf_cache.cache_to_tensors(method.fuse(plain).cache)
    torch.testing.assert_close(k, kp, rtol=0, atol=1e-5)
    torch.testing.assert_close(v, vp, rtol=0, atol=1e-5)


def _checkpoint(lm, path: Path, *, zero: bool) -> Path:
    spec = lm.kv_spec()
    cfg = RepairConfig.from_preset("tiny", num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                                   head_dim=spec.head_dim, embed_dim=64)
    m = RepairModel(cfg) if zero else _randomized(cfg)
    return m.save_pretrained(path, target_fingerprint=lm.fingerprint)


def test_cacherepair_method_shapes_and_no_mutation(lm, tmp_path: Path) -> None:
    """On the engine's zero-copy path (an assembled input owns its buffer) the repair is written in place; on
    tensors without a buffer the inputs are left alone. Either way the stored chunks are never touched."""
    import dataclasses

    inp, p = _fusion_input(lm)
    before = (inp.keys.clone(), inp.values.clone())
    method = get_method(f"cacherepair:checkpoint={_checkpoint(lm, tmp_path / 'r', zero=False)}")
    plain = dataclasses.replace(inp, keys=before[0].clone(), values=before[1].clone(), buffer=None)
    out_plain = method.fuse(plain)
    assert torch.equal(plain.keys, before[0]) and torch.equal(plain.values, before[1])
    out = method.fuse(inp)
    k, v = hf_cache.cache_to_tensors(out.cache)
    assert k.shape == inp.keys.shape and v.shape == inp.values.shape
    assert k.dtype == inp.keys.dtype and v.dtype == inp.values.dtype
    assert k.data_ptr() == inp.keys.data_ptr()  # the request's buffer, repaired in place: no copy
    assert torch.equal(k[:, :, :p], before[0][:, :, :p])  # the exact prefix is left alone
    assert not torch.allclose(k[:, :, p:], before[0][:, :, p:])
    kp, vp = hf_cache.cache_to_tensors(out_plain.cache)
    torch.testing.assert_close(k, kp, rtol=0, atol=1e-5)  # same repair on both paths
    torch.testing.assert_close(v, vp, rtol=0, atol=1e-5)
    assert out.stats.repaired_tokens == inp.context_len - p


def test_cacherepair_untrained_equals_stale(lm, tmp_path: Path) -> None:
    inp, _ = _fusion_input(lm)
    stale = (inp.keys.clone(), inp.values.clone())
    out = get_method(f"cacherepair:checkpoint={_checkpoint(lm, tmp_path / 'z', zero=True)}").fuse(inp)
    k, v = hf_cache.cache_to_tensors(out.cache)
    torch.testing.assert_close(k, stale[0], rtol=0, atol=2e-6)  # canonicalize + re-place: fp32 rounding only
    assert torch.equal(v, stale[1])


def test_cacherepair_errors(lm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inp, _ = _fusion_input(lm)
    monkeypatch.setattr(lm.model.config, "name_or_path", "/models/my model.gguf")
    with pytest.raises(ConfigError, match=re.escape("train-repairer --model '/models/my model.gguf' ")):
        get_method("cacherepair").fuse(inp)  # nothing shipped for a tiny random model: the hint names it
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="train-repairer"):
        get_method(f"cacherepair:checkpoint={tmp_path / 'missing'}").fuse(inp)
    other = RepairModel(RepairConfig.from_preset("tiny", num_layers=2, num_kv_heads=2, head_dim=16, embed_dim=64))
    other.save_pretrained(tmp_path / "other", target_fingerprint="f" * 64)
    with pytest.raises(CheckpointMismatchError):
        get_method(f"cacherepair:checkpoint={tmp_path / 'other'}").fuse(inp)


def test_hybrid_without_a_repairer_names_itself_and_its_parameter(lm, tmp_path: Path) -> None:
    inp, _ = _fusion_input(lm)
    for spec in ("hybrid:r=0.1", f"hybrid:r=0.1,checkpoint={tmp_path / 'missing'}"):
        with pytest.raises(ConfigError) as got:
            get_method(spec).fuse(inp)
        msg = str(got.value)
        assert msg.startswith("hybrid (CacheRepair, then RelaxKV): ") and "`hybrid:checkpoint=DIR`" in msg, msg
        assert "cacherepair:checkpoint" not in msg and "train-repairer" in msg


# ---------------------------------------------------------------------------------------------------------------
# the standard fusion-method suite (docs/architecture.md#tests), with a randomized repairer per tiny family
# ---------------------------------------------------------------------------------------------------------------

_SUITE_ROOT = Path(tempfile.mkdtemp(prefix="kvrag-cacherepair-suite-"))
atexit.register(shutil.rmtree, _SUITE_ROOT, ignore_errors=True)


class TestCacheRepairSuite(FusionMethodTests):
    method_spec = f"cacherepair:checkpoint={_SUITE_ROOT}"  # a directory of repairers, one per model fingerprint

    @pytest.fixture(params=FAMILIES, scope="class")
    def case(self, request: Any) -> FusionCase:
        torch.set_num_threads(1)
        case = fusion_case(request.param, self.num_layers, 0, self.decode_steps)
        target = _SUITE_ROOT / request.param
        if not (target / "repair_config.json").is_file():
            s = case.spec
            cfg = RepairConfig.from_preset("tiny", num_layers=s.num_layers, num_kv_heads=s.num_kv_heads,
                                           head_dim=s.head_dim, embed_dim=int(case.model.config.hidden_size))
            _randomized(cfg).save_pretrained(target, target_fingerprint=s.model_fingerprint)
        return case


class TestHybridSuite(TestCacheRepairSuite):
    """``hybrid`` (CacheRepair, then RelaxKV over the repaired cache) on the standard suite; at r = 1 it is full."""

    method_spec = f"hybrid:r=0.3,checkpoint={_SUITE_ROOT}"
    recompute_all_spec = f"hybrid:r=1,checkpoint={_SUITE_ROOT}"

    def test_both_steps_run(self, case: FusionCase) -> None:
        inp = case.fusion_input()
        out = get_method(self.method_spec).fuse(inp)
        part = out.stats.repair  # the CacheRepair step's stats, serialized as repair_* keys
        assert part is not None and part.repaired_tokens and 0 < out.stats.recomputed_fraction < 1
        assert out.stats.to_dict()["repair_repaired_tokens"] == part.repaired_tokens
        k, _ = context_kv(out, inp.context_len)
        rep_k, _ = context_kv(get_method(f"cacherepair:checkpoint={_SUITE_ROOT}").fuse(case.fusion_input()),
                              inp.context_len)
        relax_k, _ = context_kv(get_method("relaxkv:r=0.3").fuse(case.fusion_input()), inp.context_len)
        assert not torch.allclose(k, rep_k) and not torch.allclose(k, relax_k)

    def test_suffix_is_folded_into_the_recompute(self, case: FusionCase) -> None:
        """On the engine's zero-copy input the suffix rides along in RelaxKV's full-context recompute: cache and
        logits equal repairing first and prefilling the suffix afterwards."""
        check_suffix_fold(case, self.method_spec)


def test_v2_checkpoint_reads_the_exact_lead(lm, tmp_path: Path) -> None:
    """A checkpoint trained with the exact lead (conditioning.exact_lead) reads the prefix span as chunk 0 and
    leaves it exact; an older one does not read it. Both repair the same chunk tokens."""
    inp, p = _fusion_input(lm)
    spec = lm.kv_spec()
    cfg = RepairConfig.from_preset("tiny", num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                                   head_dim=spec.head_dim, embed_dim=64)
    m = _randomized(cfg)
    v1 = m.save_pretrained(tmp_path / "v1", target_fingerprint=lm.fingerprint)
    v2 = m.save_pretrained(tmp_path / "v2", target_fingerprint=lm.fingerprint,
                           extra={"conditioning": {"exact_lead": True}})
    stale = inp.keys.clone()
    o1 = get_method(f"cacherepair:checkpoint={v1}").fuse(_fusion_input(lm)[0])
    o2 = get_method(f"cacherepair:checkpoint={v2}").fuse(inp)
    assert o1.stats.exact_lead_tokens == 0 and o2.stats.exact_lead_tokens == p
    assert o1.stats.repaired_tokens == o2.stats.repaired_tokens == inp.context_len - p
    k1, _ = hf_cache.cache_to_tensors(o1.cache)
    k2, _ = hf_cache.cache_to_tensors(o2.cache)
    assert torch.equal(k2[:, :, :p], stale[:, :, :p])  # the lead is read, never written
    assert not torch.allclose(k1[:, :, p:], k2[:, :, p:])  # reading the lead changes the repair


def test_conditioning_mismatch_warns_once(lm, tmp_path: Path, caplog) -> None:
    import dataclasses
    import logging

    inp, _ = _fusion_input(lm)
    spec = lm.kv_spec()
    cfg = RepairConfig.from_preset("tiny", num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                                   head_dim=spec.head_dim, embed_dim=64)
    path = RepairModel(cfg).save_pretrained(tmp_path / "r", target_fingerprint=lm.fingerprint, extra={
        "conditioning": {"chunk_prefix": "template", "chunk_prefix_ids": [1, 2, 3]}})
    method = get_method(f"cacherepair:checkpoint={path}")
    with caplog.at_level(logging.WARNING, logger="kvrag.fusion.cacherepair"):
        method.fuse(dataclasses.replace(inp, chunk_prefix_ids=(1, 2, 3)))  # as trained: quiet
        assert not caplog.records
        for _ in range(2):
            method.fuse(dataclasses.replace(_fusion_input(lm)[0], chunk_prefix_ids=()))
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "conditioned on 3 prefix tokens" in msgs[0] and "0 tokens" in msgs[0]


def test_one_checkpoint_instance_per_process(lm, tmp_path: Path) -> None:
    """engine.method, hybrid and auto share one CacheRepair instance per spec, so a checkpoint loads once."""
    from kvrag.engine.engine import KVRAGEngine
    from kvrag.fusion import shared_method
    from kvrag.store import MemoryStore

    ckpt = _checkpoint(lm, tmp_path / "shared", zero=False)
    spec = f"cacherepair:checkpoint={ckpt}"
    a, b = KVRAGEngine(lm, MemoryStore()), KVRAGEngine(lm, MemoryStore())
    m = a.method(spec)
    assert b.method(spec) is m and a.method(get_method(spec)) is m and shared_method(spec) is m
    hybrid = a.method(f"hybrid:r=0.1,checkpoint={ckpt}")
    assert hybrid.repair is m  # type: ignore[attr-defined]
    inp, _ = _fusion_input(lm)
    m.fuse(inp)
    hybrid.fuse(_fusion_input(lm)[0])
    assert len(m._repairers) == 1  # loaded once for both


def test_a_kept_span_is_left_as_it_is(lm, tmp_path: Path) -> None:
    """K/V an earlier request computed in its context and moved here (kind 'kept', kvrag.engine.relocate) are not
    the alone-computed K/V the repairer corrects: never written; the chunks before it are repaired as without it."""
    model, rope = lm.model, Rope.from_model(lm.model)
    spec = lm.kv_spec()
    prefix = template_prefix_ids(lm.tokenizer)
    pieces = [("prefix", compute_chunk_kv(model, rope, spec, prefix), None),
              ("chunk", compute_chunk_kv(model, rope, spec, list(range(10, 19)), prefix), "c0"),
              ("kept", compute_chunk_kv(model, rope, spec, list(range(30, 42)), prefix), "k0")]
    inp = assemble(model, rope, spec, pieces, [5, 6, 7])
    as_chunk = assemble(model, rope, spec, [*pieces[:2], ("chunk", *pieces[2][1:])], [5, 6, 7])
    stale = inp.keys.clone()
    method = get_method(f"cacherepair:checkpoint={_checkpoint(lm, tmp_path / 'r', zero=False)}")
    out = method.fuse(inp)
    k, _ = hf_cache.cache_to_tensors(out.cache)
    kc, _ = hf_cache.cache_to_tensors(method.fuse(as_chunk).cache)
    p, c = len(prefix), len(prefix) + 9
    assert out.stats.repaired_tokens == 9
    assert torch.equal(k[:, :, c:], stale[:, :, c:])  # the kept span: never written
    assert not torch.allclose(kc[:, :, c:], stale[:, :, c:])  # as a chunk it would have been
    assert not torch.allclose(k[:, :, p:c], stale[:, :, p:c])  # the chunk before it is repaired
