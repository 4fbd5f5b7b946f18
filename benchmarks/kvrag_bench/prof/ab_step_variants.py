"""Where a batched decode step's time goes beyond its kernels, and variants of kvrag's direct loop that keep its bits.

    python benchmarks/kvrag_bench/prof/ab_step_variants.py int4 512,1536 1,8 40   # weights, contexts, batches, steps

Two measurements on one loaded model, one thread, the context synthetic token ids prefilled once:

1. **Parts** (at the first context, batch 1): the step as kvrag runs it; then with every int4 product replaced by a
   preallocated output of its shape (no kernel); then with the one-token attention replaced too. What is left is
   the ~100 small operations a layer (norms, RoPE, casts, views, K/V writes) and the Python that calls them.
2. **Variants**, interleaved step by step over copies of the same KV, every variant's logits required equal to
   kvrag's: ``direct`` (:func:`kvrag.kv.direct.forward`); ``stacked`` -- the q / k / v and the gate / up int4
   weights stacked into one product each (torch's packed CPU int4 layout keeps blocks of 64 output rows apart, so
   the outputs are the separate products' bits; 122 instead of 212 kernel calls a step); ``inline norm`` -- the
   RMSNorms written out with a tensor epsilon (transformers' ``variance + eps`` with a Python float converts the
   scalar on every call); ``joint rope`` -- RoPE over q and k concatenated, one rotation instead of two.

Prints the median step time of each.
"""
import statistics
import sys
import time

import torch

from kvrag.kv import batched, direct, hf_cache, quant
from kvrag_bench.decode_bench import context_rows
from kvrag_bench.prof import step_args


def _stack(mods):
    """One int4 weight over ``mods``' rows (their packed blocks and (scale, zero) pairs concatenated)."""
    parts = [m._kvrag_quant.qweight for m in mods]
    out = quant._Int4.__new__(quant._Int4)
    out.packed = torch.cat([p.packed for p in parts])
    out.scales_zeros = torch.cat([p.scales_zeros for p in parts], dim=1)
    return out, [int(m.weight.shape[0]) for m in mods]


def _variant(model, stacked=False, inline_norm=False, joint_rope=False):
    inner = model.model
    layers = list(inner.layers[: model.config.num_hidden_layers])
    rope = sys.modules[type(layers[0].self_attn).__module__].apply_rotary_pos_emb
    stacks = {id(layer): (_stack([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                          _stack([layer.mlp.gate_proj, layer.mlp.up_proj])) for layer in layers} if stacked else {}
    eps = {id(n): torch.tensor(n.variance_epsilon) for layer in layers
           for n in (layer.input_layernorm, layer.post_attention_layernorm)}

    def norm(mod, h):
        if not inline_norm:
            return mod.forward(h)
        x = h.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps[id(mod)])
        return mod.weight * x.to(h.dtype)

    def linears(stack, mods, x):
        if stack is None:
            return [m.forward(x) for m in mods]
        w, sizes = stack
        y = w.mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16)).to(x.dtype)
        return [p.view(*x.shape[:-1], p.shape[-1]) for p in y.split(sizes, dim=-1)]

    def rotate(q, k, cos, sin):
        if not joint_rope:
            return rope(q, k, cos, sin)
        qk = torch.cat((q, k), 1)
        d = qk.shape[-1] // 2
        out = qk * cos.unsqueeze(1) + torch.cat((-qk[..., d:], qk[..., :d]), -1) * sin.unsqueeze(1)
        return out[:, : q.shape[1]], out[:, q.shape[1] :]

    @torch.inference_mode()
    def forward(model, ids, pos, keep, attention, segments=None):
        h = inner.embed_tokens.forward(ids)
        cos, sin = inner.rotary_emb.forward(h, position_ids=pos)
        b, s = ids.shape
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_stack, gu_stack = stacks.get(id(layer), (None, None))
            shape = (b, s, -1, a.head_dim)
            x = norm(layer.input_layernorm, h)
            q, k, v = (t.view(shape).transpose(1, 2) for t in linears(qkv_stack, (a.q_proj, a.k_proj, a.v_proj), x))
            q, k = rotate(q, k, cos, sin)
            o, _ = attention(a, q, k, v, a.scaling)
            h = h + a.o_proj.forward(o.reshape(b, s, -1).contiguous())
            x = norm(layer.post_attention_layernorm, h)
            gate, up = linears(gu_stack, (mlp.gate_proj, mlp.up_proj), x)
            h = h + mlp.down_proj.forward(mlp.act_fn(gate) * up)
        h = inner.norm.forward(h)
        return model.lm_head.forward(h if keep == 0 else h[:, -keep:, :])

    return forward


