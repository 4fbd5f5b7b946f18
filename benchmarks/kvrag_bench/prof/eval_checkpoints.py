"""Held-out reconstruction of CacheRepair checkpoints on the per-lead-style eval split, by prompt family.

    python benchmarks/kvrag_bench/prof/eval_checkpoints.py CKPT_DIR [CKPT_DIR ...]
(corpus from $KVRAG_CORPUS, default ../shared/data/corpus_train.jsonl; the eval pairs are built into
runs/repairer-v4/pairs if missing, ~15 s each.) Prints normalized MSE and first-chunk K/V relative RMSE for all 16
held-out documents, the bench-style ones and the framework-style (LlamaIndex / LangChain) ones, and the relative
error on the blank-line separator spans between framework chunks.
"""
import os
import sys
import types

import torch

from kvrag.kv import hf_cache
from kvrag.models import load_model
from kvrag.repair.evaluate import evaluate
from kvrag.repair.leads import BENCH_STYLE, chunk_style
from kvrag.repair.model import RepairModel
from kvrag.repair.train import make_datasets
from kvrag.repair.train_config import TrainConfig


def main():
    torch.set_num_threads(1)
    cfg = TrainConfig(data=os.environ.get("KVRAG_CORPUS", "../shared/data/corpus_train.jsonl"), out="runs/repairer-v4", max_train_docs=360,
                      max_tokens=1408, eval_docs=16)
    loaded = load_model(None, dtype="float32")
    d = make_datasets(cfg, loaded)
    ds = d.eval_set
    exs = [ds[i] for i in range(len(ds))]
    fams = {"all": exs, "bench": [e for e in exs if chunk_style(e.lead_kind) == BENCH_STYLE],
            "framework": [e for e in exs if chunk_style(e.lead_kind) != BENCH_STYLE]}
    out = {}
    for ck in sys.argv[1:]:
        rep = RepairModel.from_pretrained(ck).eval()
        shim = types.SimpleNamespace(model=rep, rcfg=rep.cfg, device=torch.device("cpu"))
        shim._inputs = lambda ex: (ex.stale, hf_cache.embed(loaded.model, ex.token_ids)[0].float(), ex.chunk_index,
                                   ex.positions(), ex.delta)
        for fam, lst in fams.items():
            r = evaluate(shim, lst)
            out[f"{ck}|{fam}"] = r
            print(f"{ck:40s} {fam:9s} n={len(lst):2d} nmse {r['nmse']:.3f} (stale {r['nmse_stale']:.3f}) "
                  f"firstK {r['rel_rmse.first.K.repair']:.3f}/{r['rel_rmse.first.K.stale']:.3f} "
                  f"firstV {r['rel_rmse.first.V.repair']:.3f}/{r['rel_rmse.first.V.stale']:.3f}", flush=True)

    # separator spans (LlamaIndex / LangChain blank lines between chunks): relative error repair vs stale
    tok = loaded.tokenizer
    sep = tuple(tok("\n\n", add_special_tokens=False)["input_ids"])
    for ck in sys.argv[1:]:
        rep = RepairModel.from_pretrained(ck).eval()
        num = {"repair": 0.0, "stale": 0.0}
        den = 0.0
        ntok = 0
        for ex in fams["framework"]:
            ci = ex.chunk_index
            starts = [0] + [i for i in range(1, len(ci)) if ci[i] != ci[i - 1]]
            ends = starts[1:] + [len(ci)]
            m = torch.zeros(len(ci), dtype=torch.bool)
            for s, e in zip(starts, ends, strict=True):
                if s >= ex.num_exact and tuple(ex.token_ids[s:e].tolist()) == sep:
                    m[s:e] = True
            if not m.any():
                continue
            emb = hf_cache.embed(loaded.model, ex.token_ids)[0].float()
            out = rep.repair(ex.stale, emb, ex.chunk_index, ex.positions())
            joint = ex.stale + ex.delta
            num["repair"] += (out - joint)[m].pow(2).sum().item()
            num["stale"] += ex.delta[m].pow(2).sum().item()
            den += joint[m].pow(2).sum().item()
            ntok += int(m.sum())
        print(f"{ck:40s} separator tokens {ntok}: rel err repair {(num['repair']/den)**.5:.3f} stale {(num['stale']/den)**.5:.3f}")


if __name__ == "__main__":
    main()
