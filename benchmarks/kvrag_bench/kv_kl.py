"""``kvrag bench kv-kl``: what decoding over narrower K/V (``EngineConfig.kv_dtype``) costs in quality.

For each QA row the prompt (kvrag's template over the row's passages) is prefilled once by the model (``--dtype``,
``--quantize``) into a request buffer, as the engine's prepare does. Its K/V then go into one row per K/V dtype
(:meth:`kvrag.kv.batched.Row.for_decode`, the engine's own conversion): the reference row in the compute dtype is
decoded greedily for ``--tokens`` tokens by the engine's batched step, and each narrower row is teacher-forced along
that answer. Per answer position: KL(compute-dtype K/V || narrower K/V) of the next-token distribution; per row:
whether the narrower row's own greedy answer is the reference's. With ``--floor``, one more row holds the compute
dtype's K/V each multiplied by (1 + noise), Gaussian noise of a quarter of the dtype's epsilon, rounded back to the
dtype (``noise``): the cost of any change to the K/V of about the dtype's own rounding, the floor below which no
narrower K/V's cost can be told from the compute dtype's own noise. Writes ``kv_kl.json`` and ``kv_kl.md``.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from kvrag_bench.report import writing_main


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="QA JSONL")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--kv-dtypes", default="bfloat16", help="K/V dtypes to compare with the compute dtype's")
    p.add_argument("--quantize", default="default", help="weights: default, none, int4, int8")
    p.add_argument("--tokens", type=int, default=24, help="answer tokens along which KL is measured")
    p.add_argument("--floor", action="store_true",
                   help="also measure K/V perturbed at the compute dtype's own rounding size (row 'noise')")
    p.add_argument("--out", default="runs/kv-kl")


def _decode(model: Any, row: Any, first: int, n: int, eos: set[int], forced: list[int] | None) -> tuple[list[int],
                                                                                                     list[Any]]:
    """Greedy tokens (or ``forced`` ones) after ``first`` over ``row`` and the logits that chose each next one."""
    from kvrag.kv import batched

    wins = batched.windows(model)
    tokens, logits = [first], []
    for i in range(n - 1):
        out = batched.decode_step(model, [row], [tokens[-1]], wins)[0]
        row.length += 1
        logits.append(out)
        nxt = int(out.argmax()) if forced is None else forced[i + 1]
        tokens.append(nxt)
        if (forced is None and nxt in eos) or (forced is not None and i + 2 >= len(forced)):
            break
    return tokens, logits


def _row(buf: Any, n: int, capacity: int, kind: Any) -> Any:
    """A decode row over the first ``n`` positions of ``buf`` in K/V dtype ``kind`` (the engine's conversion), or
    for ``kind`` "noise" a copy in the compute dtype with each element times (1 + N(0, (eps / 4)^2)), rounded back."""
    import torch

    from kvrag.kv import batched, hf_cache

    if kind != "noise":
        return batched.Row.for_decode(buf, n, capacity, kind)
    gen = torch.Generator().manual_seed(n)
    eps = torch.finfo(buf.keys.dtype).eps / 4

    def noisy(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((*x.shape[:2], capacity, x.shape[3]), dtype=x.dtype)
        out[:, :, :n] = x[:, :, :n].float() * (1 + eps * torch.randn(x[:, :, :n].shape, generator=gen))
        return out

    return batched.Row(hf_cache.KVBuffer.wrap(noisy(buf.keys), noisy(buf.values)), n)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvrag.kv import batched, hf_cache
    from kvrag.models import load_model
    from kvrag.prompting import get_template
    from kvrag_bench.data import load_requests
    from kvrag_bench.metrics import kl_divergence
    from kvrag_bench.provenance import environment_info

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype, device=args.device,
                    quantize=None if args.quantize == "none" else args.quantize)
    model, tok, tpl = lm.model, lm.tokenizer, get_template(None)
    eos = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    kv_dtypes: list[Any] = [getattr(torch, k.strip()) for k in args.kv_dtypes.split(",") if k.strip()]
    if args.floor:
        kv_dtypes.append("noise")
    kls: dict[str, list[float]] = {str(k).removeprefix("torch."): [] for k in kv_dtypes}
    same = dict.fromkeys(kls, 0)
    rows = []
    for req in load_requests(args.data, limit=args.limit, offset=args.offset):
        ids = tok(tpl.render(tok, req.passages(), req.question), add_special_tokens=False)["input_ids"]
        n = len(ids)
        spec = model.config
        head_dim = getattr(spec, "head_dim", None) or spec.hidden_size // spec.num_attention_heads
        buf = hf_cache.KVBuffer(spec.num_hidden_layers, spec.num_key_value_heads, head_dim, n + args.tokens + 1,
                                lm.dtype, lm.device)
        logits, _ = hf_cache.forward(model, torch.tensor(ids), buf.as_cache(0))
        first = int(logits[-1].argmax())
        ref_row = batched.Row.for_decode(buf, n, n + args.tokens + 1)
        narrow = {k: (_row(buf, n, n + args.tokens + 1, k), _row(buf, n, n + args.tokens + 1, k)) for k in kv_dtypes}
        answer, ref = _decode(model, ref_row, first, args.tokens, eos, None)
        rows.append({"id": req.id, "prompt_tokens": n, "answer_tokens": len(answer)})
        for k, (forced_row, own_row) in narrow.items():
            name = str(k).removeprefix("torch.")
            _, got = _decode(model, forced_row, first, args.tokens, eos, answer)
            kls[name] += [float(kl_divergence(p, q, dtype=None)) for p, q in zip(ref, got, strict=True)]
            own, _ = _decode(model, own_row, first, args.tokens, eos, None)
            same[name] += own == answer
    out: dict[str, Any] = {"model": lm.name, "dtype": str(lm.dtype).removeprefix("torch."), "quantize": lm.quantize,
                           "rows": rows, "kv_dtypes": {}}
    for name, xs in kls.items():
        xs.sort()
        out["kv_dtypes"][name] = {"kl_mean": statistics.fmean(xs), "kl_median": statistics.median(xs),
                                  "kl_p90": xs[int(0.9 * (len(xs) - 1))], "kl_max": xs[-1], "positions": len(xs),
                                  "same_answer": same[name], "requests": len(rows)}
    out["environment"] = environment_info()
    out["command"] = (f"kvrag bench kv-kl --data {args.data} --offset {args.offset} --limit {args.limit} "
                      f"--kv-dtypes {args.kv_dtypes} --quantize {args.quantize} --tokens {args.tokens}"
                      + (" --floor" if args.floor else "")
                      + (f" --dtype {args.dtype}" if args.dtype else "")
                      + (f" --threads {args.threads}" if args.threads else ""))
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [f"`{result['command']}` -- {result['model']} in {result['dtype']}, weights {result['quantize']}; "
             f"{len(result['rows'])} prompts, KL(compute-dtype K/V || narrower K/V) per answer position", "",
             "| K/V dtype | KL mean | KL median | KL p90 | KL max | positions | same greedy answer |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for k, m in result["kv_dtypes"].items():
        lines.append(f"| {k} | {m['kl_mean']:.2e} | {m['kl_median']:.2e} | {m['kl_p90']:.2e} | {m['kl_max']:.2e} | "
                     f"{m['positions']} | {m['same_answer']}/{m['requests']} |")
    return "\n".join(lines)


main = writing_main("kv_kl", run, markdown)


__all__ = ["add_arguments", "main", "markdown", "run"]
