"""Request and response bodies of the agentic API: tools and tool calls, structured outputs (OpenAI's
response_format and vLLM's structured_outputs / guided_* extras), and chat template arguments."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_GRAMMAR_CHARS = 200_000
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description=(
    "Letters, digits, _ . and -; at most 64 characters."))]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# tools
class FunctionDef(Strict):
    name: FunctionName
    description: str | None = Field(None, max_length=100_000)
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema of the arguments object.")
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function", "custom"] = Field(description="custom (free-form input) tools are a 400.")
    function: FunctionDef | None = Field(None, description="Required with type function.")
    custom: dict[str, Any] | None = None


class NamedFunction(Strict):
    name: str = Field(max_length=64)


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(Strict):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]] = Field(max_length=128, description="{\"type\": \"function\", \"function\": "
                                        "{\"name\": ...}} for each allowed tool.")


class AllowedToolsChoice(Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class NamedCustomChoice(Strict):
    type: Literal["custom"]
    custom: NamedFunction


ToolChoice = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | NamedCustomChoice | None,
    Field(None, description=(
        "none, auto (the default with tools), required (at least one call), {\"type\": \"function\", \"function\": "
        "{\"name\": ...}} or {\"type\": \"allowed_tools\", ...} (only those tools, auto or required). required and a "
        "named function are enforced by constrained decoding, so the call parses. A custom tool is a 400."))]


class FunctionCallIn(Strict):
    name: str = Field(max_length=64)
    arguments: str | dict[str, Any] = Field(description="A JSON object as a string (OpenAI) or as an object.")


class ToolCallIn(Strict):
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn
    index: int | None = None  # present when a client sends back what it assembled from a stream


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="The arguments as a JSON object string.")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


# structured outputs
class JsonSchemaFormat(Strict):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema", description="The JSON Schema the reply must follow.")
    strict: bool | None = Field(None, description="true: refuse schema keywords the grammar engine does not "
                                "implement; otherwise they are ignored. The schema is enforced either way.")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="Required with type json_schema.")


class StructuredOutputs(Strict):
    """vLLM's structured_outputs: give exactly one of these."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON Schema (object or string).")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS, description="Lark or GBNF (llama.cpp) grammar.")
    json_object: bool | None = None


class StructuredFields(Strict):
    """Fields that constrain the output, shared by /v1/completions and /v1/chat/completions; at most one applies."""

    response_format: ResponseFormat | None = Field(None, description=(
        "text, json_object (any JSON object) or json_schema (that schema), enforced by constrained decoding."))
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM: one of json, regex, choice, "
                                                         "grammar, json_object.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM (older name): a JSON Schema.")
    guided_regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
