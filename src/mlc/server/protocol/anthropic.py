"""Bodies of Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), and their translation into a
chat completion request: system prompt, content blocks (text, tool_use, tool_result, thinking), tools and
tool_choice, stop_sequences, thinking on or off. Pure functions of the request: `tests/unit/test_api_translation.py`
checks them without a server."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from mlc.errors import InvalidRequestError, UnsupportedFeatureError
from mlc.server.protocol.responses_input import answered_call, part_text
from mlc.server.protocol.schemas import MAX_TOKENS, Strict, TopK

Blocks = str | list[dict[str, Any]]
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class CountTokensRequest(Strict):
    model: str | None = Field(None, description="The served model id (see /v1/models); default: that one.")
    messages: list[dict[str, Any]] = Field(min_length=1, max_length=1024, description=(
        "{role: user | assistant, content}: content a string or blocks: text, tool_use (assistant), tool_result "
        "(user), thinking (assistant). Images and documents are refused: this model reads text."))
    system: Blocks | None = Field(None, description="A string or text blocks.")
    tools: list[dict[str, Any]] | None = Field(None, max_length=128, description=(
        "Client tools {name, description, input_schema}; Anthropic's server tools are refused."))
    tool_choice: dict[str, Any] | None = Field(None, description="{type: auto | any | tool | none, name}.")
    thinking: dict[str, Any] | None = Field(None, description=(
        "{type: disabled} turns GLM thinking off (enable_thinking: false); enabled keeps the template's default."))
    mcp_servers: Any = Field(None, description="Not supported (only null).")
    output_config: dict[str, Any] | None = Field(None, description=(
        "{format: {type: json_schema, schema}} is enforced by constrained decoding; effort is accepted and ignored."))
    output_format: dict[str, Any] | None = Field(None, description="The older name of output_config.format.")
    cache_control: Any = Field(None, description="Accepted and ignored: the prefix cache is automatic.")
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: TopK | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    container: Any = Field(None, description="Not supported (only null).")
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]] = Field(description="Blocks: thinking, text, tool_use {id, name, input}.")
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None = None
    usage: MessageUsage


class MessageStreamEvent(BaseModel):
    """One server-sent event of /v1/messages with `stream: true` (`event: <type>` then `data: <this>`)."""

    type: Literal["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop", "ping", "error"]
    message: MessageObject | None = None
    index: int | None = None
    content_block: dict[str, Any] | None = None
    delta: dict[str, Any] | None = None
    usage: dict[str, int] | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def system_text(system: Blocks | None) -> str | None:
    return None if system is None else part_text(system, "system")


def _blocks(role: str, content: list, where: str, known: set[str]) -> list[dict]:
    texts, calls, results, thinking = [], [], [], None
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(part_text([block], at))
        elif kind == "tool_use" and role == "assistant":
            known.add(str(block.get("id")))
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": block.get("input", {})}})
        elif kind == "tool_result" and role == "user":
            text = part_text(block.get("content", ""), f"{at}.content")
            call_id = answered_call(str(block.get("tool_use_id")), known, f"{at}.tool_use_id", "tool_use block")
            results.append({"role": "tool", "tool_call_id": call_id,
                            "content": f"Error: {text}" if block.get("is_error") else text})
        elif kind == "thinking" and role == "assistant":
            thinking = block.get("thinking")
        elif kind == "redacted_thinking":
            continue
        elif kind is None:
            raise InvalidRequestError(f"{at} must be a block object with a type", field=at)
        else:
            raise UnsupportedFeatureError(f"{at}: a {kind!r} block is not supported in a {role} message; this model "
                                          "reads text, tool_use (assistant), tool_result (user) and thinking blocks",
                                          field=at)
    text = "".join(texts)
    if role == "user":
        return results + ([{"role": "user", "content": text}] if texts or not results else [])
    message: dict[str, Any] = {"role": "assistant", "content": text if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thinking is not None:
        message["reasoning_content"] = thinking
    return [message]


def chat_messages(messages: list[dict[str, Any]]) -> list[dict]:
    """Messages as chat messages: a user's tool_result blocks become tool messages (before its text), an
    assistant's tool_use blocks its tool_calls and its thinking block its reasoning_content."""
    out: list[dict] = []
    known: set[str] = set()  # tool_use ids so far
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequestError(f"{where}.role must be user or assistant (got {role!r}); put system text in "
                                      "the top-level system field", field=f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _blocks(role, content, where, known)
        else:
            raise InvalidRequestError(f"{where}.content must be a string or a list of blocks",
                                      field=f"{where}.content")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise UnsupportedFeatureError(f"tools[{i}]: Anthropic's server tool {tool['type']!r} does not run here; "
                                          "send client tools {name, description, input_schema}",
                                          field=f"tools[{i}].type")
        fn = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind in TOOL_CHOICES:
        return TOOL_CHOICES[kind], parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidRequestError(f"tool_choice.type must be auto, any, tool (with name) or none (got {kind!r})",
                              field="tool_choice.type")


def response_format(body: CountTokensRequest) -> dict | None:
    fmt = (body.output_config or {}).get("format") or body.output_format
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise InvalidRequestError('output_config.format must be {"type": "json_schema", "schema": {...}}',
                                  field="output_config.format")
    return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}


def chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    """The chat completion request (as a dict for ChatCompletionRequest) that runs `body`."""
    if body.mcp_servers is not None:
        raise UnsupportedFeatureError("mcp_servers is not supported; connect MCP tools in the client and send them "
                                      "as tools", field="mcp_servers")
    system = system_text(body.system)
    messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(body.messages)
    choice, parallel = chat_tool_choice(body.tool_choice)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "tools": chat_tools(body.tools),
                              "tool_choice": choice, "parallel_tool_calls": parallel,
                              "response_format": response_format(body)}
    if (body.thinking or {}).get("type") != "enabled":  # Anthropic's API thinks only when asked to
        fields["chat_template_kwargs"] = {"enable_thinking": False}
    if isinstance(body, MessagesRequest):
        if body.container is not None:
            raise UnsupportedFeatureError("container is not supported: no code execution here", field="container")
        fields.update(max_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    return {k: v for k, v in fields.items() if v is not None}

