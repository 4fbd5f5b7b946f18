"""Where a GGUF model's decode step goes, layer type by layer type: the model's own forward (one token after a short
prompt, the model's default dtype and quantization, one thread) with a timer around every GGUF-resident linear layer.

    python benchmarks/kvrag_bench/prof/gguf_step_layers.py FILE.gguf [steps]

Prints the mean step time and, per projection name and block type (e.g. ``down_proj:Q6_K``), the milliseconds a step
spends in those layers and how many there are.
"""
import collections
import functools
import sys
import time

import torch

from kvrag.kv.gguf_quant import GGUFLinear
from kvrag.models import load_model


def main() -> None:
    torch.set_num_threads(1)
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    model = load_model(sys.argv[1]).model
    spent: collections.defaultdict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    started: dict[int, float] = {}

    def start(mod: torch.nn.Module, _x: object) -> None:
        started[id(mod)] = time.perf_counter()

    def stop(mod: torch.nn.Module, _x: object, _y: object, key: str) -> None:  # None: the output stays
        spent[key] += time.perf_counter() - started[id(mod)]
        count[key] += 1

    for name, mod in model.named_modules():
        if isinstance(mod, GGUFLinear):
            mod.register_forward_pre_hook(start)
            mod.register_forward_hook(functools.partial(stop, key=f"{name.rsplit('.', 1)[-1]}:{mod.qtype}"))
    ids = torch.randint(100, 1000, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        spent.clear()
        count.clear()
        t = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        step_ms = 1e3 * (time.perf_counter() - t) / steps
    print(f"step {step_ms:.0f} ms; in GGUF layers {1e3 * sum(spent.values()) / steps:.0f} ms")
    for key, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {key}: {1e3 * s / steps:.1f} ms a step, {count[key] // steps} layers")


if __name__ == "__main__":
    main()
