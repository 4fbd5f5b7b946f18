"""Where a decode step's time goes: the step (plain, and verify steps of 2 / 4 / 6 positions on one row; a plain
step of each batch size) beside the kernels it cannot avoid, timed alone -- the int4 products of every layer, the
one-token attentions over a context of that length, the output head -- for each batch size's rows, one thread (or
the threads given last).

    python benchmarks/kvrag_bench/prof/step_floor.py int4 1536,3072            # batches 1 and 4, one thread
    python benchmarks/kvrag_bench/prof/step_floor.py int4 1594 1,8 0 2         # batches 1 and 8, two threads

The kernels-alone loops call the products and the attention with prepared inputs and no other operation, so the
step's time minus their sum is what the rest of the step (norms, residuals, activation, the Python around the
calls) costs. Needs kvrag's int4 kernel and row attention (an AVX512-BF16 or AMX CPU).
"""
import functools
import sys

import torch

from kvrag.kv import batched, hf_cache, row_attention
from kvrag_bench.decode_bench import context_rows
from kvrag_bench.prof import median_ms, step_args


def _products(layers, x, xi) -> None:
    for layer in layers:
        a, p = layer.self_attn, layer.mlp
        for mod in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, p.gate_proj, p.up_proj):
            mod.forward(x)
        p.down_proj.forward(xi)


def _attend(kv, q, out, ctx: int) -> None:
    for k, v in kv:
        row_attention.attend(q, [(k, v, 0, ctx + j) for j in range(q.shape[2])], out, None)


def _attend_rows(kvs, q, out, ctx: int) -> None:  # one position of each row, each row over its own K/V
    for layer in range(len(kvs[0])):
        row_attention.attend(q, [(kv[layer][0], kv[layer][1], 0, ctx) for kv in kvs], out, None)


def main():
    weights, contexts, batches, _, lm = step_args()
    batches = batches if len(sys.argv) > 3 else [1, 4]
    if len(sys.argv) > 5:
        torch.set_num_threads(int(sys.argv[5]))
    m, layers = lm.model, lm.model.model.layers
    win = batched.windows(m)
    cfg = m.config
    d = layers[0].self_attn.head_dim
    print(f"{lm.name} {lm.dtype} {weights}, {torch.get_num_threads()} thread(s)")
    with torch.inference_mode():
        for rows_n in batches:
            x = torch.randn(rows_n, cfg.hidden_size).to(lm.dtype)
            xi = torch.randn(rows_n, cfg.intermediate_size).to(lm.dtype)
            print(f"{rows_n} row(s): products {median_ms(functools.partial(_products, layers, x, xi)):.2f} ms, head "
                  f"{median_ms(functools.partial(m.lm_head.forward, x[:, None])):.2f} ms", flush=True)
        for ctx in contexts:
            kv = [(torch.randn(cfg.num_key_value_heads, ctx + 16, d).to(lm.dtype),
                   torch.randn(cfg.num_key_value_heads, ctx + 16, d).to(lm.dtype)) for _ in layers]
            for nq in (1, 4):
                q = torch.randn(1, cfg.num_attention_heads, nq, d).to(lm.dtype)
                out = torch.empty(1, nq, cfg.num_attention_heads, d, dtype=lm.dtype)
                ms = median_ms(functools.partial(_attend, kv, q, out, ctx))
                print(f"context {ctx}: attention of {nq} position(s) {ms:.2f} ms", flush=True)
            pre = hf_cache.prefill_kv(m, torch.tensor(list(range(1000, 1000 + ctx))))
            rows = context_rows(*pre, 1, ctx + 64, lm.dtype)
            steps = {"plain": functools.partial(batched.decode_step, m, rows, [500], win)}
            for k in (2, 4, 6):
                steps[f"verify {k}"] = functools.partial(batched.verify_step, m, rows, [[500 + i for i in range(k)]], win)
            print(f"context {ctx}: " + ", ".join(f"{name} {median_ms(f):.1f} ms" for name, f in steps.items()),
                  flush=True)
            for rows_n in (b for b in batches if b > 1):
                kvs = [[(k.clone(), v.clone()) for k, v in kv] for _ in range(rows_n)]
                q = torch.randn(rows_n, cfg.num_attention_heads, 1, d).to(lm.dtype)
                out = torch.empty(rows_n, 1, cfg.num_attention_heads, d, dtype=lm.dtype)
                att = median_ms(functools.partial(_attend_rows, kvs, q, out, ctx))
                rows = context_rows(*pre, rows_n, ctx + 64, lm.dtype)
                step = median_ms(functools.partial(batched.decode_step, m, rows, [500] * rows_n, win))
                print(f"context {ctx}, {rows_n} rows: attention {att:.2f} ms, plain step {step:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
