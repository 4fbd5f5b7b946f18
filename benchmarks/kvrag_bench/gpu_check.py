"""``make gpu-check``: the CUDA path in one command -- equivalence checks, then a short bf16 TTFT sweep.

1. Equivalence on CUDA, for every tiny family in float32 and bfloat16: ``full`` generates exactly what
   ``model.generate`` does on the same ids; every selective method at its recompute-everything setting generates
   ``full``'s tokens (bf16: the first ``BF16_TOKENS`` tokens, see the
   tolerance note in :func:`equivalence`).
2. A short sweep with the default model in bfloat16 at ~4K context tokens (``full``, ``stale``,
   ``relaxkv:r=0.15``, ``cacherepair``; 2 repeats), methods interleaved.

Writes ``OUT/gpu_check.json`` and ``OUT/gpu_check.md``. Without a CUDA device it says so and exits 0 (nothing is
run), so CI and laptops can call it; it is meant to fit in ~5 minutes on one modern GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

BF16_TOKENS = 4
"""bf16 greedy decodes are compared over their first 4 tokens: reordered bf16 sums flip near-ties later on."""


def equivalence(device: str, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> list[dict[str, Any]]:
    """Token equality of every recompute-everything method vs ``full`` and of ``full`` vs ``model.generate``."""
    from kvrag.fusion import get_method
    from kvrag_testing.fusion_suite import RECOMPUTE_ALL_SPECS, fusion_case, greedy_tokens
    from kvrag_testing.tiny import FAMILIES

    rows = []
    for family in FAMILIES:
        for dt in dtypes:
            # a fresh (uncached) case: moving it to the device / dtype must not round the weights of the case
            # the test suites share through fusion_case's cache
            case = fusion_case.__wrapped__(family, 4, 0, 6)
            model = case.model.to(device=device, dtype=dt)  # assemble() follows the model's device and dtype
            inp = case.fusion_input()
            ids = torch.cat([inp.token_ids, inp.suffix_ids]).to(device)
            steps = 6 if dt == torch.float32 else BF16_TOKENS
            ref = model.generate(ids[None], max_new_tokens=steps, do_sample=False)[0, ids.shape[0]:].tolist()
            full = greedy_tokens(inp, get_method("full").fuse(inp), steps)
            rows.append({"family": family, "dtype": str(dt), "check": "full == model.generate", "ok": full == ref})
            for spec in RECOMPUTE_ALL_SPECS:
                # both input paths: tensors a caller built, and the engine's zero-copy buffer (where full-context
                # recomputes fold the suffix prefill into their layer calls)
                for zero_copy in (False, True):
                    x = case.fusion_input(zero_copy=zero_copy)
                    toks = greedy_tokens(x, get_method(spec).fuse(x), steps)
                    check = f"{spec} == full" + (" (zero-copy buffer)" if zero_copy else "")
                    rows.append({"family": family, "dtype": str(dt), "check": check, "ok": toks == full})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvrag_bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/gpu-check")
    p.add_argument("--length", type=int, default=4096, help="context tokens of the TTFT sweep")
    p.add_argument("--data", default=None, help="QA JSONL supplying the sweep's text (default: built-in text)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False); nothing was run. "
              "Run `make gpu-check` on a machine with an NVIDIA GPU.")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    eq = equivalence("cuda")
    from kvrag_bench.sweep import SweepConfig, run_sweep

    sweep = run_sweep(SweepConfig(data=args.data, methods=["full", "stale", "relaxkv:r=0.15", "cacherepair"],
                                  lengths=[args.length], chunk_counts=[], chunks=8, repeats=2, out=str(out / "sweep"),
                                  device="cuda", dtype="bfloat16", overwrite=True))
    result = {"device": torch.cuda.get_device_name(0), "equivalence": eq, "sweep": sweep,
              "seconds": time.perf_counter() - t0}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    bad = [r for r in eq if not r["ok"]]
    lines = [f"# gpu-check on {result['device']}", "",
             f"Equivalence: {len(eq) - len(bad)}/{len(eq)} checks pass" + (" -- FAILED: " + ", ".join(
                 f"{r['family']}/{r['dtype']}/{r['check']}" for r in bad) if bad else "."), "",
             f"TTFT sweep (bf16, ~{args.length} context tokens, 8 chunks): see {out / 'sweep'}/sweep.md", "",
             f"Total {result['seconds']:.0f} s."]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
