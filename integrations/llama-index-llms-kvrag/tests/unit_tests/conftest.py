"""Fixtures: a tiny random model wrapped into an engine (no real model: seconds) and three cached passages."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine():
    from kvrag_testing.tiny import tiny_engine

    return tiny_engine("qwen2")


@pytest.fixture(scope="module")
def passages(engine):
    from kvrag.prompting import render_passage

    texts = [render_passage("Tram line T3 runs every 7 minutes on weekdays.", "Trams"),
             render_passage("A day pass costs 9 marks.", "Fares"),
             render_passage("The ferry leaves at 9:00 and 11:30.", "Ferries")]
    engine.ingest(texts)
    return texts
