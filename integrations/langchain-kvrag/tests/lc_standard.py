"""What ChatKVCached supports, for the langchain-tests standard suites (unit and integration)."""

from __future__ import annotations

from langchain_kvrag import ChatKVCached


class Capabilities:
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
