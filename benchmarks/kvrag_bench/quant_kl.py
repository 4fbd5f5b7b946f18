"""``kvrag bench quant-kl``: what quantized weights cost in quality, measured where they act -- on decode.

For each QA row: the prompt (kvrag's template over the row's passages) is prefilled by the dense reference model
(``--dtype``, dense weights) and decoded greedily for ``--tokens`` tokens. Each variant (``--variants``: int4, int8,
or a dtype name such as bfloat16 for scale) then prefills the same ids and is teacher-forced along the reference
answer; the KL(reference || variant) of every next-token distribution is recorded, and the variant's own greedy
answer is compared with the reference's. Quantized products run only for short inputs (decode steps), so the
per-step KL along the answer is the measure that sees them. Writes ``quant_kl.json`` and ``quant_kl.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
from typing import Any
from unittest import mock

from kvrag_bench.report import writing_main


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="QA JSONL")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--variants", default="int4,int8,bfloat16",
                   help="quantizations (int4, int8) of the reference, int4-prefill (a GGUF model's int4 layers on "
                        "every product: KVRAG_GGUF_PREFILL=int4), or dtypes (dense) to compare with it")
    p.add_argument("--tokens", type=int, default=24, help="answer tokens along which KL is measured")
    p.add_argument("--out", default="runs/quant-kl")


def _answer(model: Any, ids: Any, n: int, eos: set[int], forced: list[int] | None = None) -> tuple[list[int], Any]:
    """Greedy tokens (or ``forced`` ones) after ``ids`` and the float32 logits [steps, V] that predicted them."""
    import torch
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits = [model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1].float()]
        tokens: list[int] = []
        last = n if forced is None else min(n, len(forced))
        for i in range(last):
            t = int(logits[-1].argmax()) if forced is None else forced[i]
            tokens.append(t)
            if (forced is None and t in eos) or len(tokens) == last:
                break
            logits.append(model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1].float())
    return tokens, torch.stack(logits)


def _prefill_route(route: str | None) -> contextlib.AbstractContextManager[object]:
    """``KVRAG_GGUF_PREFILL`` set to ``route`` while a variant loads (read when its int4 layers are built)."""
    return contextlib.nullcontext() if route is None else mock.patch.dict(os.environ, {"KVRAG_GGUF_PREFILL": route})


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvrag.models import load_model
    from kvrag.prompting import get_template
    from kvrag_bench.data import load_requests
    from kvrag_bench.metrics import kl_divergence
    from kvrag_bench.provenance import environment_info

    if args.threads:
        torch.set_num_threads(args.threads)
    ref = load_model(args.model, dtype=args.dtype, device=args.device, quantize=None)
    tok, tpl = ref.tokenizer, get_template(None)
    eos = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    rows = []
    for req in load_requests(args.data, limit=args.limit, offset=args.offset):
        text = tpl.render(tok, req.passages(), req.question)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(ref.device)
        answer, logits = _answer(ref.model, ids, args.tokens, eos)
        rows.append({"id": req.id, "ids": ids, "answer": answer, "logits": logits})
    out: dict[str, Any] = {"reference": {"model": ref.name, "dtype": str(ref.dtype).removeprefix("torch."),
                                         "quantize": None},
                           "rows": [{"id": r["id"], "prompt_tokens": int(r["ids"].shape[1])} for r in rows],
                           "variants": {}}
    for v in [x.strip() for x in args.variants.split(",") if x.strip()]:
        quant = "int4" if v == "int4-prefill" else v if v in ("int4", "int8") else None
        with _prefill_route("int4" if v == "int4-prefill" else None):
            lm = load_model(args.model, dtype=args.dtype if quant else v, device=args.device, quantize=quant)
        kls, first, same = [], [], 0
        for r in rows:
            _, logits = _answer(lm.model, r["ids"], args.tokens, eos, forced=r["answer"])
            row_kl = kl_divergence(r["logits"][: len(logits)], logits, dtype=None).tolist()
            kls += row_kl
            first.append(row_kl[0])
            own, _ = _answer(lm.model, r["ids"], args.tokens, eos)
            same += own == r["answer"]
        kls.sort()
        out["variants"][v] = {"kl_mean": statistics.fmean(kls), "kl_first_mean": statistics.fmean(first),
                              "kl_p90": kls[int(0.9 * (len(kls) - 1))],
                              "kl_max": kls[-1], "positions": len(kls), "same_answer": same, "requests": len(rows)}
        del lm
    out["environment"] = environment_info()
    out["command"] = (f"kvrag bench quant-kl --data {args.data} --offset {args.offset} --limit {args.limit} "
                      f"--variants {args.variants} --tokens {args.tokens}"
                      + (f" --dtype {args.dtype}" if args.dtype else "") + (f" --threads {args.threads}"
                                                                            if args.threads else ""))
    return out


def markdown(result: dict[str, Any]) -> str:
    ref = result["reference"]
    lines = [f"`{result['command']}` -- reference: {ref['model']} in {ref['dtype']}, dense weights; "
             f"{len(result['rows'])} prompts", "",
             "| variant | KL mean | KL after the prefill (first token) | KL p90 | KL max | positions | same greedy answer |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for v, m in result["variants"].items():
        lines.append(f"| {v} | {m['kl_mean']:.2e} | {m.get('kl_first_mean', float('nan')):.2e} | {m['kl_p90']:.2e} | "
                     f"{m['kl_max']:.2e} | {m['positions']} | "
                     f"{m['same_answer']}/{m['requests']} |")
    return "\n".join(lines)


main = writing_main("quant_kl", run, markdown)


__all__ = ["add_arguments", "main", "markdown", "run"]
