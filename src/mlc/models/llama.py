"""Llama architecture (SmolLM2, Llama 2/3 and alikes): GQA attention with half-split RoPE, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from mlc.distributed.state import reduce_from_tp, tp_rank, tp_size
from mlc.errors import ConfigError
from mlc.layers.attention import AttentionMetadata
from mlc.layers.attention_op import attend
from mlc.layers.kv_store import LayerCache
from mlc.layers.linear import Linear, MergedLinear, split_evenly
from mlc.layers.mlp import GatedMLP
from mlc.layers.norm import RMSNorm
from mlc.layers.rotary import RotaryEmbedding, apply_rope_neox, rope_neox_fused, rope_parameters
from mlc.layers.weight_target import WeightTarget
from mlc.models.base import CausalLM, DecoderModel, Embedding
from mlc.models.fused_decode import Fusable, model_plans, run_layers, step_qualifies

# HF projection name -> (our fused module, shard index)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def kv_heads_of(cfg) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def local_heads(cfg) -> tuple[tuple[int, int], tuple[int, int]]:
    """(first, count) of this rank's query heads and KV heads. Query heads split evenly; KV heads too, or, when
    there are fewer KV heads than ranks, each rank keeps the one KV head its query heads read (replicated)."""
    heads, kv = cfg.num_attention_heads, kv_heads_of(cfg)
    size, rank = tp_size(), tp_rank()
    if size == 1:
        return (0, heads), (0, kv)
    per_rank = split_evenly(heads, "number of attention heads")
    if kv >= size:
        kv_per_rank = split_evenly(kv, "number of KV heads")
        return (rank * per_rank, per_rank), (rank * kv_per_rank, kv_per_rank)
    if size % kv:
        raise ConfigError(f"tensor parallel size {size} is more than the model's {kv} KV heads and not a multiple of "
                          f"it; use a size that divides {kv} or a multiple of {kv} that divides {heads}")
    return (rank * per_rank, per_rank), (rank // (size // kv), 1)


def map_stacked_name(name: str) -> WeightTarget:
    """`...q_proj.weight` -> shard 0 of `...qkv_proj.weight`, and so on; other names pass through."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in STACKED:
        fused, shard = STACKED[parts[-2]]
        return WeightTarget(".".join(parts[:-2] + [fused, parts[-1]]), shard=shard)
    return WeightTarget(name)


class LlamaAttention(nn.Module):
    o_proj_bias: bool | None = None  # None: follows attention_bias (Llama); GLM models never bias o_proj
    layer_idx: int  # set by the decoder layer that owns it

    def __init__(self, cfg):
        super().__init__()
        heads, kv_heads = local_heads(cfg)
        self.num_heads, self.num_kv_heads = heads[1], kv_heads[1]
        self.head_dim = d = head_dim_of(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        q, kv = cfg.num_attention_heads * d, kv_heads_of(cfg) * d
        local = [(heads[0] * d, heads[1] * d), (kv_heads[0] * d, kv_heads[1] * d), (kv_heads[0] * d, kv_heads[1] * d)]
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q, kv, kv], bias=bias, local=local)
        self.o_proj = Linear(q, cfg.hidden_size, bias=bias if self.o_proj_bias is None else self.o_proj_bias,
                             parallel="row", what="number of attention heads x head_dim")
        self.scale = self.head_dim**-0.5
        self.fused_rope = type(self).rotate is LlamaAttention.rotate  # a subclass's own rotary runs as written

    def forward(self, x, cos, sin, cache: LayerCache | None, meta: AttentionMetadata) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        split = (h + self.num_kv_heads) * d
        # q and k are adjacent in the fused output, so one rotary call covers both
        if self.fused_rope:
            qk = rope_neox_fused(qkv, h + self.num_kv_heads, d, cos, sin)
        else:
            qk = self.rotate(qkv[:, :split].view(t, h + self.num_kv_heads, d), cos, sin)
        v = qkv[:, split:].view(t, self.num_kv_heads, d)
        o = attend(qk[:, :h], qk[:, h:], v, cache, meta, self.scale, self.layer_idx)
        return reduce_from_tp(self.o_proj(o.reshape(t, -1)))

    def rotate(self, qk, cos, sin):
        """Positions into the query and key heads `[T, H + KV, D]`; subclasses change the convention or norm first."""
        return apply_rope_neox(qk, cos, sin)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg)
        self.self_attn.layer_idx = layer_idx  # which cache a compiled graph's attention op reads
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.build_mlp(cfg, layer_idx)

    def build_mlp(self, cfg, layer_idx: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False)))

    def forward(self, h, cos, sin, cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(DecoderModel):
    def __init__(self, cfg, layer_cls=LlamaDecoderLayer):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer
    fusable = Fusable(LlamaDecoderLayer, LlamaAttention, interleaved=False, sandwich=False)  # models/fused_decode.py

    def __init__(self, cfg):
        super().__init__(cfg)
        self.model = LlamaModel(cfg, self.layer_cls)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = self.model.embed_tokens if self.tied else Linear(
            cfg.hidden_size, cfg.vocab_size, parallel="col", what="vocabulary size")
        factor = rope_parameters(cfg).get("partial_rotary_factor", 1.0)
        self.rotary = RotaryEmbedding(cfg, int(head_dim_of(cfg) * factor))

    def forward(self, input_ids, positions, meta, kv_caches=None):
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        if meta.in_place_decode is not None and h.device.type == "cpu" and not torch.compiler.is_compiling():
            if self.decode_plans is None:
                self.decode_plans = model_plans(self.model.layers, self.fusable) or []
            if self.decode_plans and step_qualifies(self.decode_plans, h, cos, meta, kv_caches):
                return self.model.norm(run_layers(self.decode_plans, h, cos, sin, meta, kv_caches))
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv_caches[i] if kv_caches is not None else None, meta)
        return self.model.norm(h)

    def kv_cache_spec(self):
        shape = (local_heads(self.config)[1][1], head_dim_of(self.config))  # this rank's KV heads
        return [{"k": shape, "v": shape} for _ in range(self.config.num_hidden_layers)]

    def map_weight_name(self, name):
        if "rotary_emb" in name:
            return None
        if self.tied and name == "lm_head.weight":
            return WeightTarget("model.embed_tokens.weight")
        return map_stacked_name(name)
