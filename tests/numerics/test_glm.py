"""glm (GLM-4-9B-chat-hf) vs transformers' GlmForCausalLM: q/k/v bias, unbiased o_proj, interleaved partial RoPE."""

import pytest
from transformers import GlmConfig, GlmForCausalLM

from hf_reference import ParitySuite, load_pair


def tiny_config() -> GlmConfig:
    # eos_token_id left unset: GlmConfig.__post_init__ only runs its parent's post-init when it fills eos in
    return GlmConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, attention_bias=True, rms_norm_eps=1e-5,
                     max_position_embeddings=256, pad_token_id=0,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(GlmForCausalLM, tiny_config(), tmp_path_factory.mktemp("glm"))


class TestGlmParity(ParitySuite):
    def test_layout_follows_glm(self, pair):
        attn = pair.ours.model.layers[0].self_attn
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
        assert pair.ours.rotary.rot_dim == 8  # head_dim 16 x partial_rotary_factor 0.5
