"""Copy a CacheRepair checkpoint with its predicted residual scaled by aK (keys) and aV (values): a diagnostic.

    python benchmarks/kvrag_bench/prof/scale_ckpt.py SRC_DIR DST_DIR aK aV
(see docs/results/cacherepair_residual_scale.md).
"""
import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main():
    src, dst, ak, av = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "repair_config.json").read_text())
    t = load_file(str(src / "repair_model.safetensors"))
    a = cfg["architecture"]
    L, H, D = a.get("num_layers"), a.get("num_kv_heads"), a.get("head_dim")
    w, b = t["head.weight"], t["head.bias"]
    scale = torch.tensor([ak, av]).view(1, 2, 1, 1).expand(L, 2, H, D).reshape(-1)
    t["head.weight"] = (w * scale[:, None]).contiguous()
    t["head.bias"] = (b * scale).contiguous()
    save_file(t, str(dst / "repair_model.safetensors"), metadata={"format": "kvrag-cacherepair"})
    cfg["weights"]["sha256"] = hashlib.sha256((dst / "repair_model.safetensors").read_bytes()).hexdigest()
    (dst / "repair_config.json").write_text(json.dumps(cfg, indent=2))
    print(dst, ak, av)


if __name__ == "__main__":
    main()
