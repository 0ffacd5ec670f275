"""glm (GLM-4-9B-chat-hf) vs transformers' GlmForCausalLM: q/k/v bias, unbiased o_proj, interleaved partial RoPE."""

import pytest
from transformers import GlmConfig, GlmForCausalLM

from tests.support.hf_reference import GLM_TINY, ParitySuite, load_pair


def tiny_config(**overrides) -> GlmConfig:
    # eos_token_id left unset: GlmConfig.__post_init__ only runs its parent's post-init when it fills eos in
    return GlmConfig(**(GLM_TINY | overrides))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(GlmForCausalLM, tiny_config(), tmp_path_factory.mktemp("glm"))


class TestGlmParity(ParitySuite):
    def test_layout_follows_glm(self, pair):
        attn = pair.ours.model.layers[0].self_attn
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
        assert pair.ours.rotary.rot_dim == 8  # head_dim 16 x partial_rotary_factor 0.5
