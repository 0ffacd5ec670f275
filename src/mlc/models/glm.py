"""GLM-4 (GLM-4-9B-chat-hf, glm-4-9b-hf): Llama's layout with q/k/v biases, an unbiased o_proj, interleaved
partial RoPE (convention B, the first `head_dim * partial_rotary_factor` dims) and a fused `gate_up_proj` MLP."""

from __future__ import annotations

from mlc.layers.rotary import apply_rope_interleaved
from mlc.models.fused_decode import Fusable
from mlc.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class GlmAttention(LlamaAttention):
    o_proj_bias = False

    def rotate(self, qk, cos, sin):
        return apply_rope_interleaved(qk, cos, sin)


class GlmDecoderLayer(LlamaDecoderLayer):
    attention_cls = GlmAttention


class GlmForCausalLM(LlamaForCausalLM):
    """HF checkpoints already name the MLP `gate_up_proj` (gate rows first), which is our fused layout."""

    layer_cls = GlmDecoderLayer
    fusable = Fusable(GlmDecoderLayer, GlmAttention, interleaved=True, sandwich=False)
