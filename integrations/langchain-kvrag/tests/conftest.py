"""langchain-kvrag tests: unit_tests/ (a tiny random model, seconds) and integration_tests/ (the real default model).

This directory is on ``sys.path`` for both tiers (pytest's rootdir-less conftest import), so they share
:mod:`lc_standard`.
"""

from __future__ import annotations

import inspect
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
