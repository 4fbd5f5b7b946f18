"""Fixtures: the real default model and embedder, loaded once per session (no network)."""

from __future__ import annotations

import inspect

import pytest
from lc_testutil import get_engine, get_vectorstore


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Mark this directory's async tests (langchain-tests has many) for pytest-asyncio in any asyncio mode.

    Runs inside pytest-asyncio's own wrapper, so the marker is there when it converts coroutine tests.
    """
    outcome = yield
    result = outcome.get_result()
    items = result if isinstance(result, list) else [result]
    for item in items:
        fn = getattr(item, "obj", None)
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(fn):
            item.add_marker(pytest.mark.asyncio)


@pytest.fixture(scope="session")
def engine():
    return get_engine()


@pytest.fixture(scope="session")
def vectorstore():
    return get_vectorstore()
