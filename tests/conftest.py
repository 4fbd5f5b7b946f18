"""Shared fixtures. The real default model is loaded once per test run (integration tests only)."""

from __future__ import annotations

import collections
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


def _default_model_in(dtype: Any, quantize: str | None = "default") -> Any:
    """The embedded default model (SmolLM2-135M-Instruct) in ``dtype`` with ``quantize`` weights ("default": what
    kvrag picks on this machine), loaded once per (dtype, quantize) per test run."""
    from kvrag.models import load_model

    if (dtype, quantize) not in _MODELS:
        _MODELS[dtype, quantize] = load_model(None, dtype=dtype, quantize=quantize)
    return _MODELS[dtype, quantize]


@pytest.fixture(scope="session")
def default_model():
    """The embedded default model as a user gets it here: the test dtype (float32, or ``$KVRAG_TEST_DTYPE``,
    :func:`kvrag_testing.equivalence.test_dtype`) with this machine's default weights (int4 on CPUs with native
    bf16, dense elsewhere). Tests that assert float32-exact results use ``default_model_fp32``; the bf16 and int4
    equivalence subsets use the pinned fixtures."""
    from kvrag_testing.equivalence import test_dtype

    return _default_model_in(test_dtype())


@pytest.fixture(scope="session")
def default_model_fp32():
    """The embedded default model pinned to float32 with dense weights (the exact oracle)."""
    import torch

    return _default_model_in(torch.float32, None)


@pytest.fixture(scope="session")
def default_model_bf16():
    """The embedded default model pinned to bfloat16, dense weights (slow where the CPU has no native bf16: keep
    prompts short)."""
    import torch

    return _default_model_in(torch.bfloat16, None)


@pytest.fixture(scope="session")
def default_model_int4():
    """The embedded default model with int4 weights (kvrag.kv.quant) in the test dtype, on every machine."""
    from kvrag_testing.equivalence import test_dtype

    return _default_model_in(test_dtype(), "int4")


def _new_redis_server() -> Any:
    pytest.importorskip("redis", reason="redis-py not installed (pip install 'kvrag[redis]')")
    from kvrag_testing.redis_server import RedisServer

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
    from kvrag_testing.redis_server import RedisCluster

    try:
        cluster = RedisCluster(masters=3)
    except FileNotFoundError as e:  # no redis-server / redis-cli binary (.ci/run installs both)
        pytest.skip(str(e))
    with cluster:
        yield cluster


#: Skip reasons that mean a real component the suite starts itself is missing on this machine (not an optional
#: Python package: `make test` installs those) -> the component and the command that makes those tests run. As root
#: with apt, `make test` installs redis-server itself (.ci/install-redis).
REAL_COMPONENT_SKIPS = {
    "redis-server binary not found": ("redis-server", "sudo apt-get install redis-server && make test"),
    "redis-cli binary not found": ("redis-server", "sudo apt-get install redis-server && make test"),
}


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: Any) -> None:
    """Under pytest-xdist (``make test``) turn off the ``benchmark`` fixture's timing (langchain-tests' standard
    tests use it) explicitly: timings taken beside another worker mean nothing, and pytest-benchmark would say so
    in a warning at the end of every run."""
    if config.pluginmanager.hasplugin("benchmark") and (
            config.getoption("dist", "no") != "no" or os.environ.get("PYTEST_XDIST_WORKER")):
        config.option.benchmark_disable = True


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """One line naming the real-component tests that were skipped (e.g. Redis without ``redis-server``) and the
    command that enables them: under ``-q`` a skip is otherwise only a number in the final count."""
    by_file: collections.Counter[str] = collections.Counter()
    missing: dict[tuple[str, str], None] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        found = next((v for needle, v in REAL_COMPONENT_SKIPS.items() if needle in reason), None)
        if found is not None:
            by_file[report.nodeid.split("::")[0]] += 1
            missing[found] = None
    if by_file:
        files = ", ".join(f"{f} ({n})" for f, n in sorted(by_file.items()))
        what = ", ".join(dict.fromkeys(c for c, _ in missing))
        how = " ; ".join(dict.fromkeys(cmd for _, cmd in missing))
        terminalreporter.write_line(f"skipped {sum(by_file.values())} real-component tests (no {what} on this "
                                    f"machine): {files}; to run them: {how}", yellow=True)
