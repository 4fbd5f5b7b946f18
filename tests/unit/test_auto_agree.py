"""``auto:agree``: per-request escalation until the first decode step is confident, and the ``ape`` temperature."""

from __future__ import annotations

import json

import pytest
import torch

from kvrag.errors import ConfigError
from kvrag.fusion import escalate, get_method
from kvrag.fusion.escalate import AGREE_THRESHOLDS, Ladder, first_step_confidence, parse_levels, thresholds_for
from kvrag.kv import hf_cache, pieces
from kvrag_testing.fusion_suite import context_kv, fusion_case, greedy_tokens


def _suffix_logits(inp, out) -> torch.Tensor:
    logits, _ = hf_cache.forward(inp.model, inp.suffix_ids, out.cache, start=inp.context_len)
    return logits[-1]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("zero_copy", [False, True])
def test_agree_one_escalates_to_full(family: str, zero_copy: bool) -> None:
    case = fusion_case(family)
    inp = case.fusion_input(zero_copy=zero_copy)
    out = get_method("auto:agree=1.0,levels=0/0.015/1").fuse(inp)
    st = out.stats
    assert st.auto_levels == [0.0, 0.015, 1.0] and st.auto_choice == "full" and st.auto_reason == "last level"
    assert len(st.auto_confidences or []) == 3 and st.auto_agree == 1.0 and st.auto_budget is None
    assert greedy_tokens(inp, out, len(case.full_tokens)) == case.full_tokens
    k, v = context_kv(out, inp.context_len)
    torch.testing.assert_close(k, case.full_keys, atol=2e-5, rtol=0)
    torch.testing.assert_close(v, case.full_values, atol=2e-5, rtol=0)


def test_default_ladder_is_cacherepair_then_full() -> None:
    case = fusion_case("llama")
    out = get_method("auto:agree=1.0").fuse(case.fusion_input())
    assert out.stats.auto_levels == [0.0, 1.0] and out.stats.auto_choice == "full"


def test_stops_at_the_first_confident_level() -> None:
    case = fusion_case("llama")
    # a model without a repairer starts from the stale cache; threshold 0: the first level is kept
    out = pieces.run_whole(Ladder((0.0, 1.0), (0.0,), lambda spec, ran: True).run(case.fusion_input(), pieces.WHOLE))
    assert out.stats.auto_levels == [0.0] and out.stats.auto_choice == "stale"
    inp = case.fusion_input()
    stale = get_method("stale").fuse(inp)
    torch.testing.assert_close(out.last_logits, _suffix_logits(inp, stale), atol=1e-5, rtol=0)
    assert out.stats.auto_confidences == [pytest.approx(first_step_confidence(out.last_logits))]


def test_the_threshold_decides_the_level() -> None:
    case = fusion_case("llama")
    allowed = lambda spec, ran: True  # noqa: E731
    first = pieces.run_whole(Ladder((0.0, 1.0), (1.01,), allowed).run(case.fusion_input(), pieces.WHOLE))
    c0 = first.stats.auto_confidences[0]
    assert first.stats.auto_levels == [0.0, 1.0]
    keep = pieces.run_whole(Ladder((0.0, 1.0), (c0 - 1e-6,), allowed).run(case.fusion_input(), pieces.WHOLE))
    assert keep.stats.auto_levels == [0.0] and "top-1 probability" in keep.stats.auto_reason
    up = pieces.run_whole(Ladder((0.0, 1.0), (c0 + 1e-6,), allowed).run(case.fusion_input(), pieces.WHOLE))
    assert up.stats.auto_levels == [0.0, 1.0] and up.stats.auto_choice == "full"


def test_the_budget_caps_the_escalation() -> None:
    case = fusion_case("llama")
    out = get_method("auto:agree=1.0,budget=0.01").fuse(case.fusion_input())
    assert out.stats.auto_levels == [0.0]
    assert "TTFT budget" in out.stats.auto_reason and out.stats.auto_budget == 0.01


