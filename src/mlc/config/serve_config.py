"""The serving config: the engine's knobs (`EngineConfig`) plus the HTTP server's.

Also accepts the reference tutorial's `glm5_infer.yaml` shape through the aliases in `ALIASES` (documented in
`templates/serve.yaml`): flat engine keys at the top level, `attn_config: {paged_attn, page_size,
sparse_kv_ratio}`, `use_paged_attn` / `enable_paged_attention`, and `attn_implementation: flash`.

`attn_implementation` and `paged_attention` describe the one attention path mlc has (torch SDPA over a paged KV
cache): values that say so are accepted, values that ask for something else are refused, never ignored.
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
ATTN_IMPLEMENTATION_ALIASES = {"flash": "sdpa", "flash_attention": "sdpa", "flash_attention_2": "sdpa", "fa2": "sdpa"}
ONE_BACKEND = "mlc has one attention path: torch SDPA over the paged KV cache"


def normalize_serve_aliases(raw: dict, notes: list[str] | None = None) -> tuple[dict, dict[str, str]]:
    """Rewrite aliases to our keys. Returns the new dict and {our key: key as the user wrote it}; `notes` gets a
    line for each value rewritten (`attn_implementation: flash -> sdpa`)."""
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
        if notes is not None:
            notes.append(f"attn_implementation: {impl} -> sdpa (torch SDPA, which runs FlashAttention kernels where "
                         "the device has them)")
    return data, origin


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535)
    api_keys: list[str] = []
    api_key_file: str | None = None  # YAML/JSON list of named keys (sha256 hashes) with per-key limits; SIGHUP reloads
    max_queue: int = Field(256, ge=1)  # waiting requests beyond the running batch; more get 429
    request_timeout_s: float = Field(600.0, gt=0)
    audit_log: str | None = None  # JSONL path: one line per request (time, client, tokens)
    audit_log_content: bool = False  # also log prompts and completions
    strict_input: bool = False  # reject prompts with invisible format characters instead of stripping them
    context_profiles: dict[str, int] = {}  # name -> max context tokens, picked per request (`context_profile`)
    default_max_tokens: int = Field(512, ge=1)  # completion length when a request gives no max_tokens
    shutdown_grace_s: float = Field(30.0, ge=0)  # on SIGTERM, in-flight requests get this long before being cancelled
    served_model_name: str | None = None  # the model id clients send and /v1/models lists; default: engine.model
    attn_implementation: Literal["sdpa", "paged"] = "sdpa"  # two names for the one path: SDPA over paged KV
    paged_attention: bool = True  # true is the only value: the KV cache is always paged
    tool_call_parser: str | None = None  # glm45, glm4, hermes or llama3_json; null: read from the chat template
    kv_role: Literal["both", "prefill", "decode"] = "both"  # prefill/decode disaggregation (server/pd.py)
    api_lenient: bool = False  # ignore (and name in x-mlc-ignored-fields) request fields the API does not know
    max_connections: int = Field(1000, ge=1)  # open connections (and requests) at once; past it, new requests get 503
    header_timeout_s: float = Field(10.0, gt=0)  # a request's line and headers must arrive within this; else closed
    body_timeout_s: float = Field(60.0, gt=0)  # its body within this after the headers; else closed
    keep_alive_timeout_s: float = Field(5.0, gt=0)  # an idle keep-alive connection is closed after this
    enable_lora_loading: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter
    lora_dirs: list[str] = []  # adapters load from here; a request for an unloaded adapter NAME loads DIR/NAME
    allowed_lora_paths: list[str] = []  # more directories /v1/load_lora_adapter may read (no loading on first use)
    admin_api_keys: list[str] = []  # keys for the adapter routes; with api_keys set, those routes need one of these

    @classmethod
    def normalize_aliases(cls, data: dict, notes: list[str] | None = None) -> tuple[dict, dict[str, str]]:
        return normalize_serve_aliases(data, notes)

    @field_validator("attn_implementation", mode="before")
    @classmethod
    def _attn(cls, v):
        if isinstance(v, str) and v.lower() in ("eager", "math", "triton", "xformers", "flex_attention"):
            raise ValueError(f"{ONE_BACKEND}, which has no {v!r} variant; write sdpa (the default) or remove the key")
        return v

    @field_validator("paged_attention")
    @classmethod
    def _paged(cls, v: bool):
        if not v:
            raise ValueError(f"{ONE_BACKEND}, so paged attention cannot be turned off; remove the key or set it to "
                             "true (engine.page_size sets the tokens per page)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data):
        return normalize_serve_aliases(data)[0] if isinstance(data, dict) else data

    @field_validator("tool_call_parser")
    @classmethod
    def _tool_parser(cls, v: str | None):
        if v is None:
            return v
        from mlc.config.tool_formats import TOOL_CALL_FORMATS, tool_format_name

        name = tool_format_name(v)
        if name is None:
            raise ValueError(f"unknown tool call parser {v!r}; use one of {', '.join(TOOL_CALL_FORMATS)} (or leave it "
                             "unset: the format is read from the model's chat template)")
        return name

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
        if self.kv_role != "both" and self.engine.tensor_parallel_size > 1:
            raise ValueError(f"kv_role {self.kv_role} moves one process's KV pages, and tensor parallelism keeps them "
                             "split over ranks: serve prefill/decode instances with tensor_parallel_size 1")
        if self.kv_role != "both" and self.engine.pipeline_parallel_size > 1:
            raise ValueError(f"kv_role {self.kv_role} moves one process's KV pages, and pipeline stages keep them "
                             "split over processes: serve prefill/decode instances with pipeline_parallel_size 1")
        return self
