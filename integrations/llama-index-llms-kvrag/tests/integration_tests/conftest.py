"""Fixtures: the real default model, loaded once per test session (no network)."""

from __future__ import annotations

import os

import pytest

from kvrag_testing import integrations

os.environ.setdefault("HF_HUB_OFFLINE", "1")

engine = integrations.engine  # the default model's engine and its loaded model, once per session
loaded = integrations.loaded


@pytest.fixture(scope="session")
def passages(engine):
    from kvrag.prompting import render_passage

    texts = [
        render_passage("The Velmora tram line T3 runs every 7 minutes on weekdays and every 12 minutes at weekends.", "Trams"),
        render_passage("A day pass in Velmora costs 9 marks and is valid until 4:00 the next morning.", "Fares"),
        render_passage("The ferry to Tamsin Isle leaves at 9:00, 11:30, 14:00 and 16:30 in summer.", "Ferries"),
    ]
    engine.ingest(texts)
    return texts
