"""kvrag_bench.metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvrag.errors import ConfigError
from kvrag_bench.metrics import (
    bootstrap_ci,
    exact_match,
    extract_answer,
    f1_score,
    gap_recovery,
    kl_divergence,
    kv_rel_rmse,
    normalize_answer,
    paired_bootstrap,
)

# ------------------------------------------------------------------ SQuAD EM / F1


@pytest.mark.parametrize(
    ("raw", "norm"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  an   apple, a pear!  ", "apple pear"),
        ("Theatre", "theatre"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("rock-'n'-roll", "rocknroll"),
        ("", ""),
    ],
)
def test_normalize_answer(raw: str, norm: str) -> None:
    assert normalize_answer(raw) == norm


def test_exact_match() -> None:
    assert exact_match("the Paris.", ["Paris"]) == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("NYC", ["New York City", "nyc"]) == 1.0


def test_f1_partial_overlap() -> None:
    # pred {eiffel, tower, paris} vs gold {eiffel, tower}: P = 2/3, R = 1, F1 = 0.8
    assert f1_score("The Eiffel Tower, Paris", ["Eiffel Tower"]) == pytest.approx(0.8)
    # with "in": pred has 4 tokens, P = 2/4, R = 1 -> 2/3
    assert f1_score("The Eiffel Tower in Paris", ["Eiffel Tower"]) == pytest.approx(2 / 3)
    # pred {new, york} vs gold {new, york, city}: P = 1, R = 2/3 -> 0.8; max over aliases picks the exact one
    assert f1_score("New York", ["New York City"]) == pytest.approx(0.8)
    assert f1_score("New York", ["New York City", "new york"]) == 1.0
    # repeated tokens count with multiplicity: pred {a1 x2} vs gold {a1}: common = 1, P = 1/2, R = 1 -> 2/3
    assert f1_score("paris paris", ["Paris"]) == pytest.approx(2 / 3)
    assert f1_score("London", ["Paris"]) == 0.0
    # empty after normalization (SQuAD v2 rule): equal only to another empty answer
    assert f1_score("the", ["a"]) == 1.0
    assert f1_score("", ["Paris"]) == 0.0


def test_scores_need_gold_answers() -> None:
    with pytest.raises(ConfigError):
        f1_score("x", [])
    with pytest.raises(ConfigError):
        exact_match("x", "x")  # a bare string is not a list of aliases


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("Paris.", "Paris"),
        ("Answer: Paris", "Paris"),
        ("The answer is Paris.\nBecause it is the capital.", "Paris"),
        ("\n\n  A: 1945  \n", "1945"),
        ("**Final answer:** *Marie Curie*.", "Marie Curie"),
        ('"The answer is: 42"', "42"),
        ("Paris is the capital of France.", "Paris is the capital of France"),
        ("", ""),
    ],
)
def test_extract_answer(text: str, answer: str) -> None:
    assert extract_answer(text) == answer


# ------------------------------------------------------------------ KL / KV error


def test_kl_known_distributions() -> None:
    p = torch.tensor([[0.5, 0.5], [0.25, 0.75]]).log()
    q = torch.tensor([[0.9, 0.1], [0.25, 0.75]]).log()
    kl = kl_divergence(p, q)
    assert kl.dtype == torch.float64 and kl.shape == (2,)
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl[0].item() == pytest.approx(expected, rel=1e-6)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)
    # logits are shift-invariant; KL is not symmetric
    assert kl_divergence(p + 3.0, q - 1.0)[0].item() == pytest.approx(expected, rel=1e-6)
    assert kl_divergence(q, p)[0].item() != pytest.approx(expected, rel=1e-3)


def test_kl_zero_for_equal_logits_and_masked_vocab() -> None:
    x = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    assert torch.equal(kl_divergence(x, x.clone()), torch.zeros(5, dtype=torch.float64))
    masked = x.clone()
    masked[:, 3] = float("-inf")  # p = 0 there: contributes 0, not nan
    kl = kl_divergence(masked, x)
    assert torch.isfinite(kl).all() and (kl > 0).all()
    with pytest.raises(ConfigError):
        kl_divergence(x, x[:, :5])


def test_kv_rel_rmse() -> None:
    ref = torch.ones(2, 1, 4, 2)  # ||ref|| = 4 over all 16 elements
    test = ref.clone()
    test[:, :, 3] += 1.0  # error only at token 3: ||test - ref|| = 2
    assert kv_rel_rmse(ref, test) == pytest.approx(2 / 4)
    mask = torch.tensor([True, True, False, False])
    assert kv_rel_rmse(ref, test, mask) == 0.0
    mask = torch.tensor([False, False, False, True])  # ||ref[..,3,:]|| = 2, error 2
    assert kv_rel_rmse(ref, test, mask) == pytest.approx(1.0)
    assert kv_rel_rmse(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2)) == 0.0
    with pytest.raises(ConfigError):
        kv_rel_rmse(ref, test, torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ConfigError):
        kv_rel_rmse(ref, test[:, :, :2])
    assert kv_rel_rmse(ref.bfloat16(), test.bfloat16()) == pytest.approx(0.5)


# ------------------------------------------------------------------ statistics


def test_bootstrap_constant_sample_has_zero_width() -> None:
    assert bootstrap_ci([0.7] * 20, n=200, seed=1) == pytest.approx((0.7, 0.7, 0.7))
    diff, lo, hi = paired_bootstrap([0.2] * 10, [0.5] * 10, n=200)
    assert (diff, lo, hi) == pytest.approx((0.3, 0.3, 0.3))


def test_bootstrap_interval_contains_mean_and_is_reproducible() -> None:
    x = np.random.default_rng(0).normal(1.0, 2.0, size=200)
    mean, lo, hi = bootstrap_ci(x, n=1000, seed=0)
    assert mean == pytest.approx(x.mean())
    assert lo < mean < hi
    # roughly mean +- 1.96 * sd / sqrt(n)
    assert hi - lo == pytest.approx(2 * 1.96 * x.std(ddof=1) / math.sqrt(x.size), rel=0.2)
    assert bootstrap_ci(x, n=1000, seed=0) == (mean, lo, hi)
    assert bootstrap_ci(x, n=1000, seed=1) != (mean, lo, hi)


def test_paired_bootstrap_detects_a_shift() -> None:
    rng = np.random.default_rng(1)
    a = rng.uniform(size=100)
    b = a + 0.1 + rng.normal(0, 0.01, size=100)  # paired: tiny noise on the difference
    diff, lo, hi = paired_bootstrap(a, b, n=500, seed=0)
    assert diff == pytest.approx(float(np.mean(b - a)))
    assert 0.09 < lo < diff < hi < 0.11
    with pytest.raises(ConfigError):
        paired_bootstrap([1.0, 2.0], [1.0])
    with pytest.raises(ConfigError):
        bootstrap_ci([])


def test_gap_recovery() -> None:
    assert gap_recovery(0.6, stale=0.4, full=0.8) == pytest.approx(0.5)
    assert gap_recovery(0.8, stale=0.4, full=0.8) == 1.0
    assert gap_recovery(0.3, stale=0.4, full=0.8) == pytest.approx(-0.25)
    assert gap_recovery(0.05, stale=0.2, full=0.0) == pytest.approx(0.75)  # lower-is-better metrics (KL)
    assert gap_recovery(0.5, stale=0.7, full=0.7) is None
