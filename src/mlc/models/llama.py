"""Llama architecture (SmolLM2, Llama 2/3 and alikes): GQA attention with half-split RoPE, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from mlc.layers.attention import AttentionMetadata, paged_attention
from mlc.layers.kv_store import LayerCache
from mlc.layers.linear import Linear, MergedLinear
from mlc.layers.mlp import GatedMLP
from mlc.layers.norm import RMSNorm
from mlc.layers.rotary import RotaryEmbedding, apply_rope_neox, rope_parameters
from mlc.layers.weight_target import WeightTarget
from mlc.models.base import CausalLM, Embedding

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


def map_stacked_name(name: str) -> WeightTarget:
    """`...q_proj.weight` -> shard 0 of `...qkv_proj.weight`, and so on; other names pass through."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in STACKED:
        fused, shard = STACKED[parts[-2]]
        return WeightTarget(".".join(parts[:-2] + [fused, parts[-1]]), shard=shard)
    return WeightTarget(name)


class LlamaAttention(nn.Module):
    o_proj_bias: bool | None = None  # None: follows attention_bias (Llama); GLM models never bias o_proj

    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = kv_heads_of(cfg)
        self.head_dim = head_dim_of(cfg)
        bias = bool(getattr(cfg, "attention_bias", False))
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q, kv, kv], bias=bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=bias if self.o_proj_bias is None else self.o_proj_bias)
        self.scale = self.head_dim**-0.5

    def forward(self, x, cos, sin, cache: LayerCache | None, meta: AttentionMetadata) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)
        split = (h + self.num_kv_heads) * d
        # q and k are adjacent in the fused output, so one rotary call covers both
        qk = self.rotate(qkv[:, :split].view(t, h + self.num_kv_heads, d), cos, sin)
        v = qkv[:, split:].view(t, self.num_kv_heads, d)
        o = paged_attention(qk[:, :h], qk[:, h:], v, cache, meta, self.scale)
        return self.o_proj(o.reshape(t, -1))

    def rotate(self, qk, cos, sin):
        """Positions into the query and key heads `[T, H + KV, D]`; subclasses change the convention or norm first."""
        return apply_rope_neox(qk, cos, sin)


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = self.build_mlp(cfg, layer_idx)

    def build_mlp(self, cfg, layer_idx: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False)))

    def forward(self, h, cos, sin, cache, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg, layer_cls=LlamaDecoderLayer):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    layer_cls = LlamaDecoderLayer

    def __init__(self, cfg):
        super().__init__(cfg)
        self.model = LlamaModel(cfg, self.layer_cls)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = self.model.embed_tokens if self.tied else Linear(cfg.hidden_size, cfg.vocab_size)
        factor = rope_parameters(cfg).get("partial_rotary_factor", 1.0)
        self.rotary = RotaryEmbedding(cfg, int(head_dim_of(cfg) * factor))

    def forward(self, input_ids, positions, meta, kv_caches=None):
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv_caches[i] if kv_caches is not None else None, meta)
        return self.model.norm(h)

    def kv_cache_spec(self):
        shape = (kv_heads_of(self.config), head_dim_of(self.config))
        return [{"k": shape, "v": shape} for _ in range(self.config.num_hidden_layers)]

    def map_weight_name(self, name):
        if "rotary_emb" in name:
            return None
        if self.tied and name == "lm_head.weight":
            return WeightTarget("model.embed_tokens.weight")
        return map_stacked_name(name)
