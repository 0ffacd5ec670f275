"""`mlc-cli plan`: will a model fit on a device at a length and batch, with which dtypes, on how many devices,
and how fast can it decode (bandwidth roofline)?

Exact figures: parameter counts (the architecture built on "meta"), KV bytes per token for every cache dtype,
int8/int4 scales included (`KVCache.bytes_per_token_for` on the model's own `kv_cache_spec()`), pages (the engine's
`plan_cache` rule: a full-length page run per sequence plus the null page). Estimates, labelled as such: int8/int4
weight sizes (group scales), sparse-KV kept tokens, activation headroom, runtime reserve, and tok/s (an upper
bound).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from mlc.config.engine_config import SparseKVConfig
from mlc.config.hardware import HardwareProfile
from mlc.deploy.model_facts import ModelFacts
from mlc.engine.kv_cache import KVCache
from mlc.errors import ConfigError

FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_BITS = {"int8": 8, "int4": 4}
SCALE_BYTES = 2  # one fp16 scale per group
RUNTIME_RESERVE = {"cpu": 2 * 2**30, "cuda": 2**30, "npu": 2**30}  # interpreter/torch on CPU; device context elsewhere
DEVICE_COUNTS = (1, 2, 4, 8, 16, 32, 64)
SPARSE_RATIO = 0.25  # the tutorial's balance point; below 0.2 recall collapses (lint rule sparse-kv-ratio-min)


@dataclass
class PlanRequest:
    seq_len: int = 32768
    batch: int = 8
    dtype: str = "auto"  # compute dtype; auto -> the profile's preferred dtype
    weight_dtype: str = "auto"
    kv_dtype: str = "auto"
    page_size: int = 16
    devices: int | None = None  # None -> 1 for the requested layout; the recommendation searches
    sparse_kv_ratio: float | None = None
    max_num_batched_tokens: int = 512
    memory_fraction: float = 0.9
    group_size: int = 128


@dataclass
class Layout:
    """One way to run the model, and what it costs per device."""

    weight_dtype: str
    kv_dtype: str
    sparse_kv_ratio: float | None
    devices: int
    tensor_parallel: int
    pipeline_parallel: int
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0  # per device, all layers of its stage
    kv_bytes_per_token_exact: bool = True
    tokens_per_seq: int = 0  # cache entries one sequence keeps at seq_len
    pages_per_seq: int = 0
    pages: int = 0  # batch x pages_per_seq + the null page
    kv_bytes: int = 0
    activation_bytes: int = 0
    reserve_bytes: int = 0
    total_bytes: int = 0
    capacity_bytes: int = 0
    fits: bool = False
    max_batch: int = 0
    decode_tok_s: float = 0.0  # all sequences of the batch together
    decode_tok_s_per_seq: float = 0.0
    bound: str = ""  # memory | compute | interconnect
    tier: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class PlanResult:
    model: dict
    hardware: dict
    request: dict
    requested: Layout
    recommendation: Layout | None
    reason: str
    alternatives: list[Layout]
    notes: list[str]

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "hardware": self.hardware,
            "request": self.request,
            "requested": asdict(self.requested),
            "recommendation": asdict(self.recommendation) if self.recommendation else None,
            "reason": self.reason,
            "alternatives": [asdict(a) for a in self.alternatives],
            "notes": self.notes,
        }


# -- sizes ----------------------------------------------------------------------------------------------------
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


# -- activations and speed ----------------------------------------------------------------------------------------
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


def _attention_flops(facts: ModelFacts, batch: int, context: int) -> float:
    cfg = facts.hf_config
    layers = facts.num_layers
    if facts.is_mla:
        h = cfg.num_attention_heads
        expand = 2 * context * cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        attend = 2 * context * h * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        index = 2 * context * getattr(cfg, "index_n_heads", 0) * getattr(cfg, "index_head_dim", 0)
        return batch * layers * (expand + attend + index)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return batch * layers * 4 * context * cfg.num_attention_heads * head_dim


def decode_speed(facts: ModelFacts, profile: HardwareProfile, layout: Layout, batch: int, compute: str,
                 group_size: int) -> tuple[float, str]:
    """(tok/s of the whole batch, the bound) at the end of the sequence, from bytes streamed and FLOPs per step."""
    if batch < 1:
        return 0.0, ""
    experts, other, _ = weight_split(facts, layout.weight_dtype, compute, group_size)
    touched = 1 - (1 - facts.top_k / facts.n_experts) ** batch if facts.n_experts else 1.0
    streamed = (other + experts * touched) / layout.devices + batch * layout.tokens_per_seq * layout.kv_bytes_per_token
    t_mem = streamed / (profile.memory_bandwidth_gbps * 1e9)
    dense_active = facts.active_params - (0 if facts.tied_embeddings else facts.embedding_params)
    flops = (2 * dense_active * batch + _attention_flops(facts, batch, layout.tokens_per_seq)) / layout.devices
    t_compute = flops / (profile.tflops(compute) * 1e12)
    t_comm = 0.0
    if layout.tensor_parallel > 1 and profile.interconnect_gbps:
        tp = layout.tensor_parallel
        reduce = 2 * facts.num_layers * batch * facts.hf_config.hidden_size * FLOAT_BYTES[compute] * 2 * (tp - 1) / tp
        t_comm = reduce / (profile.interconnect_gbps * 1e9)
    step = max(t_mem, t_compute) + t_comm
    bound = "memory" if t_mem >= t_compute else "compute"
    if t_comm > max(t_mem, t_compute):
        bound = "interconnect"
    return batch / step, bound


# -- one layout -------------------------------------------------------------------------------------------------
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
    lay.weight_bytes = math.ceil(weight_bytes(facts, weight_dtype, compute, request.group_size) / devices)
    lay.kv_bytes_per_token, lay.kv_bytes_per_token_exact = kv_bytes_per_token(shard_spec(facts.kv_spec, tp, pp), kv_dtype)
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


# -- recommendation ------------------------------------------------------------------------------------------------
def _tiers(profile: HardwareProfile, compute: str, long_context: bool) -> list[tuple[str, str, float | None]]:
    """(weight dtype, kv dtype, sparse ratio), from the least to the most lossy."""
    native_kv = compute if compute in profile.kv_cache_dtypes else profile.preferred_dtype
    tiers = [(compute, native_kv, None), (compute, "int8", None), ("int8", "int8", None)]
    if long_context:
        tiers.append(("int8", "int8", SPARSE_RATIO))
    tiers += [("int4", "int8", SPARSE_RATIO if long_context else None), ("int4", "int4", SPARSE_RATIO if long_context else None)]
    supported = [t for t in tiers if t[0] in profile.weight_dtypes + [compute] and t[1] in profile.kv_cache_dtypes]
    return list(dict.fromkeys(supported))


LOSSLESS_TIERS = 3  # native, int8 KV, int8 weights + int8 KV: accuracy close to the checkpoint's


def recommend(facts: ModelFacts, profile: HardwareProfile, request: PlanRequest) -> tuple[Layout | None, str, list[Layout]]:
    compute = compute_dtype_for(request, profile)
    long_context = min(request.seq_len, facts.max_context) > SparseKVConfig().min_context
    heads = facts.hf_config.num_attention_heads
    counts = [d for d in DEVICE_COUNTS if heads % min(d, profile.devices_per_node) == 0 and d % min(d, profile.devices_per_node) == 0]
    tiers = _tiers(profile, compute, long_context)
    best: dict[int, Layout] = {}
    for tier, (w, kv, sparse) in enumerate(tiers):
        for d in counts:
            lay = evaluate(facts, profile, request, w, kv, sparse, d)
            if lay.fits:
                lay.tier = tier
                best[tier] = lay
                break
    alternatives = [best[t] for t in sorted(best)]
    one_node = [a for a in alternatives if a.devices <= profile.devices_per_node]
    pick = _first(one_node, lambda a: a.tier < LOSSLESS_TIERS, key=lambda a: (a.devices, a.tier))
    reason = "fewest devices in one node with int8 or better weights and KV"
    if pick is None:
        pick = _first(one_node, lambda a: True, key=lambda a: (a.tier, a.devices))
        reason = "one node only fits with int4 weights or KV (and sparse KV where the context is long)"
    if pick is None:
        pick = _first(alternatives, lambda a: True, key=lambda a: (a.devices, a.tier))
        reason = "the model does not fit in one node; pipeline parallel across nodes"
    if pick is None:
        reason = f"nothing fits at batch {request.batch} x {request.seq_len} tokens on up to {DEVICE_COUNTS[-1]} devices"
    return pick, reason, alternatives


def _first(items, keep, key):
    chosen = sorted((i for i in items if keep(i)), key=key)
    return chosen[0] if chosen else None


# -- entry point ---------------------------------------------------------------------------------------------------
def plan(facts: ModelFacts, profile: HardwareProfile, request: PlanRequest) -> PlanResult:
    if request.seq_len < 1 or request.batch < 1:
        raise ConfigError("--seq-len and --batch must be at least 1")
    notes: list[str] = []
    if request.seq_len > facts.max_context:
        notes.append(
            f"seq_len {request.seq_len} exceeds the model's context ({facts.max_context}); the engine caps "
            f"max_seq_len there, so the plan uses {facts.max_context}"
        )
    requested = evaluate(facts, profile, request, request.weight_dtype, request.kv_dtype, request.sparse_kv_ratio,
                         request.devices or 1)
    pick, reason, alternatives = recommend(facts, profile, request)
    if facts.is_mla:
        notes.append("MLA: the engine re-expands the cached latent with kv_b_proj at every step (no absorbed MLA), "
                     "so long-context decode is compute-bound; the latent is replicated, not split, across TP ranks")
    notes.append("decode tok/s is a roofline upper bound: bytes streamed per step / memory bandwidth, or FLOPs / peak")
    notes += [f"profile {profile.name}: {k} is uncertain: {v}" for k, v in profile.uncertain.items()]
    model = {
        "name": facts.name, "source": facts.source, "model_type": facts.model_type,
        "total_params": facts.total_params, "active_params": facts.active_params,
        "layers": facts.num_layers, "max_context": facts.max_context,
        "kv_cache_spec_layer0": {k: list(v) for k, v in facts.kv_spec[0].items()},
    }
    hardware = {
        "name": profile.name, "description": profile.description, "memory_bytes": profile.memory,
        "memory_bandwidth_gbps": profile.memory_bandwidth_gbps, "devices_per_node": profile.devices_per_node,
        "compute_dtype": compute_dtype_for(request, profile),
    }
    return PlanResult(model, hardware, asdict(request), requested, pick, reason, alternatives, notes)
