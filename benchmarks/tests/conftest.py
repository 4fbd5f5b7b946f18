"""kvrag-bench tests: tiny random models only (seconds); no network, no data outside the repository."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
