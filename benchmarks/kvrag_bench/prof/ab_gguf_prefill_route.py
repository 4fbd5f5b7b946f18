"""A/B: the two ways a GGUF-resident layer can multiply more than 16 rows, interleaved, one thread.

    python benchmarks/kvrag_bench/prof/ab_gguf_prefill_route.py FILE.gguf blk.0.ffn_up.weight 16,64,256,512,1024,1536

* ``dense``: the layer's weight de-quantized from the file's blocks (exactly gguf's numbers) into the scratch buffer,
  then the dense product in the compute dtype (what kvrag runs past 16 rows);
* ``int4``: kvrag's int4 kernel on the blocks laid out as int4 groups (what decode runs), with more rows.

Prints the median ms of each per (dtype, rows) and a JSON line (``RESULT {...}``).
"""
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from kvrag.gguf_load import _file_bytes, tensor_table
from kvrag.kv import int4_kernel
from kvrag.kv.gguf_quant import GGUFLinear, Scratch


def main() -> None:
    from gguf import GGUFReader

    path, name = sys.argv[1], sys.argv[2]
    rows_list = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "16,64,256,512,1024,1536").split(",")]
    torch.set_num_threads(1)
    t = next(t for t in tensor_table(GGUFReader(path)) if t["name"] == name)
    n = int(np.prod(t["dims"][1:]))
    raw = _file_bytes(Path(path))[0][t["offset"] : t["offset"] + t["bytes"]].view(n, -1)
    cells: list[dict[str, object]] = []
    out = {"file": path, "tensor": name, "type": t["type"], "shape": [n, t["dims"][0]], "kernel": int4_kernel.tag(),
           "cells": cells}
    for dt in (torch.bfloat16, torch.float32):
        lin = GGUFLinear(raw, t["type"], t["dims"][0], dt, Scratch())
        if not lin.use_int4() or lin.int4 is None:
            raise SystemExit(f"{name} ({t['type']}) has no int4 form")
        int4 = lin.int4
        for m in rows_list:
            x = torch.randn(m, t["dims"][0]).to(dt)
            xi = x if dt == torch.float32 and int4.takes_float32 else x.to(torch.bfloat16).contiguous()
            a, b = [], []
            lin.dense(x)
            int4.mm(xi)
            for _ in range(5):
                s = time.perf_counter()
                lin.dense(x)
                a.append(time.perf_counter() - s)
                s = time.perf_counter()
                int4.mm(xi)
                b.append(time.perf_counter() - s)
            cell = {"dtype": str(dt).replace("torch.", ""), "rows": m, "dense_ms": 1e3 * statistics.median(a),
                    "int4_kernel_ms": 1e3 * statistics.median(b)}
            cells.append(cell)
            print(cell, flush=True)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