def _median_step(model, rows, win, n=30):
    toks = [500] * len(rows)
    times = []
    for i in range(n + 3):
        t = time.perf_counter()
        batched.decode_step(model, rows, toks, win)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def parts(model, keys, values, dtype, win):
    rows = context_rows(keys, values, 1, keys.shape[2] + 64, dtype)
    print(f"parts, context {keys.shape[2]}, batch 1: step {_median_step(model, rows, win):.1f} ms", end="")
    mm, sdpa = quant._Int4.mm, torch.nn.functional.scaled_dot_product_attention
    outs = {}

    def no_kernel(self, x):
        shape = (x.shape[0], self.scales_zeros.shape[1])
        return outs.setdefault(shape, torch.zeros(shape, dtype=torch.bfloat16))

    try:
        quant._Int4.mm = no_kernel
        print(f"; without the int4 products {_median_step(model, rows, win):.1f} ms", end="")
        z = {}
        torch.nn.functional.scaled_dot_product_attention = lambda q, *a, **k: z.setdefault(q.shape, torch.zeros_like(q))
        print(f"; without them and the attention {_median_step(model, rows, win):.1f} ms")
    finally:
        quant._Int4.mm, torch.nn.functional.scaled_dot_product_attention = mm, sdpa


def main():
    quantize, contexts, batches, steps, lm = step_args("512,1536")
    assert quantize == "int4", "the variants stack int4 weights"
    model, win = lm.model, batched.windows(lm.model)
    assert direct.why_not(model) is None, "the direct loop does not serve this model"
    base = direct.forward
    variants = {"direct": base, "stacked": _variant(model, stacked=True),
                "inline norm": _variant(model, inline_norm=True), "joint rope": _variant(model, joint_rope=True)}
    print(f"{lm.name} {lm.dtype} quantize={quantize}, one thread")
    try:
        for n, ctx in enumerate(contexts):
            keys, values = hf_cache.prefill_kv(model, torch.tensor(list(range(1000, 1000 + ctx))))
            if n == 0:
                parts(model, keys, values, lm.dtype, win)
            for b in batches:
                sides = {name: context_rows(keys, values, b, ctx + steps + 2, lm.dtype) for name in variants}
                times = {name: [] for name in variants}
                toks = [500 + i for i in range(b)]
                for st in range(steps):
                    order = list(variants) if st % 2 == 0 else list(reversed(variants))
                    got = {}
                    for name in order:
                        direct.forward = variants[name]
                        t = time.perf_counter()
                        got[name] = batched.decode_step(model, sides[name], toks, win)
                        times[name].append(time.perf_counter() - t)
                        for r in sides[name]:
                            r.length += 1
                    for name, logits in got.items():
                        assert torch.equal(logits, got["direct"]), f"{name} changed the logits"
                    toks = [int(t) for t in got["direct"].argmax(-1)]
                ms = {name: 1e3 * statistics.median(t[2:]) for name, t in times.items()}
                print(f"context {ctx:5d} batch {b}: " + ", ".join(
                    f"{name} {v:.1f} ms ({v / ms['direct']:.3f}x)" for name, v in ms.items()), flush=True)
    finally:
        direct.forward = base


if __name__ == "__main__":
    main()
