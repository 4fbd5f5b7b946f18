"""kvrag.threads: one thread's own torch intra-op count, nobody else's changed."""

from __future__ import annotations

import threading

import pytest
import torch

from kvrag import threads
from kvrag.threads import set_own_threads


def _in_thread(fn) -> list[int]:  # type: ignore[no-untyped-def]
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out


def test_a_thread_sets_its_own_count_only() -> None:
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        def own() -> int:
            set_own_threads(3)
            return torch.get_num_threads()

        assert _in_thread(own) == [3]
        assert torch.get_num_threads() == 1  # the caller's
        assert _in_thread(torch.get_num_threads) == [1]  # a thread started afterwards gets torch's default
        with pytest.raises(ValueError, match="at least one intra-op thread"):
            set_own_threads(0)
    finally:
        torch.set_num_threads(saved)


def test_another_openmp_runtime_in_the_process_is_not_mistaken_for_torchs() -> None:
    pytest.importorskip("faiss")  # faiss's wheel brings its own libgomp, which /proc/self/maps can list first
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch does not run on OpenMP here")
    threads._openmp.cache_clear()  # look the runtime up again, now with faiss's loaded
    test_a_thread_sets_its_own_count_only()


def test_a_negative_thread_option_is_a_clear_error() -> None:
    """``--threads -2`` on calibrate / bench / train-repairer: an error naming the option, not torch's RuntimeError."""
    from kvrag.errors import ConfigError
    from kvrag.threads import set_torch_threads

    saved = torch.get_num_threads()
    with pytest.raises(ConfigError, match=r"--threads must be a positive number of threads, got -2"):
        set_torch_threads(-2)
    set_torch_threads(None)
    set_torch_threads(0)
    assert torch.get_num_threads() == saved  # None and 0 leave torch's count
