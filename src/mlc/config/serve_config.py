"""The serving config: the engine's knobs (`EngineConfig`) plus the HTTP server's.

Also accepts the reference tutorial's `glm5_infer.yaml` shape through the aliases in `ALIASES` (documented in
`templates/serve.yaml`): flat engine keys at the top level, `attn_config: {paged_attn, page_size,
sparse_kv_ratio}`, `use_paged_attn` / `enable_paged_attention`, and `attn_implementation: flash`.
"""

from __future__ import annotations

import copy
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mlc.config.dotted import move_alias
from mlc.config.engine_config import EngineConfig

# Alias (as written in the tutorial or MindIE flags) -> our dotted key.
ALIASES: dict[str, str] = {
    "attn_config.paged_attn": "paged_attention",
    "attn_config.page_size": "engine.page_size",
    "attn_config.sparse_kv_ratio": "engine.sparse_kv.ratio",
    "attn_config.kv_cache_dtype": "engine.kv_cache_dtype",
    "use_paged_attn": "paged_attention",
    "enable_paged_attention": "paged_attention",
    "sparse_kv_ratio": "engine.sparse_kv.ratio",
}
# torch SDPA dispatches to a FlashAttention kernel where the device has one, so "flash" means "sdpa" here.
ATTN_IMPLEMENTATION_ALIASES = {"flash": "sdpa", "flash_attention": "sdpa", "flash_attention_2": "sdpa", "eager": "sdpa"}


def normalize_serve_aliases(raw: dict) -> tuple[dict, dict[str, str]]:
    """Rewrite aliases to our keys. Returns the new dict and {our key: key as the user wrote it}."""
    data = copy.deepcopy(raw)
    origin: dict[str, str] = {}

    for src, dst in ALIASES.items():
        move_alias(data, src, dst, origin)
    for name in EngineConfig.model_fields:
        if name in data and name not in ServeConfig.model_fields:
            move_alias(data, name, f"engine.{name}", origin)
    impl = data.get("attn_implementation")
    if isinstance(impl, str) and impl.lower() in ATTN_IMPLEMENTATION_ALIASES:
        data["attn_implementation"] = ATTN_IMPLEMENTATION_ALIASES[impl.lower()]
    return data, origin


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    api_keys: list[str] = []
    max_queue: int = Field(256, ge=1)  # waiting requests beyond the running batch; more get 429
    request_timeout_s: float = Field(600.0, gt=0)
    audit_log: str | None = None  # JSONL path: one line per request (time, client, tokens)
    audit_log_content: bool = False  # also log prompts and completions
    strict_input: bool = False  # reject prompts with invisible format characters instead of stripping them
    context_profiles: dict[str, int] = {}  # name -> max context tokens, picked per request (`context_profile`)
    default_max_tokens: int = Field(512, ge=1)  # completion length when a request gives no max_tokens
    shutdown_grace_s: float = Field(30.0, ge=0)  # on SIGTERM, in-flight requests get this long before being cancelled
    served_model_name: str | None = None  # the model id clients send and /v1/models lists; default: engine.model
    attn_implementation: Literal["sdpa", "paged"] = "sdpa"
    paged_attention: bool = True

    @classmethod
    def normalize_aliases(cls, data: dict) -> tuple[dict, dict[str, str]]:
        return normalize_serve_aliases(data)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data):
        return normalize_serve_aliases(data)[0] if isinstance(data, dict) else data

    @field_validator("context_profiles")
    @classmethod
    def _profiles(cls, v: dict[str, int]):
        bad = [k for k, n in v.items() if n < 1]
        if bad:
            raise ValueError(f"context profile(s) {', '.join(bad)} must allow at least 1 token")
        return v

    @model_validator(mode="after")
    def _check(self):
        limit = self.engine.max_seq_len
        too_long = [k for k, n in self.context_profiles.items() if limit is not None and n > limit]
        if too_long:
            raise ValueError(f"context profile(s) {', '.join(too_long)} exceed engine.max_seq_len ({limit})")
        return self
