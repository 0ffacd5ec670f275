"""Bodies of the tokenizer routes (/tokenize, /detokenize) and the health routes."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mlc.server.protocol.schemas import MAX_PROMPT_CHARS, ChatMessage, Strict, TokenId


# tokenize
class TokenizeRequest(Strict):
    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
        "examples": [{"prompt": "Hello world", "return_token_strs": True},
                     {"messages": [{"role": "user", "content": "Hi"}]}]})

    model: str | None = None
    prompt: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS,
                               description="Give prompt or messages, not both.")
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024,
                                               description="Give prompt or messages, not both.")
    add_special_tokens: bool = Field(True, description="For prompt: add the tokenizer's BOS etc.")
    add_generation_prompt: bool = Field(True, description="For messages: end with the assistant header.")
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None
    stripped_chars: int = 0


class DetokenizeRequest(Strict):
    model_config = ConfigDict(json_schema_extra={"examples": [{"tokens": [19556, 905]}]})

    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


# health
class HealthResponse(BaseModel):
    status: Literal["loading", "healthy", "ready", "alive", "draining", "error"]
    message: str | None = None
