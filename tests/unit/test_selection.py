"""Pure selection logic of the selective-recompute fusion methods: budgets, top-k, RelaxKV schedules, ProphetKV,
EPIC and CacheBlend selections, on hand-built tensors (no model)."""

from __future__ import annotations

import pytest
import torch

from kvrag.errors import ConfigError
from kvrag.fusion.base import Bool, FusionInput, Span
from kvrag.fusion.cacheblend import kv_deviation
from kvrag.fusion.epic import epic_positions
from kvrag.fusion.prophetkv import prophet_select
from kvrag.fusion.recompute import budget, exact_mask, top_positions
from kvrag.fusion.relaxkv import relaxkv_schedule


def _set(t: torch.Tensor) -> set[int]:
    return {int(x) for x in t}


@pytest.mark.parametrize(
    ("r", "n", "k"),
    [
        (0.15, 10, 2),  # 1.5 rounds half-up, not to even
        (0.25, 10, 3),  # 2.5 -> 3 (Python's round gives 2)
        (0.35, 10, 4),  # 3.4999999999999996 in floating point is 3.5
        (0.15, 43, 6),  # 6.45
        (0.3, 43, 13),  # 12.9
        (0.01, 10, 1),  # max(1, .)
        (1.0, 7, 7),
        (1.0, 1, 1),
        (0.5, 0, 0),  # nothing to pick from
    ],
)
def test_budget_is_max_1_round_half_up(r: float, n: int, k: int) -> None:
    assert budget(r, n) == k


def test_top_positions_sorted_ties_by_position_and_candidates() -> None:
    s = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.5, 0.0])
    assert top_positions(s, 2).tolist() == [1, 3]
    assert top_positions(s, 3).tolist() == [1, 2, 3]  # tie 2 vs 4 -> lower position
    cand = torch.tensor([True, False, True, True, True, True])
    assert top_positions(s, 2, cand).tolist() == [2, 3]
    assert top_positions(s, 10, cand).tolist() == [0, 2, 3, 4, 5]  # capped at the candidates
    assert top_positions(s, 0).tolist() == []


