"""glm4 (GLM-4-0414) vs transformers' Glm4ForCausalLM: glm plus the post-attention and post-MLP sandwich norms."""

import pytest
from transformers import Glm4Config, Glm4ForCausalLM

from tests.support.hf_reference import GLM_TINY, ParitySuite, load_pair


def tiny_config(**overrides) -> Glm4Config:
    return Glm4Config(**(GLM_TINY | overrides))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(Glm4ForCausalLM, tiny_config(), tmp_path_factory.mktemp("glm4"))


class TestGlm4Parity(ParitySuite):
    def test_sandwich_norms_loaded_from_checkpoint(self, pair):
        ours, hf = pair.ours.model.layers[1], pair.hf.model.layers[1]
        assert ours.post_self_attn_layernorm.weight.equal(hf.post_self_attn_layernorm.weight)
        assert ours.post_mlp_layernorm.weight.equal(hf.post_mlp_layernorm.weight)
