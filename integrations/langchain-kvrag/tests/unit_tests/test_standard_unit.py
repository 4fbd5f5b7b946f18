"""langchain-tests unit standard suite for ChatKVCached (construction, serialization, parameters: no model runs).

langchain-tests 1.1 has no unit suite for retrievers; KVCacheRetriever's run in ../integration_tests.
"""

from __future__ import annotations

from typing import Any

from langchain_tests.unit_tests import ChatModelUnitTests
from lc_standard import Capabilities


class TestChatKVCachedUnit(Capabilities, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2-135m-instruct"}  # the engine loads lazily: constructing needs no model

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        """The suite's standard parameters minus ``api_key``, which it adds for hosted APIs: a local model takes no
        credentials, and ChatKVCached forbids unknown fields (the other standard ones, incl. timeout and
        max_retries, it accepts)."""
        params = dict(super().standard_chat_model_params)
        params.pop("api_key", None)
        return params
