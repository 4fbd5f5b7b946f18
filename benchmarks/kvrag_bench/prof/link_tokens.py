"""Learned link / trailer tokens over the stale cache (KV Packet, KVLink style; the model frozen), against kvrag's
repairs on dev rows.

Only ``n`` soft input embeddings train ([n, hidden]; 576 x n parameters for SmolLM2-135M):

  trailer  (variant A) n soft tokens after the context, before the question suffix: prefilled over the stale cache
           (they see every chunk), then the suffix over stale + trailer.
  links    (variant B, KVLink) the same n soft tokens after EVERY chunk; group g sees the prefix, chunks 0..g and
           link groups 0..g (one forward, a 4-D bool mask, explicit position_ids); every later position is moved
           by the link tokens inserted before it (cached keys re-rotated by the shift, :class:`kvrag.kv.rope.Rope`).

Teacher: ``full`` on the same prompt. Loss: KL(full || student) of the next-token distributions at the suffix's
last position and along full's first 16 greedy answer tokens, teacher-forced. Training questions are synthetic
("What is {title} known for?", ...) over ``--corpus`` rows (``../shared/data/corpus_train.jsonl``); the QA rows of
``--data`` are only evaluated. The model is loaded dense (``quantize=None``: autograd through the de-quantized tiles)
in float32, and every method of the dev table runs on that same model. Files under ``--root`` (runs/link_tokens).

    cd benchmarks; export HF_HUB_OFFLINE=1 PYTHONPATH=.     # one torch thread throughout
    python -m kvrag_bench.prof.link_tokens prep --n-train 72 --n-held 12       # teacher targets + stale KV, ~10 min
    python -m kvrag_bench.prof.link_tokens train --variant trailer --n 8 --steps 200 --lr 2e-3  # lr choice (vs 1e-2)
    python -m kvrag_bench.prof.link_tokens train --variant trailer --n 4      # 300 steps, lr 1e-2; also --n 8
    python -m kvrag_bench.prof.link_tokens train --variant links --n 4        # also --n 8
    python -m kvrag_bench.prof.link_tokens eval --offset 0 --limit 25 --soft trailer-n4,trailer-n8,links-n4,links-n8

``train`` keeps the step with the lowest KL on the held-out training questions (checked every ``--eval-every``
steps); ``eval`` writes rows.jsonl and prints the table (``table --soft ...`` reprints it).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvrag.config import GenerationConfig
from kvrag.fusion import get_method
from kvrag.kv import hf_cache
from kvrag.kv.rope import Rope
from kvrag_bench.config import BenchConfig
from kvrag_bench.data import QARequest, load_requests
from kvrag_bench.metrics import same_answer
from kvrag_bench.runner import QABenchmark

ROOT = Path("runs/link_tokens")  # --root: every file the commands write and read
CORPUS = Path("../shared/data/corpus_train.jsonl")  # --corpus: passages the synthetic training questions are about
DATA = "../shared/data/qa_dev.jsonl"  # --data: the QA rows ``eval`` scores
KL_TOKENS = 16
TEMPLATES = ("What is {t} known for?", "Who or what is {t}?", "When was {t} born or founded?",
             "Where is {t} from?", "What do you know about {t}?")
BASELINES = ("full", "stale", "cacherepair", "hybrid:r=0.015")


def bench(out: str, data: str | None = None, max_new: int = 24) -> QABenchmark:
    torch.set_num_threads(1)
    cfg = BenchConfig(data=data or DATA, out=str(ROOT / out), methods=list(BASELINES), threads=1, dtype="float32",
                      quantize=None, max_new_tokens=max_new, store="memory://?max_bytes=1.5e9", plots=False,
                      progress=False)
    return QABenchmark(cfg)


def synthetic_requests(n: int, seed: int, max_passages: int) -> list[QARequest]:
    rows = [json.loads(x) for x in CORPUS.read_text().splitlines() if x.strip()]
    rng = random.Random(seed)
    rng.shuffle(rows)
    out = []
    for r in rows[: n * 2]:
        ctx = [(t, p) for t, p in zip(r["titles"], r["passages"], strict=False) if p.strip()][:max_passages]
        if len(ctx) < 3:
            continue
        title = rng.choice(ctx)[0]
        out.append(QARequest(r["id"], rng.choice(TEMPLATES).format(t=title), ("x",), tuple(ctx)))
    return out


def stale_context(b: QABenchmark, plan: Any) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The stale cache of the context (keys placed at 0..Tc-1), and stale's time before its suffix prefill."""
    p = b.engine.prepare(plan, get_method("stale"), reserve=0)
    k, v = hf_cache.cache_to_tensors(p.cache)
    tm, tc = p.timings, plan.context_len
    return k[:, :, :tc].clone(), v[:, :, :tc].clone(), tm.fetch_s + tm.compute_misses_s + tm.assemble_s + tm.repair_s


