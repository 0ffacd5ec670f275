"""GLM-4-0414 (GLM-4-9B/32B-0414, Z1): glm plus "sandwich" norms on the attention and MLP outputs
(`post_self_attn_layernorm`, `post_mlp_layernorm`) before each residual add."""

from __future__ import annotations

from mlc.layers.norm import RMSNorm
from mlc.models.fused_decode import Fusable
from mlc.models.glm import GlmAttention, GlmDecoderLayer, GlmForCausalLM


class Glm4DecoderLayer(GlmDecoderLayer):
    def __init__(self, cfg, layer_idx: int = 0):
        super().__init__(cfg, layer_idx)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, cache, meta):
        h = h + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(h), cos, sin, cache, meta))
        return h + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(h)))


class Glm4ForCausalLM(GlmForCausalLM):
    layer_cls = Glm4DecoderLayer
    fusable = Fusable(Glm4DecoderLayer, GlmAttention, interleaved=True, sandwich=True)
