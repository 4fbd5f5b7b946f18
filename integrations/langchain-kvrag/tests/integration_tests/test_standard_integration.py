"""langchain-tests integration standard suites for ChatKVCached and KVCacheRetriever (real model, short
generations)."""

from __future__ import annotations

from typing import Any

from langchain_kvrag import KVCacheRetriever
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from lc_standard import Capabilities
from lc_testutil import get_engine, get_vectorstore


class TestChatKVCachedIntegration(Capabilities, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": get_engine(), "max_tokens": 12}


class TestKVCacheRetriever(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[KVCacheRetriever]:
        return KVCacheRetriever

    @property
    def retriever_constructor_params(self) -> dict[str, Any]:
        return {"retriever": get_vectorstore().as_retriever(), "engine": get_engine(), "k": 2}

    @property
    def retriever_query_example(self) -> str:
        return "How much does a day pass cost?"