def chunk_ends(plan: Any) -> list[int]:
    return [s.end for s in plan.context if s.kind == "chunk"]


def prep(args: argparse.Namespace) -> None:
    b = bench("prep", max_new=KL_TOKENS)
    d = ROOT / "data"
    d.mkdir(parents=True, exist_ok=True)
    i = 0
    for req in synthetic_requests(args.n_train + args.n_held + 40, args.seed, args.max_passages):
        if i >= args.n_train + args.n_held:
            break
        plan, _ = b.plan(req)
        while plan.context_len > args.max_context and len(req.contexts) > 3:  # keep training steps short
            req = QARequest(req.id, req.question, req.answers, req.contexts[:-1])
            plan, _ = b.plan(req)
        if plan.context_len > args.max_context:
            continue
        t = time.perf_counter()
        b.ensure_cached([plan])
        ref = b.run_method(plan, "full", get_method("full"), req, GenerationConfig(max_new_tokens=KL_TOKENS))
        if not ref.token_ids:
            continue
        with torch.inference_mode():
            tl = b.teacher_forced(ref, ref.token_ids[:KL_TOKENS])
        k, v, _ = stale_context(b, plan)
        torch.save({"k": k.half(), "v": v.half(), "ends": chunk_ends(plan), "tc": plan.context_len,
                    "suffix": list(plan.suffix.token_ids), "answer": ref.token_ids[:KL_TOKENS],
                    "tlp": torch.log_softmax(tl.float(), -1).half(), "question": req.question,
                    "full_answer": ref.record["answer"]}, d / f"{i}.pt")
        print(f"{i} tc={plan.context_len} chunks={len(chunk_ends(plan))} {time.perf_counter() - t:.1f}s "
              f"q={req.question!r} a={ref.record['answer']!r}", flush=True)
        i += 1


class Links:
    """Soft tokens inserted at ``points`` (context positions) over a stale context cache."""

    def __init__(self, model: Any, rope: Rope, soft: torch.Tensor) -> None:
        self.model, self.rope, self.soft = model, rope, soft

    def build(self, k: torch.Tensor, v: torch.Tensor, points: list[int]) -> tuple[Any, int]:
        """A cache holding the context (moved past the inserted tokens) and the soft tokens' K/V; its next position."""
        n, tc = self.soft.shape[0], k.shape[2]
        pts = torch.tensor(points)
        shift = n * (torch.arange(tc)[:, None] >= pts[None, :]).sum(1)  # tokens inserted before each position
        if int(shift.max()) > 0:
            k = self.rope.rotate(k, shift)  # RoPE composes: placed at p, rotated by s -> placed at p + s
        cache = hf_cache.make_cache(k, v, self.model.config)
        m = len(points)
        if m == 0:  # no soft tokens: the stale cache itself
            return cache, tc
        pos = torch.cat([pts[g] + n * g + torch.arange(n) for g in range(m)])
        vis = torch.zeros(m * n, tc + m * n, dtype=torch.bool)
        for g, p in enumerate(points):
            vis[g * n:(g + 1) * n, :p] = True
            vis[g * n:(g + 1) * n, tc:tc + g * n] = True
            vis[g * n:(g + 1) * n, tc + g * n:tc + (g + 1) * n] = torch.ones(n, n, dtype=torch.bool).tril()
        self.model(inputs_embeds=self.soft.repeat(m, 1)[None], position_ids=pos[None], past_key_values=cache,
                   attention_mask=vis[None, None], use_cache=True, logits_to_keep=1)
        return cache, tc + m * n

    def logits(self, k: torch.Tensor, v: torch.Tensor, points: list[int], suffix: list[int],
               answer: list[int]) -> torch.Tensor:
        """Next-token logits [1 + len(answer) - 1, V]: at the suffix's last position and along ``answer[:-1]``."""
        cache, start = self.build(k, v, points)
        ids = torch.tensor(suffix + answer[:-1])
        emb = hf_cache.embed(self.model, ids)
        pos = torch.arange(start, start + len(ids))[None]
        out = self.model(inputs_embeds=emb, position_ids=pos, past_key_values=cache, use_cache=True,
                         logits_to_keep=len(answer))
        return out.logits[0].float()


