"""Benchmark metrics: answer quality (SQuAD EM/F1), output fidelity (KL), cache fidelity (KV rel-RMSE), statistics.

* :func:`exact_match` / :func:`f1_score` follow the official SQuAD v1.1/v2.0 evaluation script (normalization,
  token-level F1, max over gold aliases).
* :func:`kl_divergence` compares a method's next-token distributions with the full-prefill reference.
* :func:`kv_rel_rmse` measures how far a repaired cache is from the joint-prefill cache.
* :func:`same_answer` / :func:`same_tokens`: what a user sees, whether a method's answer is the one ``full`` gives
  (the normalized answer of the F1 code, or the very same generated tokens).
* :func:`paired_bootstrap` / :func:`bootstrap_ci` give percentile confidence intervals; :func:`gap_recovery`
  says which fraction of the stale-vs-full gap a method closes.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Sequence

import numpy as np
import torch

from kvrag.errors import ConfigError

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = frozenset(string.punctuation)


# ----------------------------------------------------------------------------------------------------------------
# Answer quality
# ----------------------------------------------------------------------------------------------------------------


def normalize_answer(s: str) -> str:
    """SQuAD normalization: lower-case, drop punctuation, drop articles (a/an/the), collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _check_answers(answers: Sequence[str]) -> None:
    if isinstance(answers, str) or not len(answers):
        msg = f"answers must be a non-empty list of gold strings, got {answers!r}"
        raise ConfigError(msg)