def _scores(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_relaxkv_schedule_hand_built() -> None:
    # L = 3, Tc = 8, k = 2; position 0 is exact (the prefix)
    scores = _scores(
        [
            [0.0, 0.9, 0.1, 0.0, 0.0, 0.8, 0.0, 0.0],  # A_0 = {1, 5}
            [0.0, 0.0, 0.1, 0.0, 0.0, 0.9, 0.7, 0.0],  # A_1 = {5, 6}
            [0.95, 0.0, 0.9, 0.0, 0.0, 0.0, 0.1, 0.0],  # A_2 = {0, 2}: 0 is exact
        ]
    )
    exact = torch.zeros(8, dtype=torch.bool)
    exact[0] = True
    s = relaxkv_schedule(scores, 2, exact)
    assert [a.tolist() for a in s.anchors] == [[1, 5], [5, 6], [0, 2]]
    assert s.deepest.tolist() == [2, 0, 2, -1, -1, 1, 1, -1]
    # active through the deepest selecting layer, exact positions never
    assert [a.tolist() for a in s.active] == [[1, 2, 5, 6], [2, 5, 6], [2]]
    assert s.union.tolist() == [0, 1, 2, 5, 6]  # the exact sink joins the context, not the targets


def test_relaxkv_schedule_exact_context_all() -> None:
    scores = _scores([[0.95, 0.9, 0.1, 0.2], [0.95, 0.0, 0.3, 0.1]])
    exact = torch.tensor([True, False, False, False])
    s = relaxkv_schedule(scores, 1, exact, exact_context="all")
    assert [a.tolist() for a in s.anchors] == [[1], [2]]  # the exact position does not take a slot
    assert [a.tolist() for a in s.active] == [[1, 2], [2]]
    assert s.union.tolist() == [0, 1, 2]  # ... and is always in the context


@pytest.mark.parametrize("seed", range(5))
def test_relaxkv_schedule_invariants(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n_layers, tc, k = 6, 40, 5
    scores = torch.rand(n_layers, tc, generator=g)
    exact = torch.zeros(tc, dtype=torch.bool)
    exact[:4] = True
    for mode in ("anchors", "all"):
        s = relaxkv_schedule(scores, k, exact, exact_context=mode)
        u = _set(s.union)
        assert all(a.numel() == k for a in s.anchors)
        assert u >= set().union(*(_set(a) for a in s.anchors))  # U is the anchor union
        assert _set(s.active[0]) == {t for t in u if not exact[t]}  # S_0 = U minus exact
        for layer in range(n_layers):
            act = _set(s.active[layer])
            assert not any(exact[t] for t in act)
            if layer + 1 < n_layers:
                assert _set(s.active[layer + 1]) <= act  # nested, shrinking with depth
            for deeper in range(layer, n_layers):  # an anchor at layer l' is active at every layer <= l'
                assert {t for t in _set(s.anchors[deeper]) if not exact[t]} <= act
        assert s.active == sorted(s.active, key=lambda a: -a.numel())
        assert all(torch.equal(a, torch.sort(a).values) for a in s.active)


def test_prophet_select_layer_mean_and_candidates() -> None:
    scores = _scores([[0.0, 0.1, 0.9, 0.0, 0.5], [0.0, 0.8, 0.0, 0.0, 0.5]])  # mean: [0, .45, .45, 0, .5]
    cand = torch.tensor([False, True, True, True, True])
    assert prophet_select(scores, cand, 0.5).tolist() == [1, 4]  # k = round(0.5 * 4) = 2; tie 1 vs 2 -> 1
    assert prophet_select(scores, cand, 0.01).tolist() == [4]  # at least one
    assert prophet_select(scores, cand, 1.0).tolist() == [1, 2, 3, 4]


def test_epic_positions_first_k_of_each_chunk() -> None:
    spans = [Span(0, 6, "prefix"), Span(6, 15, "chunk", "a"), Span(15, 19, "text"), Span(19, 32, "chunk", "b")]
    assert epic_positions(spans, 3).tolist() == [6, 7, 8, 15, 16, 17, 19, 20, 21]
    assert epic_positions(spans, 5).tolist() == [6, 7, 8, 9, 10, 15, 16, 17, 18, 19, 20, 21, 22, 23]
    assert epic_positions(spans, 100).tolist() == list(range(6, 32))
    assert epic_positions(spans, 0).tolist() == []


def test_epic_skips_a_chunk_at_position_zero() -> None:
    spans = [Span(0, 5, "chunk", "a"), Span(5, 9, "chunk", "b")]
    assert epic_positions(spans, 2).tolist() == [5, 6]


def test_kv_deviation_sums_heads_and_dims() -> None:
    stale = torch.zeros(2, 3, 4)
    fresh = torch.zeros(2, 3, 4)
    fresh[0, 1, 0] = 2.0
    fresh[1, 1, 3] = 1.0
    fresh[1, 2, 2] = -1.0
    assert kv_deviation(fresh, stale).tolist() == [0.0, 5.0, 1.0]


def _inp(spans: list[Span]) -> FusionInput:
    tc = spans[-1].end
    z = torch.zeros(1, 1, tc, 2)
    return FusionInput(None, None, None, torch.zeros(tc, dtype=torch.long), z, z, spans, torch.zeros(1))  # type: ignore[arg-type]


def test_exact_mask_prefix_and_first_chunk() -> None:
    inp = _inp([Span(0, 2, "prefix"), Span(2, 5, "chunk", "a"), Span(5, 7, "chunk", "b")])
    assert exact_mask(inp).tolist() == [True, True, False, False, False, False, False]
    assert exact_mask(inp, first_chunk=True).tolist() == [True] * 5 + [False, False]


@pytest.mark.parametrize(("raw", "val"), [("true", True), ("False", False), ("1", True), ("0", False), (True, True)])
def test_bool_parameter_type(raw: object, val: bool) -> None:
    assert Bool(raw) is val


def test_bool_parameter_type_rejects_garbage() -> None:
    with pytest.raises(ValueError):
        Bool("maybe")
    from kvrag.fusion import get_method

    with pytest.raises(ConfigError):
        get_method("relaxkv:exclude_first_chunk=maybe")
