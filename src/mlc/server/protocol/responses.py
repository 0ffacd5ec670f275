"""Bodies of OpenAI's Responses API (`/v1/responses`), as the published spec names them.

The request takes every top-level field of the spec's CreateResponse. `input` items and `tools` are checked item by
item when they are translated to a chat request (`responses_input.py`), so an error names the item and says what
to send instead; the fields that ask for what cannot run here (background mode, server-side conversations, prompt
templates, hosted tools) are refused there with a 400 that names them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from mlc.server.protocol.schemas import MAX_PROMPT_CHARS, MAX_TOKENS, Strict, Temperature, TopP

InputField = Field(None, description=(
    "A string (one user message) or a list of items: messages {role, content} (content a string or input_text / "
    "output_text parts), function_call {call_id, name, arguments}, function_call_output {call_id, output} and "
    "reasoning items from an earlier response."))


class ResponsesInput(Strict):
    """What makes a conversation: shared by /v1/responses and /v1/responses/input_tokens."""

    model: str | None = Field(None, description="The served model id (see /v1/models); default: that one.")
    input: str | list[dict[str, Any]] | None = InputField
    instructions: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description=(
        "A system message put first; not carried over by previous_response_id."))
    previous_response_id: str | None = Field(None, max_length=256, description=(
        "Continue a stored response (store: true): its conversation and output come before this input."))
    tools: list[dict[str, Any]] | None = Field(None, max_length=128, description=(
        "Function tools {type: function, name, description, parameters, strict}; hosted tools are refused."))
    tool_choice: str | dict[str, Any] | None = Field(None, description=(
        "none, auto, required or {type: function, name}."))
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description=(
        "{format: {type: text | json_object | json_schema, name, schema, strict}}: json_schema and json_object are "
        "enforced by constrained decoding; verbosity is accepted and ignored."))
    reasoning: dict[str, Any] | None = Field(None, description=(
        "{effort}: none turns GLM thinking off (enable_thinking: false); other efforts leave the template's "
        "default. summary is accepted; reasoning comes back whole as reasoning_text."))
    truncation: Literal["auto", "disabled"] | None = None
    conversation: Any = Field(None, description="Not supported (only null): use previous_response_id.")
    personality: Any = None


class CreateResponseRequest(ResponsesInput):
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = Field(True, description=(
        "Keep the response in this server's memory (bounded, oldest first out) for GET and previous_response_id."))
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Only 0 or null: logprobs are not returned.")
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: Any = None
    service_tier: str | None = None
    background: bool | None = Field(None, description="Only false or null: responses run in the foreground here.")
    max_tool_calls: int | None = Field(None, ge=0)
    prompt: Any = Field(None, description="Not supported (only null): prompt templates live on OpenAI's platform.")
    moderation: Any = None
    context_management: Any = None


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "incomplete", "in_progress", "cancelled", "failed"]
    model: str
    output: list[dict[str, Any]] = Field(description=(
        "Items: reasoning {content: [reasoning_text]}, message {content: [output_text]}, function_call "
        "{call_id, name, arguments}."))
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None


class ResponseStreamEvent(BaseModel):
    """One server-sent event of /v1/responses with `stream: true` (`event: <type>` then `data: <this>`)."""

    type: str = Field(description="response.created, response.in_progress, response.output_item.added, "
                      "response.content_part.added, response.output_text.delta / .done, "
                      "response.reasoning_text.delta / .done, response.function_call_arguments.delta / .done, "
                      "response.content_part.done, response.output_item.done, response.completed, error.")
    sequence_number: int
    response: ResponseObject | None = None
    item: dict[str, Any] | None = None
    part: dict[str, Any] | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputTokensResponse(BaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]] = Field(description="The response's input items (messages, function calls and "
                                       "their outputs, reasoning), each with an id.")
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None