def test_levels_and_thresholds() -> None:
    assert parse_levels("0/0.015/1") == (0.0, 0.015, 1.0)
    for bad in ("1/0", "0/0", "0/2", "x", ""):
        with pytest.raises(ConfigError, match="levels"):
            parse_levels(bad)
    for lo, hi in zip(sorted(AGREE_THRESHOLDS), sorted(AGREE_THRESHOLDS)[1:], strict=False):
        assert all(a <= b for a, b in zip(thresholds_for(lo, 3), thresholds_for(hi, 3), strict=True))
    assert thresholds_for(0.85, 3) == thresholds_for(0.9, 3)  # between two rows: the stricter
    assert len(thresholds_for(0.9, 5)) == 4 and thresholds_for(0.9, 1) == ()


def test_bad_specs_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="agree"):
        get_method("auto:levels=0/1")
    with pytest.raises(ConfigError, match=r"agree must be in \(0, 1\] \(a target rate of answers equal to full's\)"):
        get_method("auto:agree=2")
    with pytest.raises(ConfigError, match="levels"):
        get_method("auto:agree=0.9,levels=1/0.5")
    assert get_method("auto").budget == 0.3  # the budget mode keeps its default


def test_thresholds_per_model_and_from_a_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's shipped calibration (keyed by its shape) or ``thresholds=FILE`` decides where the ladder stops; a
    model without either takes the default model's; a bad file is a clear error."""
    case = fusion_case("llama")
    key = escalate.model_key(case.fusion_input().model)
    assert key.startswith("llama:") and key == escalate.model_key(fusion_case("llama").fusion_input().model)
    assert escalate.agree_table(case.fusion_input().model) is AGREE_THRESHOLDS  # not calibrated: the default's
    keep, up = tmp_path / "keep.json", tmp_path / "up.json"
    keep.write_text(json.dumps({"thresholds": {"0.9": [0.0]}}))
    up.write_text(json.dumps({"thresholds": {"0.9": [1.01]}}))
    assert get_method(f"auto:agree=0.9,thresholds={keep}").fuse(case.fusion_input()).stats.auto_levels == [0.0]
    assert get_method(f"auto:agree=0.9,thresholds={up}").fuse(case.fusion_input()).stats.auto_levels == [0.0, 1.0]
    monkeypatch.setattr(escalate, "_shipped", lambda: {key: {0.9: (0.0,)}})  # a shipped calibration for the model
    assert get_method("auto:agree=0.9").fuse(case.fusion_input()).stats.auto_levels == [0.0]
    assert get_method("auto:agree=0.9").kept_context_threshold("cacherepair", case.fusion_input().model) == 0.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"thresholds": {"2": [0.5]}}))
    with pytest.raises(ConfigError, match="agreement thresholds"):
        get_method(f"auto:agree=0.9,thresholds={bad}").fuse(case.fusion_input())
    with pytest.raises(ConfigError, match="thresholds belong to agree"):
        get_method(f"auto:thresholds={keep}")


def test_the_shipped_calibrations_parse() -> None:
    data = json.loads(escalate.MODEL_THRESHOLDS.read_text())
    for key, entry in data["models"].items():
        assert escalate.parse_table(entry["thresholds"], key) and entry["levels"][-1] == "full"


def test_ape_scales_only_the_reused_keys() -> None:
    case = fusion_case("llama")
    inp = case.fusion_input()
    base = context_kv(get_method("stale").fuse(inp), inp.context_len)
    same = context_kv(get_method("ape:t=1,base=stale").fuse(case.fusion_input()), inp.context_len)
    torch.testing.assert_close(same[0], base[0], atol=0, rtol=0)
    k, v = context_kv(get_method("ape:t=0.5,base=stale").fuse(case.fusion_input()), inp.context_len)
    reused = inp.reusable_mask
    torch.testing.assert_close(k[:, :, reused], 2.0 * base[0][:, :, reused], atol=1e-6, rtol=0)
    torch.testing.assert_close(k[:, :, ~reused], base[0][:, :, ~reused], atol=0, rtol=0)
    torch.testing.assert_close(v, base[1], atol=0, rtol=0)
    torch.testing.assert_close(inp.keys, case.fusion_input().keys, atol=0, rtol=0)  # the input is not modified
    with pytest.raises(ConfigError, match="temperature"):
        get_method("ape:t=0")