def points_of(variant: str, ends: list[int], tc: int) -> list[int]:
    return {"trailer": [tc], "links": list(ends)}.get(variant, [])


def kl_rows(tlp: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position [N] from teacher log-probs and student logits."""
    slp = torch.log_softmax(logits.float(), -1)
    tlp = tlp.clamp(min=-1e4)
    return (tlp.exp() * (tlp - slp)).sum(-1)


def mean_kl(lk: Links, variant: str, items: list[dict[str, Any]]) -> float:
    with torch.no_grad():
        return statistics.mean(float(kl_rows(x["tlp"].float(), lk.logits(
            x["k"].float(), x["v"].float(), points_of(variant, x["ends"], x["tc"]), x["suffix"],
            x["answer"])).mean()) for x in items)


def init_soft(model: Any, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        e = hf_cache.embed(model, torch.arange(model.config.vocab_size))[0].float()
    return (e.mean(0) + 0.1 * e.std(0) * torch.randn(n, e.shape[1], generator=g)).contiguous()


def make_differentiable(model: Any) -> None:
    """The frozen model for training the soft tokens: no parameter takes a gradient (the GGUF layers compute a
    product autograd records on the dense route, on weight tiles of their own: kvrag.kv.gguf_quant.GGUFLinear);
    attention through transformers' SDPA."""
    model.config._attn_implementation = "sdpa"
    for p in model.parameters():
        p.requires_grad_(False)


def train(args: argparse.Namespace) -> None:
    b = bench("train")
    model = b.engine.model
    make_differentiable(model)
    files = sorted((ROOT / "data").glob("*.pt"), key=lambda f: int(f.stem))
    items = [torch.load(f) for f in files]
    held, tr = items[: args.n_held], items[args.n_held:]
    held_in = tr[: args.n_held]
    soft = init_soft(model, args.n, args.seed).requires_grad_(True)
    lk = Links(model, Rope.from_model(model), soft)
    opt = torch.optim.Adam([soft], lr=args.lr)
    name = f"{args.variant}-n{args.n}"
    log: dict[str, Any] = {"args": vars(args), "curve": [], "held": [], "n_params": soft.numel()}
    log["stale_held"] = mean_kl(lk, "none", held), mean_kl(lk, "none", held_in)
    print(f"{name}: stale (no soft tokens) held-out KL {log['stale_held'][0]:.4f} held-in {log['stale_held'][1]:.4f}")
    h0, i0 = mean_kl(lk, args.variant, held), mean_kl(lk, args.variant, held_in)
    log["held"].append((0, h0, i0))
    print(f"{name}: step 0 held-out KL {h0:.4f} held-in KL {i0:.4f}", flush=True)
    best, best_soft, rng, t_train = h0, soft.detach().clone(), random.Random(args.seed), 0.0
    for step in range(1, args.steps + 1):
        x = rng.choice(tr)
        t = time.perf_counter()
        logits = lk.logits(x["k"].float(), x["v"].float(), points_of(args.variant, x["ends"], x["tc"]),
                           x["suffix"], x["answer"])
        loss = kl_rows(x["tlp"].float(), logits).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([soft], 1.0)
        opt.step()
        t_train += time.perf_counter() - t
        log["curve"].append((step, loss.item(), time.perf_counter() - t))
        if step % args.eval_every == 0 or step == args.steps:
            h, hi = mean_kl(lk, args.variant, held), mean_kl(lk, args.variant, held_in)
            log["held"].append((step, h, hi))
            last = [c[1] for c in log["curve"][-args.eval_every:]]
            print(f"{name}: step {step} train loss (last {len(last)}) {statistics.mean(last):.4f} held-out KL "
                  f"{h:.4f} held-in KL {hi:.4f} {t_train / step:.2f} s/step", flush=True)
            if h < best:
                best, best_soft = h, soft.detach().clone()
    log.update(best_held_kl=best, s_per_step=t_train / args.steps, train_s=t_train)
    torch.save({"soft": best_soft, "variant": args.variant, "n": args.n}, ROOT / f"{name}.pt")
    (ROOT / f"{name}.json").write_text(json.dumps(log))
    print(f"{name}: kept held-out KL {best:.4f}; {t_train:.0f} s training, {t_train / args.steps:.2f} s/step")


@torch.inference_mode()
def greedy(model: Any, logits: torch.Tensor, cache: Any, start: int, steps: int, eos: set[int]) -> list[int]:
    out: list[int] = []
    for i in range(steps):
        tok = int(logits.argmax())
        if tok in eos:
            break
        out.append(tok)
        if i + 1 < steps:
            logits, _ = hf_cache.forward(model, torch.tensor([tok]), cache, start=start + i)
            logits = logits[-1]
    return out


def evaluate(args: argparse.Namespace) -> None:
    b = bench("eval", max_new=args.max_new_tokens)
    eng, model, tok = b.engine, b.engine.model, b.engine.tokenizer
    rope, eos = Rope.from_model(model), set(eng._eos_ids())
    softs = {s: torch.load(ROOT / f"{s}.pt") for s in args.soft.split(",") if s}
    labels = [*BASELINES, *softs]
    out = ROOT / "eval"
    out.mkdir(exist_ok=True)
    rows = []
    for i, req in enumerate(load_requests(b.cfg.data, args.limit, args.offset)):
        plan, _ = b.plan(req)
        b.ensure_cached([plan])
        runs, rec = {}, {"row": args.offset + i, "id": req.id, "tc": plan.context_len, "methods": {}}
        order = BASELINES[i % 4:] + BASELINES[: i % 4]
        for spec in order:
            runs[spec] = b.run_method(plan, spec, get_method(spec), req)
        ref = runs["full"]
        target = ref.token_ids[:KL_TOKENS]
        with torch.inference_mode():
            ref_l = b.teacher_forced(ref, target)
            tlp = torch.log_softmax(ref_l.float(), -1)
            full_ans = b.extract(tok.decode(ref.token_ids, skip_special_tokens=True))
            for spec in BASELINES:
                r = runs[spec]
                lg = ref_l if r is ref else b.teacher_forced(r, target)
                ans = b.extract(tok.decode(r.token_ids, skip_special_tokens=True))
                rec["methods"][spec] = {"answer": ans, "engine_answer": r.record["answer"],
                                        "same_answer": same_answer(ans, full_ans),
                                        "same_tokens": r.token_ids == ref.token_ids,
                                        "first_agree": int(lg[0].argmax()) == int(ref_l[0].argmax()),
                                        "kl1": float(kl_rows(tlp[:1], lg[:1])[0]),
                                        "kl": float(kl_rows(tlp, lg).mean()), "ttft": r.record["ttft_s"], "extra": 0}
            k, v, pre_s = stale_context(b, plan)
            for name, s in softs.items():
                lk = Links(model, rope, s["soft"])
                pts = points_of(s["variant"], chunk_ends(plan), plan.context_len)
                t = time.perf_counter()
                cache, start = lk.build(k, v, pts)
                ids = torch.tensor(list(plan.suffix.token_ids))
                last, cache = hf_cache.forward(model, ids, cache, start=start)
                ttft = pre_s + time.perf_counter() - t
                n0 = start + len(ids)
                toks = greedy(model, last[-1], cache, n0, args.max_new_tokens, eos)
                ck, cv = hf_cache.cache_to_tensors(cache)
                c2 = hf_cache.make_cache(ck[:, :, :n0], cv[:, :, :n0], model.config)
                lg = last[-1:]
                if len(target) > 1:
                    more, _ = hf_cache.forward(model, torch.tensor(target[:-1]), c2, start=n0,
                                               logits_to_keep=len(target) - 1)
                    lg = torch.cat([lg, more])
                ans = b.extract(tok.decode(toks, skip_special_tokens=True))
                rec["methods"][name] = {"answer": ans, "same_answer": same_answer(ans, full_ans),
                                        "same_tokens": toks == ref.token_ids,
                                        "first_agree": int(lg[0].argmax()) == int(ref_l[0].argmax()),
                                        "kl1": float(kl_rows(tlp[:1], lg[:1])[0]), "kl": float(kl_rows(tlp, lg).mean()),
                                        "ttft": ttft, "extra": len(pts) * s["soft"].shape[0]}
        rows.append(rec)
        with (out / "rows.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"row {args.offset + i} tc={plan.context_len} full={full_ans!r} " + " ".join(
            f"{m}={int(rec['methods'][m]['same_answer'])}" for m in labels), flush=True)
    table(rows, labels)


