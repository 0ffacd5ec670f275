"""One layout priced: its devices split into tensor and pipeline parallel, its bytes per device, whether it fits,
the largest batch that would, and its decode roofline."""

from __future__ import annotations

import math

from mlc.config.engine_config import SparseKVConfig
from mlc.config.hardware import HardwareProfile
from mlc.errors import ConfigError
from mlc.plan.memory import (
    RUNTIME_RESERVE,
    activation_bytes,
    compute_dtype_for,
    kv_bytes_per_token,
    pages_for,
    resolve_weight_dtype,
    shard_spec,
    tokens_kept,
    weight_bytes,
)
from mlc.plan.model_facts import ModelFacts
from mlc.plan.speed import decode_speed
from mlc.plan.types import Layout, PlanRequest


def split_devices(devices: int, profile: HardwareProfile, heads: int) -> tuple[int, int]:
    """(tensor parallel, pipeline parallel): TP inside a node, PP across nodes."""
    tp = min(devices, profile.devices_per_node)
    if devices % tp or heads % tp:
        raise ConfigError(
            f"{devices} devices cannot split {heads} attention heads evenly with {profile.devices_per_node} "
            "devices per node; use a power of two that divides the head count"
        )
    return tp, devices // tp


def evaluate(facts: ModelFacts, profile: HardwareProfile, request: PlanRequest, weight_dtype: str, kv_dtype: str,
             sparse_ratio: float | None, devices: int) -> Layout:
    compute = compute_dtype_for(request, profile)
    weight_dtype = resolve_weight_dtype(weight_dtype, compute)
    kv_dtype = compute if kv_dtype == "auto" else kv_dtype
    tp, pp = split_devices(devices, profile, facts.hf_config.num_attention_heads)
    seq_len = min(request.seq_len, facts.max_context)
    lay = Layout(weight_dtype, kv_dtype, sparse_ratio, devices, tp, pp)
    # experts spread whole when they divide evenly: each rank runs fewer, larger expert GEMMs than when every expert
    # is split tp ways
    lay.expert_parallel = bool(facts.n_experts) and tp > 1 and facts.n_experts % tp == 0
    lay.weight_bytes = math.ceil(weight_bytes(facts, weight_dtype, compute, request.group_size) / devices)
    lay.kv_bytes_per_token, lay.kv_bytes_per_token_exact = kv_bytes_per_token(
        shard_spec(facts.kv_spec, tp, pp), kv_dtype)
    lay.tokens_per_seq = tokens_kept(seq_len, sparse_ratio, SparseKVConfig(ratio=sparse_ratio or 0.25))
    lay.pages_per_seq = math.ceil(lay.tokens_per_seq / request.page_size)
    lay.reserve_bytes = RUNTIME_RESERVE[profile.device]
    lay.capacity_bytes = int(profile.memory * request.memory_fraction)

    def total_for(batch: int) -> tuple[int, int, int]:
        kv = pages_for(batch, lay.tokens_per_seq, request.page_size) * request.page_size * lay.kv_bytes_per_token
        act = activation_bytes(facts, batch, lay.tokens_per_seq, compute, tp, request.max_num_batched_tokens)
        return kv, act, lay.weight_bytes + kv + act + lay.reserve_bytes

    kv, lay.activation_bytes, lay.total_bytes = total_for(request.batch)
    lay.kv_bytes = kv
    lay.pages = pages_for(request.batch, lay.tokens_per_seq, request.page_size)
    lay.fits = lay.total_bytes <= lay.capacity_bytes
    lay.max_batch = _largest_batch(lambda b: total_for(b)[2] <= lay.capacity_bytes)
    lay.decode_tok_s, lay.bound = decode_speed(facts, profile, lay, request.batch, compute, request.group_size)
    lay.decode_tok_s_per_seq = lay.decode_tok_s / request.batch if request.batch else 0.0
    if sparse_ratio is not None:
        lay.notes.append("sparse-KV kept tokens are an estimate of the compaction policy")
    return lay


def _largest_batch(fits, limit: int = 1 << 16) -> int:
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
