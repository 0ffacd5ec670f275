"""Request and response bodies. Limits live on the fields so /openapi.json says what the server accepts.

Requests are strict (a number sent as a string is refused, not coerced) and forbid unknown fields, so a typo such
as `max_token` is a 400 that names it instead of a silently ignored option.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from mlc.server.protocol.schemas_agent import (
    FunctionCallIn,
    FunctionCallOut,
    StructuredFields,
    ToolCallIn,
    ToolCallOut,
    ToolChoice,
    ToolDef,
)
from mlc.server.protocol.schemas_openai import NULL, LogitBias, NullableFields, OpenAIServiceFields

MAX_PROMPT_CHARS = 1_000_000
MAX_SEED = 2**63 - 1
MAX_TOKENS = 2**20  # no served model has a longer context; the real bound is the server's (/v1/models max_model_len)
MAX_VOCAB = 2**20  # bounds top_k in the schema; the server checks it against the model's vocabulary


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def only(schema: dict, why: str):
    """Document the one value the server accepts for an OpenAI field it parses only to refuse with a clear 400."""
    return WithJsonSchema({**schema, "description": why})


StopField = Annotated[
    str | Annotated[list[str], Field(max_length=16)] | None,
    Field(None, description="Stop string(s); generation ends before the first one, which is not returned."),
]
Temperature = Annotated[float, Field(ge=0.0, le=2.0, description="0 is greedy decoding.")]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int | None, Field(None, ge=1 - 2**64, le=2**64 - 1, description=(
    "Same seed, same request: same output. Any 64-bit integer, taken modulo 2**63.")),
    AfterValidator(lambda v: None if v is None else v % (MAX_SEED + 1))]
ContextLength = Annotated[int | None, Field(
    None, ge=1, le=MAX_TOKENS, description="mlc: bound prompt + completion to this many tokens (at most the server's "
    "limit). Not together with context_profile.")]
ContextProfile = Annotated[str | None, Field(
    None, max_length=64, description="mlc: a named context limit configured on the server (e.g. qa, legal). Not "
    "together with context_length.")]
TopK = Annotated[int, Field(ge=-1, le=MAX_VOCAB, description="mlc: keep the k most likely tokens; 0 or -1 is off. "
                            "At most the model's vocabulary size.")]
TokenId = Annotated[int, Field(ge=0, description="Below the model's vocabulary size (checked by the server).")]


# errors, usage
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FullKV = Annotated[bool, Field(description="mlc: keep this request's whole KV cache when the server runs sparse KV.")]
Speculative = Annotated[bool, Field(description="mlc: false never drafts for this request, even when the server runs "
                                                "speculative decoding (the output is the same either way).")]


class StreamOptions(NullableFields):
    include_usage: Annotated[bool, NULL] = False
    include_obfuscation: bool | None = Field(None, description="Accepted and ignored (no obfuscation padding).")


class EngineExtensions(Strict):
    """Sampling options beyond OpenAI's (vLLM names), plus the context bound."""

    top_k: TopK = 0
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS, description="At most the completion's length (max_tokens).")
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=64,
                                          description="Token ids that end generation, each below the vocabulary size.")
    include_stop_str_in_output: bool = False
    full_kv: FullKV = False
    speculative: Speculative = True
    context_length: ContextLength
    context_profile: ContextProfile


# native API (/generate, the reference tutorial's)
class GenerateRequest(Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_new_tokens": 8, "temperature": 0}]})

    prompt: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description=(
        "Default: the server's default_max_tokens. Prompt + max_new_tokens must fit the context."))
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop: StopField
    seed: Seed
    stream: bool = Field(False, description="Send server-sent events: one per step, the last with usage.")
    full_kv: FullKV = False
    speculative: Speculative = True
    context_length: ContextLength
    context_profile: ContextProfile


class GenerateResponse(BaseModel):
    id: str
    text: str
    tokens: list[int] = Field(description="Generated token ids.")
    finish_reason: str = Field(description="stop, length, timeout (--request-timeout) or abort (server shutdown).")
    usage: Usage
    latency_ms: float
    ttft_ms: float | None = None
    stripped_chars: int = Field(0, description="Invisible characters removed from the prompt.")


class GenerateEvent(BaseModel):
    """One server-sent event of /generate with `stream: true`; the last one adds text, usage and timings."""

    id: str
    delta: str
    tokens: list[int]
    finish_reason: str | None = None
    text: str | None = None
    usage: Usage | None = None
    ttft_ms: float | None = None
    latency_ms: float | None = None


# OpenAI-compatible
class OpenAIRequest(EngineExtensions, NullableFields):
    """Fields of OpenAI's spec that OpenAI allows to be null are NULL here: null means the default."""

    model: str | None = Field(None, description="The served model id (see /v1/models); default: that one.")
    temperature: Annotated[Temperature, NULL] = 1.0
    top_p: Annotated[float, Field(ge=0.0, le=1.0, description="0 keeps only the most likely token (greedy)."),
                     NULL] = 1.0
    n: Annotated[int, Field(ge=1, le=64, description="At most 64."), NULL] = 1
    stream: Annotated[bool, NULL] = False
    stream_options: StreamOptions | None = None
    stop: StopField
    presence_penalty: Annotated[Penalty, NULL] = 0.0
    frequency_penalty: Annotated[Penalty, NULL] = 0.0
    seed: Seed
    logit_bias: LogitBias
    user: str | None = Field(None, max_length=256, description="Recorded in the audit log.")


TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_CHARS)]


PromptText = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]


class CompletionRequest(OpenAIRequest, StructuredFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
        {"prompt": ["The sky is", "Two plus two is"], "max_tokens": 4, "logprobs": 2}]})

    prompt: (
        PromptText
        | Annotated[list[PromptText], Field(min_length=1, max_length=64)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=64)]
    ) = Field(description="A string, a list of strings, a list of token ids or a list of lists of token ids (each "
                          "below the vocabulary size); text must not be empty once invisible characters are "
                          "removed. Several prompts cannot be streamed.")
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description="Prompt + max_tokens must fit the context.")
    logprobs: int | None = Field(None, ge=0, le=20, description=(
        "With echo, the prompt tokens' logprobs come first (the first token has none); their top_logprobs hold "
        "the prompt token only, as the engine scores the given token."))
    echo: Annotated[bool, NULL] = False
    best_of: int | None = Field(None, ge=1, le=64, description="Only best_of == n is supported.")
    suffix: Annotated[str | None, only({"type": "null"}, "Not supported; only null is accepted.")] = None


class ContentPart(Strict):
    model_config = ConfigDict(json_schema_extra={"required": ["type"]})

    type: Annotated[str, only({"enum": ["text", "refusal"]}, "Text parts (an assistant's refusal too): this model "
                                                                "reads text.")]
    text: Annotated[str | None, WithJsonSchema({"type": "string", "maxLength": MAX_PROMPT_CHARS})] = Field(
        None, max_length=MAX_PROMPT_CHARS)
    refusal: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    prompt_cache_breakpoint: dict[str, Any] | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(description=(
        "function: OpenAI's deprecated tool result (a tool message with the function's name)."))
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[ContentPart] | None = Field(None, description=(
        "Text, or parts of type text; only an assistant message with tool_calls may go without. Some message needs "
        "text, and the last user message must not be empty."))
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=128, description="An assistant's earlier calls.")
    tool_call_id: str | None = Field(None, max_length=256, description=(
        "For role tool: the id of the call this answers (one of an earlier assistant message's tool_calls)."))
    reasoning_content: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description=(
        "An assistant's earlier reasoning, for templates that show it (GLM-4.5+ keep it after the last user turn)."))
    refusal: str | None = Field(None, max_length=MAX_PROMPT_CHARS, description=(
        "An assistant's earlier refusal: its text, where content is null."))
    function_call: FunctionCallIn | None = Field(None, description="An assistant's earlier legacy call (one).")
    annotations: list[Any] | None = Field(None, description="Accepted and ignored (OpenAI's url citations).")
    audio: dict[str, Any] | None = Field(None, description="Accepted and ignored (an earlier audio reply's id).")

    @property
    def calls(self) -> list[ToolCallIn] | None:
        """tool_calls, or the legacy function_call as the one call."""
        if self.tool_calls or self.function_call is None:
            return self.tool_calls
        return [ToolCallIn(function=self.function_call)]


class ChatCompletionRequest(OpenAIRequest, StructuredFields, OpenAIServiceFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Say hello in French."}], "max_tokens": 8},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
         "max_completion_tokens": 4, "stream": True}]})

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description=(
        "Deprecated by OpenAI: send max_completion_tokens. If both are given they must be equal."))
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS, description=(
        "Prompt + completion must fit the context."))
    logprobs: Annotated[bool, NULL] = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Needs logprobs: true.")
    tools: list[ToolDef] | None = Field(None, max_length=128, description=(
        "Functions the model may call; rendered by the model's chat template (or, for a template that knows no "
        "tools, as a system message in the hermes format)."))
    tool_choice: ToolChoice
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call per reply.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=(
        "Extra variables for the chat template, e.g. {\"enable_thinking\": false} for GLM-4.5+."))


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = Field(None, description="stop, length, timeout or abort.")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    stripped_chars: int = 0


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None
    refusal: None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    reasoning_content: str | None = Field(None, description="The model's reasoning (GLM-4.5+ <think>), apart.")
    tool_calls: list[ToolCallOut] | None = Field(None, exclude_if=lambda v: v is None)
    function_call: FunctionCallOut | None = Field(None, exclude_if=lambda v: v is None, description=(
        "The call, for a request with the legacy functions (then tool_calls is absent)."))


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    stripped_chars: int = 0


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, description=(
        "Each {index, id, type, function: {name, arguments}}: a call is sent whole once it has parsed."))
    function_call: dict[str, Any] | None = Field(None, description="{name, arguments}: the legacy functions' call.")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlc"
    max_model_len: int
    weights: str | None = Field(None, description="What the weights run as and why, e.g. int4 from a Q4_1 GGUF.")
    parent: str | None = Field(None, description="A LoRA adapter's base model (null for the base model).")
    root: str | None = Field(None, description="A LoRA adapter's directory.")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
