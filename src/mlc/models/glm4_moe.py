"""GLM-4.5 / 4.5-Air / 4.6 / 4.7 (glm4_moe): GQA attention with optional per-head q/k RMSNorm before half-split
partial RoPE (convention A, unlike glm's interleaving) and an unbiased o_proj; dense SwiGLU layers below
`first_k_dense_replace`, DeepSeek-V3-style MoE above. The checkpoints' MTP layer (`model.layers.{N}`) is loaded
only for speculative decoding (`add_mtp`, models/mtp.py)."""

from __future__ import annotations

import re

import torch
from torch import nn

from mlc.layers.mlp import GatedMLP
from mlc.layers.moe import SparseMoeBlock, map_moe_weight_name
from mlc.layers.norm import RMSNorm
from mlc.layers.rotary import apply_rope_neox
from mlc.models.fused_decode import Fusable
from mlc.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from mlc.models.mtp import attach_mtp, mtp_weight_target

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class Glm4MoeAttention(LlamaAttention):
    o_proj_bias = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.use_qk_norm = bool(getattr(cfg, "use_qk_norm", False))
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def rotate(self, qk, cos, sin):
        if self.use_qk_norm:
            h = self.num_heads
            qk = torch.cat((self.q_norm(qk[:, :h]), self.k_norm(qk[:, h:])), dim=1)
        return apply_rope_neox(qk, cos, sin)


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Glm4MoeAttention

    def build_mlp(self, cfg, layer_idx: int) -> nn.Module:
        if layer_idx < cfg.first_k_dense_replace:
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        return SparseMoeBlock.from_config(cfg)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Glm4MoeDecoderLayer
    fusable = Fusable(Glm4MoeDecoderLayer, Glm4MoeAttention, interleaved=False, sandwich=False, own_rotary=True)

    def add_mtp(self) -> None:
        attach_mtp(self, self.layer_cls(self.config, self.config.num_hidden_layers))

    def map_weight_name(self, name):
        layer = _LAYER.match(name)
        if layer and int(layer[1]) >= self.config.num_hidden_layers:  # the MTP layer: speculative decoding only
            return mtp_weight_target(self, name, self._map_layer_name)
        return self._map_layer_name(name)

    def _map_layer_name(self, name):
        layer = _LAYER.match(name)
        if layer and int(layer[1]) >= self.config.first_k_dense_replace and ".mlp." in name:
            target = map_moe_weight_name(name, self.config.moe_intermediate_size)
            if target is not None:
                return target
        return super().map_weight_name(name)

    def required_params(self) -> set[str]:
        # the routing bias changes which experts run, so a checkpoint without it must not load silently
        return super().required_params() | {n for n, _ in self.named_buffers() if n.endswith("e_score_correction_bias")}
