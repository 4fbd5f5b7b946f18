"""How kvrag reads a GGUF file through transformers: each file parsed once per conversion, and quietly.

Converting a GGUF file takes four transformers calls (config, tokenizer, model, the quantizer's state dict), and
each builds its own ``gguf.GGUFReader`` of the file; the reader parses every header field into numpy views, which
for a 49K-token vocabulary dominates a conversion. transformers also builds ``gguf``'s tensor-name map once per
module of the model (SmolLM2-135M: 397 maps). Inside :func:`parsed_once` every reader of the same
file is the same (read-only) object and the name map of an (architecture, layer count) is built once, so a
conversion parses the file once; outside it both are what the ``gguf`` package gives.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import MODEL_ARCH, GGUFReader

_memo: contextvars.ContextVar[dict[tuple[object, ...], object] | None] = contextvars.ContextVar("kvrag_gguf_memo",
                                                                                               default=None)
_lock = threading.Lock()
_installed: list[tuple[str, object]] = []  # the gguf attributes replaced while any parsed_once() is open
_depth = 0


def _shared_reader_class(base: type) -> type:
    class SharedReader(base):  # type: ignore[misc, valid-type]
        """``gguf.GGUFReader`` that, inside :func:`parsed_once`, returns the one reader of each file."""

        def __new__(cls, path: str | os.PathLike[str], mode: str = "r") -> Any:
            memo = _memo.get()
            if memo is None:  # not in a conversion: a plain reader (its own __init__ has run)
                return base(path, mode)
            key = ("reader", os.path.realpath(os.fspath(path)), mode)
            if key not in memo:
                reader = object.__new__(cls)
                base.__init__(reader, path, mode)  # type: ignore[misc]
                memo[key] = reader
            return memo[key]

        def __init__(self, path: str | os.PathLike[str], mode: str = "r") -> None:  # initialised once, in __new__
            pass

    return SharedReader


def _shared_name_map(original: Callable[[MODEL_ARCH, int], object]) -> Callable[[MODEL_ARCH, int], object]:
    @functools.wraps(original)
    def get_tensor_name_map(arch: MODEL_ARCH, n_blocks: int) -> object:
        memo = _memo.get()
        if memo is None:
            return original(arch, n_blocks)
        key = ("names", arch, n_blocks)
        if key not in memo:
            memo[key] = original(arch, n_blocks)
        return memo[key]

    return get_tensor_name_map


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """While open (in this context: thread or task), each GGUF file is parsed once and shared by every reader."""
    global _depth
    import gguf

    token = _memo.set({})
    with _lock:
        if _depth == 0:
            replaced = {"GGUFReader": _shared_reader_class(gguf.GGUFReader),
                        "get_tensor_name_map": _shared_name_map(gguf.get_tensor_name_map)}
            for name, new in replaced.items():
                _installed.append((name, getattr(gguf, name)))
                setattr(gguf, name, new)
        _depth += 1
    try:
        yield
    finally:
        _memo.reset(token)
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _installed:
                    name, original = _installed.pop()
                    setattr(gguf, name, original)


def header_field(reader: GGUFReader, key: str) -> object:
    """A GGUF header field's value (None when the file has no such key)."""
    field = reader.fields.get(key)
    return None if field is None else field.contents()


@contextlib.contextmanager
def quiet_gguf_bar() -> Iterator[None]:
    """Disable the raw tqdm bar transformers' GGUF reader shows regardless of its progress-bar setting."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # layout of another transformers version: keep its bar
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


__all__ = ["header_field", "parsed_once", "quiet_gguf_bar"]
