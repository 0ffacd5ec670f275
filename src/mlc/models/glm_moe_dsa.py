"""GLM-5 (`glm_moe_dsa`): MLA attention over a latent paged cache, the DSA top-k indexer, and DeepSeek-V3 MoE.

Layer i runs its own indexer when `indexer_types[i] == "full"`; a "shared" layer reuses the selection of the most
recent full layer. MLP layers are dense or MoE per `mlp_layer_types`. The MTP layer (`model.layers.{N}.*`, N =
num_hidden_layers: a full-indexer MoE layer) is loaded only for speculative decoding (`add_mtp`, models/mtp.py).
"""

from __future__ import annotations

import re

from torch import nn

from mlc.errors import ModelFormatError
from mlc.layers.dsa import Selection
from mlc.layers.linear import Linear
from mlc.layers.mla import MLAttention
from mlc.layers.mlp import GatedMLP
from mlc.layers.moe import SparseMoeBlock, map_moe_weight_name
from mlc.layers.norm import RMSNorm
from mlc.layers.rotary import RotaryEmbedding
from mlc.layers.weight_target import WeightTarget
from mlc.models.base import CausalLM, DecoderModel, Embedding
from mlc.models.llama import map_stacked_name
from mlc.models.mtp import attach_mtp, mtp_weight_target

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def indexer_types_of(cfg) -> list[str]:
    """Per-layer "full" | "shared", as the transformers config resolves it (older configs: every layer full)."""
    n = cfg.num_hidden_layers
    types = list(getattr(cfg, "indexer_types", None) or ["full"] * n)
    if len(types) != n or set(types) - {"full", "shared"} or types[0] != "full":
        raise ModelFormatError(
            f"config.json indexer_types {types!r} must list 'full' or 'shared' for each of the {n} layers, "
            "starting with 'full'; fix config.json"
        )
    return types


def mlp_types_of(cfg) -> list[str]:
    n = cfg.num_hidden_layers
    types = getattr(cfg, "mlp_layer_types", None)
    if types is None:
        dense = min(cfg.first_k_dense_replace, n)
        types = ["dense"] * dense + ["sparse"] * (n - dense)
    if len(types) != n or set(types) - {"dense", "sparse"}:
        raise ModelFormatError(
            f"config.json mlp_layer_types {types!r} must be 'dense' or 'sparse' for each of {n} layers; fix config.json"
        )
    return list(types)


def check_config(cfg) -> None:
    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise ModelFormatError("glm_moe_dsa needs num_key_value_heads == num_attention_heads (MLA); fix config.json")
    if not cfg.q_lora_rank:
        raise ModelFormatError("glm_moe_dsa needs q_lora_rank (there is no plain q_proj path); fix config.json")
    if cfg.qk_rope_head_dim % 2 or cfg.index_head_dim <= cfg.qk_rope_head_dim:
        raise ModelFormatError(
            "glm_moe_dsa needs an even qk_rope_head_dim smaller than index_head_dim; fix config.json"
        )


def latent_cache_spec(cfg) -> list[dict[str, tuple[int, ...]]]:
    """Per layer the MLA latent (post-norm c | post-RoPE k_rot), plus the indexer key on "full" layers."""
    latent: dict[str, tuple[int, ...]] = {"latent": (cfg.kv_lora_rank + cfg.qk_rope_head_dim,)}
    index: dict[str, tuple[int, ...]] = {"index_k": (cfg.index_head_dim,)}
    return [latent | index if t == "full" else dict(latent) for t in indexer_types_of(cfg)]


class GlmMoeDsaDecoderLayer(nn.Module):
    def __init__(self, cfg, indexer_type: str, mlp_type: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, with_indexer=indexer_type == "full")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dense = mlp_type == "dense"
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size) if dense else SparseMoeBlock.from_config(cfg)

    def forward(self, h, cos, sin, cache, meta, selection: Selection | None):
        a, selection = self.self_attn(self.input_layernorm(h), cos, sin, cache, meta, selection)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), selection


class GlmMoeDsaModel(DecoderModel):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            GlmMoeDsaDecoderLayer(cfg, idx, mlp) for idx, mlp in zip(indexer_types_of(cfg), mlp_types_of(cfg))
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class GlmMoeDsaForCausalLM(CausalLM):
    def __init__(self, cfg):
        super().__init__(cfg)
        check_config(cfg)
        self.model = GlmMoeDsaModel(cfg)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = self.model.embed_tokens if self.tied else Linear(
            cfg.hidden_size, cfg.vocab_size, parallel="col", what="vocabulary size")
        self.rotary = RotaryEmbedding(cfg, cfg.qk_rope_head_dim)
        self.indexer_types = indexer_types_of(cfg)

    def forward(self, input_ids, positions, meta, kv_caches=None):
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        selection = None
        for i, layer in enumerate(self.model.layers):
            h, selection = layer(h, cos, sin, kv_caches[i] if kv_caches is not None else None, meta, selection)
        return self.model.norm(h)

    def kv_cache_spec(self):
        return latent_cache_spec(self.config)

    def add_mtp(self) -> None:
        attach_mtp(self, GlmMoeDsaDecoderLayer(self.config, "full", "sparse"))

    def mtp_cache_spec(self):
        c = self.config
        return {"latent": (c.kv_lora_rank + c.qk_rope_head_dim,), "index_k": (c.index_head_dim,)}

    def run_mtp_block(self, x, cos, sin, cache, meta):
        block: nn.Module | None = self.mtp
        assert block is not None
        return block(x, cos, sin, cache, meta, None)[0]

    def map_weight_name(self, name):
        if (m := _LAYER.match(name)) and int(m[1]) >= self.config.num_hidden_layers:
            return mtp_weight_target(self, name, self._map_layer_name)
        return self._map_layer_name(name)

    def _map_layer_name(self, name):
        if "rotary_emb" in name:
            return None
        if self.tied and name == "lm_head.weight":
            return WeightTarget("model.embed_tokens.weight")
        if ".mlp." in name and (target := map_moe_weight_name(name, self.config.moe_intermediate_size)):
            return target
        return map_stacked_name(name)
