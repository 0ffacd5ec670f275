"""glm4 (GLM-4-0414) vs transformers' Glm4ForCausalLM: glm plus the post-attention and post-MLP sandwich norms."""

import pytest
from transformers import Glm4Config, Glm4ForCausalLM

from hf_reference import ParitySuite, load_pair


def tiny_config() -> Glm4Config:
    return Glm4Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                      rms_norm_eps=1e-5, max_position_embeddings=256, pad_token_id=0,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(Glm4ForCausalLM, tiny_config(), tmp_path_factory.mktemp("glm4"))


class TestGlm4Parity(ParitySuite):
    def test_sandwich_norms_loaded_from_checkpoint(self, pair):
        ours, hf = pair.ours.model.layers[1], pair.hf.model.layers[1]
        assert ours.post_self_attn_layernorm.weight.equal(hf.post_self_attn_layernorm.weight)
        assert ours.post_mlp_layernorm.weight.equal(hf.post_mlp_layernorm.weight)
