"""What one device holds for a layout: weight bytes per dtype, KV bytes per token (the engine's own
`KVCache.bytes_per_token_for`), pages (the engine's `plan_cache` rule) and the activation scratch of one step."""

from __future__ import annotations

import math

import torch

from mlc.config.engine_config import SparseKVConfig
from mlc.config.hardware import HardwareProfile
from mlc.engine.kv_cache import KVCache
from mlc.errors import ConfigError
from mlc.plan.model_facts import ModelFacts
from mlc.plan.types import PlanRequest

FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_BITS = {"int8": 8, "int4": 4}
SCALE_BYTES = 2  # one fp16 scale per group
RUNTIME_RESERVE = {"cpu": 2 * 2**30, "cuda": 2**30, "npu": 2**30}  # interpreter/torch on CPU; device context elsewhere


def compute_dtype_for(request: PlanRequest, profile: HardwareProfile) -> str:
    dtype = profile.preferred_dtype if request.dtype == "auto" else request.dtype
    if dtype not in FLOAT_BYTES:
        raise ConfigError(f"--dtype {request.dtype!r} is not a compute dtype (allowed: auto, fp32, fp16, bf16)")
    return dtype


def resolve_weight_dtype(weight_dtype: str, compute: str) -> str:
    return compute if weight_dtype == "auto" else weight_dtype


def bytes_per_param(dtype: str, group_size: int) -> float:
    if dtype in FLOAT_BYTES:
        return float(FLOAT_BYTES[dtype])
    if dtype in QUANT_BITS:
        return QUANT_BITS[dtype] / 8 + SCALE_BYTES / group_size
    raise ConfigError(f"weight dtype {dtype!r} is unknown (allowed: auto, fp32, fp16, bf16, int8, int4)")


def weight_split(facts: ModelFacts, weight_dtype: str, compute: str, group_size: int) -> tuple[float, float, float]:
    """(routed expert bytes, other streamed bytes, input-embedding bytes) of the whole model."""
    quant = bytes_per_param(weight_dtype, group_size)
    plain = quant if weight_dtype in FLOAT_BYTES else float(FLOAT_BYTES[compute])
    experts = facts.routed_expert_params * quant
    embedding = 0 if facts.tied_embeddings else facts.embedding_params * plain
    other_q = (facts.quantizable_params - facts.routed_expert_params) * quant
    other_plain = (facts.total_params - facts.quantizable_params) * plain - embedding
    return experts, other_q + other_plain + facts.buffer_bytes, embedding


def weight_bytes(facts: ModelFacts, weight_dtype: str, compute: str, group_size: int = 128) -> int:
    return int(math.ceil(sum(weight_split(facts, weight_dtype, compute, group_size))))


def shard_spec(spec, tensor_parallel: int, pipeline_parallel: int):
    """The cache layout one device holds: heads split by TP (at least one head each; an MLA latent, having no
    head axis, is replicated), layers split by PP (the largest stage)."""
    stage = spec[: math.ceil(len(spec) / pipeline_parallel)]
    out = []
    for layer in stage:
        out.append({
            name: ((max(1, math.ceil(s[0] / tensor_parallel)), *s[1:]) if len(s) >= 2 else tuple(s))
            for name, s in layer.items()
        })
    return out


def kv_bytes_per_token(spec, kv_dtype: str) -> tuple[int, bool]:
    """(bytes, exact): what the engine's KVCache stores per token for this dtype, scales of int8/int4 included."""
    if kv_dtype not in TORCH_DTYPES and kv_dtype not in QUANT_BITS:
        raise ConfigError(f"kv dtype {kv_dtype!r} is unknown (allowed: auto, fp32, fp16, bf16, int8, int4)")
    return KVCache.bytes_per_token_for(spec, TORCH_DTYPES.get(kv_dtype, kv_dtype)), True


def tokens_kept(seq_len: int, ratio: float | None, sparse: SparseKVConfig) -> int:
    """Cache entries one sequence keeps: all of them, or past `min_context` the sinks, the recent window and
    `ratio` of the older tokens (an estimate of the sparse policy's compaction)."""
    if ratio is None or seq_len <= sparse.min_context:
        return seq_len
    old = max(seq_len - sparse.window - sparse.sink_tokens, 0)
    return min(seq_len, sparse.sink_tokens + sparse.window + math.ceil(ratio * old))


def pages_for(batch: int, tokens_per_seq: int, page_size: int) -> int:
    """The engine's rule (engine/memory.plan_cache): each sequence a full run of pages, plus the null page."""
    return batch * math.ceil(tokens_per_seq / page_size) + 1


def _attention_dims(facts: ModelFacts, tp: int) -> tuple[int, int]:
    """(query heads per device, per-context-token elements a step gathers/expands per device)."""
    cfg = facts.hf_config
    heads = max(1, math.ceil(cfg.num_attention_heads / tp))
    if facts.is_mla:
        per_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
        return heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim + heads * per_head  # latent, then expanded K/V
    kv_heads = max(1, math.ceil((getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) / tp))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return heads, 2 * kv_heads * head_dim


def activation_bytes(facts: ModelFacts, batch: int, context: int, compute: str, tp: int, chunk: int) -> int:
    """Peak scratch of one step (one layer at a time): a prefill chunk or a decode step, plus fp32 logits.
    Counts the gathered (and for MLA expanded) context and fp32 attention scores; an estimate."""
    cfg = facts.hf_config
    a = FLOAT_BYTES[compute]
    heads, gathered = _attention_dims(facts, tp)
    inter = max(int(getattr(cfg, "intermediate_size", 0) or 0),
                int(getattr(cfg, "moe_intermediate_size", 0) or 0) * max(facts.top_k, 1))
    per_token = 6 * cfg.hidden_size + 2 * math.ceil(inter / tp) + 4 * heads * 256
    prefill = chunk * per_token * a + context * gathered * a + chunk * context * heads * 4
    decode = batch * (per_token * a + context * gathered * a + heads * context * 4)
    logits = max(batch, 1) * cfg.vocab_size * 4
    return int(max(prefill, decode) + logits)
