"""Next-token KL between llama.cpp's logits and kvrag's on the same GGUF file and token ids.

    python benchmarks/kvrag_bench/prof/kl_gguf_llamacpp.py FILE.gguf [TOKENS] [PROMPTS]

kvrag loads the file (weights resident in its blocks) twice in one process: dense (``quantize=None``, float32: the
file's exact weights) and with kvrag's defaults; each of ``PROMPTS`` prompts (dev QA passages, ``TOKENS`` ids each)
is prefilled and the last position's next-token distribution compared with llama.cpp's on the same ids. llama.cpp is
fed one token per call (batched calls crash in some llama-cpp-python builds; the logits are the same computation).
Prints KL(llama.cpp || kvrag) per prompt and their mean, and a JSON line (``RESULT {...}``).
"""
import json
import statistics
import sys

import numpy as np
import torch


def main() -> None:
    import llama_cpp

    from kvrag.models import load_model

    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    prompts = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    torch.set_num_threads(1)
    dense = load_model(path, dtype="float32", quantize=None)
    default = load_model(path)
    rows = [json.loads(line) for line in open("/work/shared/data/qa_dev.jsonl", encoding="utf-8")][:prompts]
    llm = llama_cpp.Llama(model_path=path, n_threads=1, n_threads_batch=1, n_batch=1, n_ubatch=1, n_ctx=n + 8,
                          verbose=False)
    out: dict = {"file": path, "tokens": n, "default": f"{default.dtype} {default.quantize}", "prompts": []}
    for r in rows:
        text = " ".join(c["text"] for c in r["contexts"])
        ids = dense.tokenizer(text, add_special_tokens=False)["input_ids"][:n]
        llm.reset()
        llm.eval(ids)
        ref = torch.from_numpy(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1),
                                                     shape=(llm.n_vocab(),)).copy()).double()
        cell = {}
        for name, lm in (("dense_float32", dense), ("default", default)):
            with torch.inference_mode():
                logits = lm.model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            p = torch.log_softmax(ref[: logits.shape[0]], -1)
            q = torch.log_softmax(logits, -1)
            cell[name] = {"kl": float((p.exp() * (p - q)).sum()), "same_top1": int(ref.argmax()) == int(logits.argmax())}
        out["prompts"].append(cell)
        print(cell, flush=True)
    for name in ("dense_float32", "default"):
        out[f"mean_kl_{name}"] = statistics.mean(c[name]["kl"] for c in out["prompts"])
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
