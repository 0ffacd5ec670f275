"""llama (SmolLM2 and alikes) vs transformers' LlamaForCausalLM on a tiny random checkpoint."""

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from tests.support.hf_reference import ParitySuite, load_pair


def tiny_config(**overrides) -> LlamaConfig:
    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    return LlamaConfig(**(args | overrides))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(LlamaForCausalLM, tiny_config(), tmp_path_factory.mktemp("llama"))


class TestLlamaParity(ParitySuite):
    pass


class TestLlamaBiasedTiedParity(ParitySuite):
    """attention_bias biases q/k/v and o (unlike GLM); tied embeddings share lm_head with embed_tokens."""

    @pytest.fixture(scope="class")
    def pair(self, tmp_path_factory):
        cfg = tiny_config(attention_bias=True, tie_word_embeddings=True)
        return load_pair(LlamaForCausalLM, cfg, tmp_path_factory.mktemp("llama_bias_tied"))

    def test_o_proj_bias_follows_attention_bias(self, pair):
        assert pair.ours.model.layers[0].self_attn.o_proj.bias is not None