def table(rows: list[dict[str, Any]], labels: list[str]) -> None:
    n = len(rows)
    full_t = [r["methods"]["full"]["ttft"] for r in rows]
    print(f"\n| method (dev rows, n={n}) | same answer | same tokens | 1st token | first-step KL | answer KL (16) | "
          "extra tokens | TTFT p50 s | TTFT/full p50 |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in labels:
        xs = [r["methods"][m] for r in rows]
        ratio = statistics.median(x["ttft"] / f for x, f in zip(xs, full_t, strict=True))
        print(f"| `{m}` | {sum(x['same_answer'] for x in xs)}/{n} | {sum(x['same_tokens'] for x in xs)}/{n} | "
              f"{sum(x['first_agree'] for x in xs)}/{n} | {statistics.mean(x['kl1'] for x in xs):.3f} | "
              f"{statistics.mean(x['kl'] for x in xs):.3f} | {statistics.mean(x['extra'] for x in xs):.0f} | "
              f"{statistics.median(x['ttft'] for x in xs):.2f} | {ratio:.2f} |")
    bad = sum(r["methods"][m]["answer"] != r["methods"][m]["engine_answer"] for r in rows for m in BASELINES)
    print(f"(answers re-decoded from token ids; {bad} differ from the engine's streamed answer)")


def main() -> None:
    global ROOT, CORPUS, DATA  # noqa: PLW0603 - one run's folders, set once from the command line
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="folder of the run's files")
    ap.add_argument("--corpus", default=str(CORPUS), help="corpus_train.jsonl (titles + passages)")
    ap.add_argument("--data", default=DATA, help="QA JSONL scored by eval")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep")
    p.add_argument("--n-train", type=int, default=72)
    p.add_argument("--n-held", type=int, default=12)
    p.add_argument("--max-passages", type=int, default=8)
    p.add_argument("--max-context", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("train")
    p.add_argument("--variant", choices=("trailer", "links"), default="trailer")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--n-held", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("eval")
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--limit", type=int, default=25)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--soft", default="")
    p = sub.add_parser("table")
    p.add_argument("--soft", default="")
    args = ap.parse_args()
    ROOT, CORPUS, DATA = Path(args.root), Path(args.corpus), args.data
    ROOT.mkdir(parents=True, exist_ok=True)
    if args.cmd == "table":
        rows = [json.loads(x) for x in (ROOT / "eval" / "rows.jsonl").read_text().splitlines()]
        table(rows, [*BASELINES, *[s for s in args.soft.split(",") if s]])
        return
    {"prep": prep, "train": train, "eval": evaluate}[args.cmd](args)


if __name__ == "__main__":
    main()
