"""The decode roofline of a layout: bytes streamed and FLOPs per step against the profile's bandwidth and peak."""

from __future__ import annotations

from mlc.config.hardware import HardwareProfile
from mlc.plan.memory import FLOAT_BYTES, weight_split
from mlc.plan.model_facts import ModelFacts
from mlc.plan.types import Layout


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
