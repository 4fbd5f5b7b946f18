"""langchain-tests standard suites for ChatKVCached and KVCacheRetriever (real model, short generations)."""

from __future__ import annotations

from typing import Any

from langchain_kvrag import ChatKVCached, KVCacheRetriever
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from lc_testutil import get_engine, get_vectorstore


class _Capabilities:
    """What a local text-only chat model supports; the suites skip the tests of the rest."""

    @property
    def chat_model_class(self) -> type[ChatKVCached]:
        return ChatKVCached

    @property
    def has_tool_calling(self) -> bool:
        return False  # no tool calling: tool tests are skipped

    @property
    def has_tool_choice(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False  # no with_structured_output: structured-output tests are skipped

    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False  # text-only model

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_video_inputs(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        return False

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[str]]:
        return {"invoke": [], "stream": []}

    @property
    def enable_vcr_tests(self) -> bool:
        return False  # local model: nothing to record


class TestChatKVCachedUnit(_Capabilities, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2-135m-instruct"}  # the engine loads lazily: constructing needs no model


class TestChatKVCachedIntegration(_Capabilities, ChatModelIntegrationTests):
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
