"""Fields of OpenAI's published chat request (openai/openai-openapi, vendored in tests/support/openai-openapi) that
ask for something beyond sampling: OpenAI-side services (storage, moderation, web search, audio output), hints
(verbosity, prompt caching), tenants (user, safety_identifier, service_tier), reasoning and the legacy function
calling fields. Every one is accepted, null included; the route honours, records, ignores or refuses each one as
the README's field table says (`unsupported_capability` names the refused ones).

`NULL` marks a field that OpenAI's spec lets be null: null means the field's default, and /openapi.json says so.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, GetJsonSchemaHandler, model_validator

from mlc.engine.sampling_params import MAX_BIAS
from mlc.server.protocol.schemas_agent import FunctionDef, Strict


class OrNull:
    """Annotation: null is accepted and means the field's default (`NullableFields` drops it before validation, so
    the type after validation has no None); /openapi.json shows the field as nullable."""

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> dict:
        return {"anyOf": [handler(schema), {"type": "null"}]}


NULL = OrNull()


class NullableFields(Strict):
    """A body whose NULL fields given as null take their defaults."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields or NULL not in cls.model_fields[k].metadata}
# A logit_bias key is a token id written as a string (JSON object keys are strings).
TokenKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]
LogitBias = Annotated[dict[TokenKey, Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]] | None, Field(
    None, max_length=1024, description=(
        "Token id (as a string) -> a bias from -100 to 100 added to its logit before sampling: -100 bans the "
        "token (applied as -inf), +100 all but forces it. Ids must be below the vocabulary size."))]
THINKING_OFF = ("none", "minimal")  # reasoning_effort values that turn GLM thinking off
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class PromptCacheOptions(Strict):
    ttl: Literal["30m"] | None = None
    mode: Literal["implicit", "explicit"] | None = None


class AudioOutput(Strict):
    voice: str | dict[str, Any]
    format: Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]


class TextPart(Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None


class Prediction(Strict):
    type: Literal["content"]
    content: str | Annotated[list[TextPart], Field(min_length=1)]


class FunctionName(Strict):
    name: str = Field(max_length=64)


class OpenAIServiceFields(NullableFields):
    """What a chat request may ask of OpenAI's service beyond the model's reply; see the README's field table."""

    store: Annotated[bool, NULL] = Field(False, description="Accepted; mlc stores no completions.")
    metadata: dict[str, str] | None = Field(None, description="Accepted; kept nowhere (nothing is stored).")
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = Field(None, description=(
        "Recorded in the audit log; mlc has one tier (no priority scheduling)."))
    safety_identifier: str | None = Field(None, max_length=64, description="Recorded in the audit log.")
    prompt_cache_key: str | None = Field(None, max_length=1024, description=(
        "On a Ray deployment (mlc-cli deploy), the prefix-affinity routing key: requests with the same key go to "
        "the same replica. The prefix cache itself is automatic."))
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description=(
        "Accepted; the prefix cache keeps pages while memory allows (LRU), whatever is asked."))
    prompt_cache_options: PromptCacheOptions | None = Field(None, description="Accepted and ignored, as above.")
    reasoning_effort: ReasoningEffort | None = Field(None, description=(
        "GLM thinking: none or minimal turns it off, the others on (the chat template's enable_thinking, for "
        "templates that have it; chat_template_kwargs.enable_thinking wins). Other templates ignore it."))
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Accepted and ignored.")
    modalities: list[Literal["text", "audio"]] | None = Field(None, description=(
        "[\"text\"] or null; audio output is a 400 (this model writes text)."))
    audio: AudioOutput | None = Field(None, description="Only null: audio output is a 400 (this model writes text).")
    prediction: Prediction | None = Field(None, description=(
        "Predicted output: its tokens are a draft source for speculative decoding (prompt lookup), every draft "
        "verified, so the output is the same with or without it; only faster where the reply repeats it."))
    web_search_options: dict[str, Any] | None = Field(None, description=(
        "Only null: web search is a 400 (the server has no search tool)."))
    moderation: dict[str, Any] | None = Field(None, description="Only null: moderation is a 400 (none is run).")
    functions: Annotated[list[FunctionDef], Field(min_length=1, max_length=128)] | None = Field(None, description=(
        "Deprecated by OpenAI: tools of type function. The reply carries message.function_call and finish_reason "
        "function_call, as OpenAI's legacy API does."))
    function_call: Literal["none", "auto"] | FunctionName | None = Field(None, description=(
        "Deprecated by OpenAI: tool_choice for `functions` (none, auto or {\"name\": ...})."))


def unsupported_capability(body: OpenAIServiceFields) -> tuple[str, str] | None:
    """(field, why) for a request asking for what this server cannot do; None when it asks for nothing of that."""
    if body.modalities and "audio" in body.modalities:
        return "modalities", "audio output is not available: this model writes text; send [\"text\"] or omit it"
    if body.audio is not None:
        return "audio", "audio output is not available: this model writes text; send null or omit it"
    if body.web_search_options is not None:
        return "web_search_options", ("web search is not available: this server has no search tool; give the model "
                                      "a function tool that searches instead")
    if body.moderation is not None:
        return "moderation", "moderation is not available on this server; send null or omit it"
    return None
