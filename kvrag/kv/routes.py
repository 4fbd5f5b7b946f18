"""Which products a forward's linear layers take: the decode products (quantized or packed weights, for inputs of
a few rows: :data:`kvrag.kv.quant.MAX_ROWS`, :data:`kvrag.kv.linear.MAX_ROWS`) or the dense ones.

Each product picks its route by its row count, so a short forward's rows get other bits than the same rows inside a
longer one. A chunk's or prompt prefix's cache must not depend on that: it is made alone (prefix + chunk in one
forward), in a batch of chunks (:func:`kvrag.engine.ingest_prefill.compute_chunk_kvs`, the prefix shared) or by
another replica, and every way must give the same bits. :func:`dense_products` makes every product of the calling
thread take the dense route while it is open, whatever its rows; the forwards that compute caches run inside it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class _Route(threading.local):
    dense = False  # read by every product of every decode step: a plain attribute


ROUTE = _Route()
"""This thread's route: ``ROUTE.dense`` True inside :func:`dense_products`."""


@contextlib.contextmanager
def dense_products() -> Iterator[None]:
    """Every product of this thread takes the dense route until the block ends (nests)."""
    before = ROUTE.dense
    ROUTE.dense = True
    try:
        yield
    finally:
        ROUTE.dense = before


__all__ = ["ROUTE", "dense_products"]
