"""Profiling and A/B scripts, each run as a file (``python benchmarks/kvrag_bench/prof/NAME.py ...``; see its
docstring). They drive the benchmark runner on dev data outside the repository."""

import sys
from typing import Any


def step_args(contexts: str = "1536") -> tuple[str, list[int], list[int], int, Any]:
    """The decode-step A/B scripts' arguments from ``sys.argv`` -- weights (``int4`` / ``int8`` / ``none``), contexts
    and batches (comma-separated), steps -- with torch on one thread and the default model loaded with those weights.

    Returns:
        (weights, contexts, batches, steps, the loaded model as :func:`kvrag.models.load_model` returns it).
    """
    import torch

    from kvrag.models import load_model

    torch.set_num_threads(1)
    argv = sys.argv[1:] + [None] * 4
    quantize = argv[0] or "int4"
    ctxs = [int(c) for c in (argv[1] or contexts).split(",")]
    batches = [int(b) for b in (argv[2] or "1,8").split(",")]
    steps = int(argv[3] or 40)
    return quantize, ctxs, batches, steps, load_model(None, quantize=None if quantize == "none" else quantize)
