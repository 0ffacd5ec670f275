"""The engine's knobs, one schema shared by `generate`, `serve`, `bench` and config files."""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

KVCacheDtype = Literal["auto", "fp32", "fp16", "bf16", "int8", "int4"]
WeightDtype = Literal["auto", "fp32", "fp16", "bf16", "int8", "int4"]

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_size(text: str | int | float) -> int:
    """'4GiB' -> 4294967296; plain numbers are bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    m = _SIZE.match(str(text))
    if not m or m.group(2) is not None and m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 512MiB, 4GiB or 2GB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


class SparseKVConfig(BaseModel):
    """Past `min_context` cached tokens, keep the last `window` whole and `ratio` of the older ones (plus sinks).

    The policy and its guarantees are in `mlc/engine/sparse_kv.py`; a request opts out with
    `SamplingParams(full_kv=True)`. A ratio below 0.2 is allowed and logged as a warning."""

    model_config = ConfigDict(extra="forbid")
    window: int = Field(4096, ge=16)  # most recent tokens, always kept whole
    ratio: float = Field(0.25, gt=0.0, le=1.0)  # fraction of the older tokens kept (strided); 1 turns it off
    min_context: int = Field(8192, ge=0)  # sequences up to this many tokens are never thinned
    sink_tokens: int = Field(4, ge=0)  # first tokens, always kept (attention sinks)


class SpeculativeConfig(BaseModel):
    """Speculative decoding (`mlc/engine/speculative.py`), vLLM's `--speculative-config` keys.

    `ngram`: each decoding sequence proposes up to `num_speculative_tokens` tokens that follow the latest earlier
    occurrence of its last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in its prompt and
    output. `mtp`: GLM-4.5/4.6/4.7's and GLM-5's own multi-token-prediction layer proposes one token from the
    trunk's last hidden state (`mlc/models/mtp.py`). One step verifies the drafts, each as its own decode row, so
    the output is the one plain decoding gives (greedy: the same tokens; sampling: the same distribution). A
    request opts out with `SamplingParams(speculative=False)`."""

    model_config = ConfigDict(extra="forbid")
    method: Literal["ngram", "mtp", "draft_model"] = "ngram"  # prompt lookup, the checkpoint's MTP layer, a model
    model: str | None = None  # draft_model: the draft (a store name, checkpoint dir or .gguf; the same vocabulary)
    num_speculative_tokens: int = Field(3, ge=1, le=16)  # ngram, draft_model: `bench spec`'s verify-cost curve; mtp: 1
    prompt_lookup_min: int = Field(2, ge=1, le=8)
    prompt_lookup_max: int = Field(4, ge=1, le=8)
    disable_by_batch_size: int | None = Field(8, ge=1)  # no drafting while more sequences than this run

    @model_validator(mode="before")
    @classmethod
    def _method(cls, v):
        if isinstance(v, dict) and v.get("method") in ("eagle", "eagle3", "medusa"):
            raise ValueError(f"speculative method {v['method']!r} is not built yet; use \"ngram\" (prompt lookup), "
                             "\"mtp\" (a GLM checkpoint's own MTP layer) or \"draft_model\" (a small model)")
        if isinstance(v, dict) and v.get("method") == "mtp":
            v = {"num_speculative_tokens": 1, **v}  # the layer's own guess; more run it again on that guess
        return v

    @model_validator(mode="after")
    def _window(self):
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must not exceed prompt_lookup_max")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError('method "draft_model" needs "model" (the draft model: a store name, checkpoint dir or '
                             '.gguf with the target\'s vocabulary), and only it takes one')
        return self


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = "smollm2-135m-instruct"
    device: str = "cpu"
    dtype: str = "auto"
    weight_dtype: WeightDtype = "auto"
    page_size: int = Field(16, ge=1, le=1024)
    kv_cache_dtype: KVCacheDtype = "auto"
    kv_cache_memory: int | None = None  # bytes; None -> kv_cache_fraction of free memory
    kv_cache_fraction: float = Field(0.5, gt=0.0, le=0.95)
    max_batch_size: int | None = Field(None, ge=1)  # None: sized from the KV budget (engine/memory.py), <= 256
    max_seq_len: int | None = Field(None, ge=2)  # None -> the model's context length
    max_num_batched_tokens: int = Field(4096, ge=16)  # 512 made a 4K prompt 1.7x slower to prefill (BENCHMARKS.md)
    enable_prefix_caching: bool = True
    kv_lease_timeout: float = Field(30.0, gt=0)  # prefill/decode split: seconds a prefill keeps pages for its decoder
    enable_chunked_prefill: bool = True
    sparse_kv: SparseKVConfig | None = None
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    seed: int = 0
    lora_adapters: dict[str, str] = Field(default_factory=dict)  # served adapter name -> PEFT adapter dir
    max_loras: int | None = Field(None, ge=1)  # distinct LoRA adapters in one batch; None: no bound
    max_cpu_loras: int | None = Field(None, ge=1)  # adapters held loaded (LRU eviction past it); None: no bound
    max_lora_rank: int = Field(64, ge=1)  # adapters of a higher rank are refused
    num_threads: int | None = Field(None, ge=1)  # CPU compute threads; None: torch's default (one per core)
    tensor_parallel_size: int = Field(1, ge=1)  # ranks (processes) the model is split over; gloo on CPU
    enable_expert_parallel: bool = False  # MoE: whole experts spread over the ranks instead of split inside each
    pipeline_parallel_size: int = Field(1, ge=1)  # stages (processes) the layers are split over (engine/pp_runner)
    pipeline_depth: int | None = Field(None, ge=1)  # micro-batches in flight; None: one per stage
    compile: bool = False  # the forward pass as one torch.compile graph (engine/compiled_forward.py)
    verify: bool = False  # a store model's every byte against its manifest at load; off: sizes + sampled hashes

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _json(cls, v):
        """The command line gives it as JSON text (`--speculative-config '{"method": "ngram"}'`)."""
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not JSON ({e.msg}); write e.g. "
                                 '\'{"method": "ngram", "num_speculative_tokens": 5}\'') from e
        return v

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _size(cls, v):
        return None if v is None else parse_size(v)

    @model_validator(mode="after")
    def _check(self):
        if self.max_seq_len is not None and self.max_seq_len < self.page_size:
            raise ValueError("max_seq_len must be at least page_size")
        if self.speculative_config is not None and self.sparse_kv is not None and self.sparse_kv.ratio < 1:
            raise ValueError("speculative_config and sparse_kv cannot be used together yet; drop one of them")
        if self.pipeline_parallel_size > 1:
            pipeline_conflicts(self)
        spec = self.speculative_config
        if spec is not None and spec.method != "ngram" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(f"speculative method \"{spec.method}\" runs in one process for now; drop "
                             "tensor_parallel_size / pipeline_parallel_size, or use {\"method\": \"ngram\"}")
        return self


def pipeline_conflicts(c: EngineConfig) -> None:
    """Refuse what pipeline parallelism does not run yet, each with what to do instead."""
    not_yet = [(bool(c.lora_adapters), "LoRA adapters"), (c.speculative_config is not None, "speculative decoding"),
               (c.sparse_kv is not None and c.sparse_kv.ratio < 1, "sparse_kv"), (c.compile, "--compile")]
    for bad, what in not_yet:
        if bad:
            raise ValueError(f"pipeline parallelism with {what} is not built yet; drop one of them (or set "
                             "pipeline_parallel_size: 1)")
