"""Shared fixtures. The real default model is loaded once per test run (integration tests only)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): tiny
    models and the per-layer executors run several times faster without thread syncs per small kernel, more so on
    a busy 2-core box."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


_MODELS: dict[Any, Any] = {}


def _default_model_in(dtype: Any) -> Any:
    """The embedded default model (SmolLM2-135M-Instruct) in ``dtype``, loaded once per dtype per test run."""
    from kvrag.models import load_model

    if dtype not in _MODELS:
        _MODELS[dtype] = load_model(None, dtype=dtype)
    return _MODELS[dtype]


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model in the test dtype: float32, or ``$KVRAG_TEST_DTYPE``
    (:func:`kvrag.testing.equivalence.test_dtype`). Tests that assert float32-exact results use
    ``default_model_fp32``; the bf16 equivalence subset uses both pinned fixtures."""
    from kvrag.testing.equivalence import test_dtype

    return _default_model_in(test_dtype())


@pytest.fixture(scope="session")
def default_model_fp32():
    """The embedded default model pinned to float32 (the exact oracle)."""
    import torch

    return _default_model_in(torch.float32)


@pytest.fixture(scope="session")
def default_model_bf16():
    """The embedded default model pinned to bfloat16 (slow where the CPU has no native bf16: keep prompts short)."""
    import torch

    return _default_model_in(torch.bfloat16)


def _new_redis_server() -> Any:
    pytest.importorskip("redis", reason="redis-py not installed (pip install 'kvrag[redis]')")
    from kvrag.testing.redis_server import RedisServer

    try:
        return RedisServer()
    except FileNotFoundError as e:  # no redis-server binary (.ci/run installs one)
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[Any]:
    """A real loopback redis-server, running for the module."""
    with _new_redis_server() as srv:
        yield srv


@pytest.fixture
def redis_server() -> Iterator[Any]:
    """A real redis-server the test starts, kills and restarts itself (not started yet)."""
    srv = _new_redis_server()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[Any]:
    """A real 3-master Redis Cluster on loopback, running for the module (skips without redis-server/redis-cli)."""
    pytest.importorskip("redis", reason="redis-py not installed (pip install 'kvrag[redis]')")
    from kvrag.testing.redis_server import RedisCluster

    try:
        cluster = RedisCluster(masters=3)
    except FileNotFoundError as e:  # no redis-server / redis-cli binary (.ci/run installs both)
        pytest.skip(str(e))
    with cluster:
        yield cluster
