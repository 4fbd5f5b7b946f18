"""``MethodStats``: typed per-request method statistics, their stable JSON form and reading it back."""

from __future__ import annotations

import json

import pytest

from kvrag.engine.engine import KVRAGEngine
from kvrag.engine.results import Stats
from kvrag.fusion import MethodStats
from kvrag.prompting import RagTemplate, render_passage
from kvrag.store.memory import MemoryStore
from kvrag_testing.tiny import tiny_model


def test_to_dict_writes_the_reported_fields_under_their_keys() -> None:
    st = MethodStats(recomputed_fraction=0.25, attention_computed_ratio=0.1, recomputed_per_layer=[3, 2],
                     suffix_folded=True)
    assert st.to_dict() == {"recomputed_fraction": 0.25, "attention_computed_ratio": 0.1,
                            "recomputed_per_layer": [3, 2], "suffix_folded": True}
    assert MethodStats.from_dict(st.to_dict()) == st


def test_hybrid_part_is_flat_with_the_repair_prefix_and_reads_back() -> None:
    part = MethodStats(repaired_tokens=40, repaired_fraction=0.8, repair_s=0.01, fusion_s=0.02)
    st = MethodStats(recomputed_fraction=0.1, repairer_flops=5e6, repair=part, anchors_per_layer=4)
    d = st.to_dict()
    # the keys hybrid has always written (the repair step's recomputed fraction is not repeated)
    assert {"repair_repaired_tokens", "repair_repaired_fraction", "repair_repair_s", "repair_fusion_s"} <= set(d)
    assert "repair_recomputed_fraction" not in d and "repair_s" not in d and d["repairer_flops"] == 5e6
    back = MethodStats.from_dict(d)
    assert back == st and back.repair is not None and back.repair.repaired_tokens == 40


def test_unknown_keys_are_kept_as_extra() -> None:
    d = {"recomputed_fraction": 0.5, "my_method_counter": 7}
    st = MethodStats.from_dict(d)
    assert st.extra == {"my_method_counter": 7} and st.to_dict() == d
    assert MethodStats.from_dict(None) == MethodStats()


def test_engine_stats_serialize_method_stats_as_a_dict() -> None:
    eng = KVRAGEngine(tiny_model("qwen2"), MemoryStore())
    passages = [render_passage("Paris is the capital of France.", "Paris"),
                render_passage("Berlin is the capital of Germany.", "Berlin")]
    resp = eng.answer(RagTemplate().render(eng.tokenizer, passages, "Which city?"), passages, "relaxkv:r=0.5",
                      max_new_tokens=2)
    ms = resp.stats.method_stats
    assert isinstance(ms, MethodStats) and 0 < ms.recomputed_fraction <= 1 and ms.anchors_per_layer
    d = json.loads(json.dumps(resp.to_dict()))  # JSON all the way down
    assert d["stats"]["method_stats"] == ms.to_dict()
    assert Stats.from_dict(d["stats"]) == resp.stats
    with pytest.raises(AttributeError):
        ms.not_a_statistic  # noqa: B018 (typed: a misspelled statistic is an error, not a silent None)
