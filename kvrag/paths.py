"""kvrag's data directory and the offline switch for loading local Hugging Face checkpoints."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def kvrag_home() -> Path:
    """Return kvrag's data directory: ``$KVRAG_HOME`` if set, else ``~/.cache/kvrag``."""
    env = os.environ.get("KVRAG_HOME")
    return Path(env).expanduser() if env else Path("~/.cache/kvrag").expanduser()


@contextlib.contextmanager
def hf_offline() -> Iterator[None]:
    """Temporarily set ``HF_HUB_OFFLINE=1`` while loading a local model (restored afterwards).

    Loads inside also pass ``local_files_only=True``, which is what actually prevents downloads once
    ``huggingface_hub`` has read its environment; the variable covers code paths that consult it directly.
    """
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def env_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value (only locally cached Hub models can be loaded)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


__all__ = ["env_offline", "hf_offline", "kvrag_home"]
