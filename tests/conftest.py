"""Shared fixtures. The real default model is loaded once per test run (integration tests only)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model (SmolLM2-135M-Instruct), converted once into the kvrag home cache."""
    from kvrag.models import load_model

    return load_model(None)