def exact_match(pred: str, answers: Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer, else 0.0.

    Args:
        pred: the predicted answer.
        answers: gold answers (aliases); non-empty.
    """
    _check_answers(answers)
    p = normalize_answer(pred)
    return float(any(p == normalize_answer(a) for a in answers))


def same_answer(pred: str, reference: str) -> bool:
    """True when two answers are equal after SQuAD normalization (:func:`normalize_answer`), the comparison the F1
    code makes: case, punctuation, articles and spacing do not count."""
    return normalize_answer(pred) == normalize_answer(reference)


def same_tokens(pred: Sequence[int], reference: Sequence[int]) -> bool:
    """True when two generations are token-identical (same ids, same length)."""
    return [int(t) for t in pred] == [int(t) for t in reference]


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    if not pred_tokens or not gold_tokens:  # SQuAD v2: empty vs empty scores 1, empty vs non-empty scores 0
        return float(pred_tokens == gold_tokens)
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(pred: str, answers: Sequence[str]) -> float:
    """Token-level F1 between normalized prediction and gold answer, maximized over the aliases; in [0, 1].

    Args:
        pred: the predicted answer.
        answers: gold answers (aliases); non-empty.
    """
    _check_answers(answers)
    p = normalize_answer(pred).split()
    return max(_f1(p, normalize_answer(a).split()) for a in answers)


_ANSWER_PREFIXES = (
    re.compile(r"^(?:the\s+)?(?:final\s+|correct\s+|short\s+)?answer\s+is\s*[:\-]?\s*", re.IGNORECASE),
    re.compile(r"^(?:final\s+|short\s+)?answer\s*[:\-]\s*", re.IGNORECASE),
    re.compile(r"^a\s*:\s*", re.IGNORECASE),
)
_WRAPPERS = "\"'`*_ "


def extract_answer(text: str) -> str:
    """Pull a short answer out of a small model's sentence-style output.

    Deliberately simple, so scores stay comparable across methods:

    1. take the first non-empty line;
    2. strip a leading "Answer:", "A:", "Final answer:", "The answer is" (case-insensitive, repeatedly);
    3. strip surrounding quotes / markdown emphasis and one trailing period (or ``!``).

    It does not try to find the answer span inside a full sentence ("Paris is the capital of France." stays as is);
    token-level F1 gives such outputs partial credit.

    Args:
        text: generated text.

    Returns:
        The extracted answer ('' for empty output).
    """
    line = next((ln.strip() for ln in text.strip().splitlines() if ln.strip()), "")
    changed = True
    while changed and line:
        changed = False
        for pattern in _ANSWER_PREFIXES:
            stripped = pattern.sub("", line, count=1)
            if stripped != line:
                line, changed = stripped.strip(), True
        unwrapped = line.strip(_WRAPPERS)
        if unwrapped != line:
            line, changed = unwrapped, True
    if line.endswith((".", "!")) and not line.endswith(".."):
        line = line[:-1].rstrip().strip(_WRAPPERS)
    return line


# ----------------------------------------------------------------------------------------------------------------
# Output and cache fidelity
# ----------------------------------------------------------------------------------------------------------------


def kl_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor,
                  dtype: torch.dtype | None = torch.float64) -> torch.Tensor:
    """Per-position KL(p || q) between the softmax distributions of two logit tensors, in float64.

    Args:
        logits_p: reference logits [N, V] (or any [..., V]), e.g. from the full prefill.
        logits_q: compared logits, same shape.
        dtype: what the log-softmaxes are computed in; None: each in its logits' own dtype (the difference in the
            wider of the two), what the decode-time KL benchmarks (``kv-kl``, ``quant-kl``) report.

    Returns:
        KL in nats, shape [N] (the leading dims), float64 (with ``dtype=None``: the wider logits' dtype), >= 0 up
        to rounding.
    """
    if logits_p.shape != logits_q.shape:
        msg = f"logits shapes differ: {tuple(logits_p.shape)} vs {tuple(logits_q.shape)}"
        raise ConfigError(msg)
    lp = torch.log_softmax(logits_p.detach().to(dtype or logits_p.dtype), dim=-1)
    lq = torch.log_softmax(logits_q.detach().to(dtype or logits_q.dtype).to(lp.device), dim=-1)
    p = lp.exp()
    # Terms with p = 0 contribute 0 (lim p log p = 0); masking avoids 0 * (-inf) = nan for -inf logits.
    terms = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p))
    return terms.sum(dim=-1)


def kv_rel_rmse(ref: torch.Tensor, test: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Relative error ||test - ref||_2 / ||ref||_2 over the selected token positions, computed in float64.

    Args:
        ref: reference keys or values [L, H, T, D] (token axis at dim -2), e.g. from the joint prefill.
        test: the cache to evaluate, same shape.
        mask: optional bool [T] selecting token positions (e.g. only chunk tokens).

    Returns:
        The relative error (0.0 when both are zero; inf when only ``ref`` is zero).
    """
    if ref.shape != test.shape:
        msg = f"KV shapes differ: {tuple(ref.shape)} vs {tuple(test.shape)}"
        raise ConfigError(msg)
    r = ref.detach().to(torch.float64)
    t = test.detach().to(torch.float64).to(r.device)
    if mask is not None:
        mask = torch.as_tensor(mask, dtype=torch.bool, device=r.device)
        if mask.shape != (r.shape[-2],):
            msg = f"mask must be a bool tensor of shape [T]=({r.shape[-2]},), got {tuple(mask.shape)}"
            raise ConfigError(msg)
        if not bool(mask.any()):
            msg = "mask selects no token positions; nothing to compare"
            raise ConfigError(msg)
        r, t = r[..., mask, :], t[..., mask, :]
    num = torch.linalg.vector_norm(t - r).item()
    den = torch.linalg.vector_norm(r).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


# ----------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------


def _as_1d(x: Sequence[float] | np.ndarray | torch.Tensor, what: str) -> np.ndarray:
    arr = x.detach().cpu().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        msg = f"{what} must be a non-empty 1-D sequence of numbers, got shape {arr.shape}"
        raise ConfigError(msg)
    return arr


def bootstrap_ci(
    x: Sequence[float] | np.ndarray | torch.Tensor,
    n: int = 1000,
    seed: int = 0,
    *,
    confidence: float = 0.95,
) -> tuple[float, float, float]:
    """Percentile bootstrap confidence interval of the mean.

    Args:
        x: per-example values [N].
        n: bootstrap resamples.
        seed: RNG seed (numpy ``default_rng``), so intervals are reproducible.
        confidence: interval mass (0.95 -> 2.5th and 97.5th percentiles).

    Returns:
        ``(mean, lo, hi)``.
    """
    arr = _as_1d(x, "x")
    if n < 1 or not 0.0 < confidence < 1.0:
        msg = f"need n >= 1 and 0 < confidence < 1, got n={n}, confidence={confidence}"
        raise ConfigError(msg)
    rng = np.random.default_rng(seed)
    means = np.empty(n, dtype=np.float64)
    rows = max(1, (1 << 22) // arr.size)  # resample in batches to bound memory to ~32 MB of indices
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        idx = rng.integers(0, arr.size, size=(stop - start, arr.size))
        means[start:stop] = arr[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.percentile(means, [100 * alpha, 100 * (1 - alpha)])
    return float(arr.mean()), float(lo), float(hi)


def paired_bootstrap(
    a: Sequence[float] | np.ndarray | torch.Tensor,
    b: Sequence[float] | np.ndarray | torch.Tensor,
    n: int = 1000,
    seed: int = 0,
    *,
    confidence: float = 0.95,
) -> tuple[float, float, float]:
    """Paired percentile bootstrap of the mean difference ``mean(b - a)`` (same examples resampled for both).

    Args:
        a: per-example scores of the baseline [N].
        b: per-example scores of the compared method [N], aligned with ``a``.
        n: bootstrap resamples.
        seed: RNG seed.
        confidence: interval mass.

    Returns:
        ``(mean_diff, lo, hi)``; the difference is significant at that level when the interval excludes 0.
    """
    xa, xb = _as_1d(a, "a"), _as_1d(b, "b")
    if xa.shape != xb.shape:
        msg = f"paired samples must have the same length, got {xa.size} and {xb.size}"
        raise ConfigError(msg)
    return bootstrap_ci(xb - xa, n=n, seed=seed, confidence=confidence)


def gap_recovery(method: float, stale: float, full: float) -> float | None:
    """Fraction of the stale-to-full gap a method closes: ``(method - stale) / (full - stale)``.

    1.0 means as good as full recomputation, 0.0 no better than the stale cache; values can fall outside [0, 1].
    Works for higher-is-better (F1) and lower-is-better (KL) metrics alike.

    Returns:
        The fraction, or None when ``full == stale`` (no gap to recover).
    """
    if full == stale:
        return None
    return (method - stale) / (full - stale)


__all__ = [
    "bootstrap_ci",
    "exact_match",
    "extract_answer",
    "f1_score",
    "gap_recovery",
    "kl_divergence",
    "kv_rel_rmse",
    "normalize_answer",
    "paired_bootstrap",
    "same_answer",
    "same_tokens",
]
