"""Fixtures: the real default model and embedder, loaded once per session (no network)."""

from __future__ import annotations

import pytest
from lc_testutil import get_engine, get_vectorstore


@pytest.fixture(scope="session")
def engine():
    return get_engine()


@pytest.fixture(scope="session")
def vectorstore():
    return get_vectorstore()
