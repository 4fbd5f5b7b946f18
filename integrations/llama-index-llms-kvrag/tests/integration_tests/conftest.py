"""Fixtures: the real default model, loaded once per test session (no network)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def engine():
    """One engine per process (shared by every test directory of a run): default model + memory store."""
    from kvrag.adapters import shared_engine

    return shared_engine(None, "memory://")


@pytest.fixture(scope="session")
def loaded(engine):
    return engine.loaded



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
