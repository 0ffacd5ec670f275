"""glm4_moe (GLM-4.5/4.6/4.7) vs transformers' Glm4MoeForCausalLM: per-head qk-norm, half-split partial RoPE,
a dense first layer, then MoE layers with the sigmoid, bias-corrected, group-limited router; both expert layouts
(transformers' fused 3-D tensors and the hub's per-expert tensors) and the hub's extra MTP layer."""

import json

import pytest
import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

from mlc.errors import ModelFormatError
from mlc.layers.moe import SparseMoeBlock
from mlc.models.loader import load_model
from tests.support.hf_reference import (
    Pair,
    ParitySuite,
    batch_prompts,
    check_dense,
    load_pair,
    mtp_layer_tensors,
    read_checkpoint,
    to_fused_experts,
    to_per_expert,
    write_checkpoint,
)


def tiny_config(**overrides) -> Glm4MoeConfig:
    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True,
                n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
                max_position_embeddings=256,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    return Glm4MoeConfig(**(args | overrides))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return load_pair(Glm4MoeForCausalLM, tiny_config(), tmp_path_factory.mktemp("glm4_moe"))


class TestGlm4MoeParity(ParitySuite):
    def test_layer_kinds(self, pair):
        layers = pair.ours.model.layers
        assert not isinstance(layers[0].mlp, SparseMoeBlock)
        assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in layers[1:])
        assert layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
        assert pair.ours.rotary.rot_dim == 16  # head_dim 32 x partial_rotary_factor 0.5


class TestGroupLimitedRouting(ParitySuite):
    """n_group=2, topk_group=1: each token's experts come from its best group only."""

    @pytest.fixture(scope="class")
    def pair(self, tmp_path_factory):
        return load_pair(Glm4MoeForCausalLM, tiny_config(n_group=2, topk_group=1), tmp_path_factory.mktemp("groups"))

    @pytest.mark.parametrize("bias", [0.0, -1.5])
    def test_router_matches_transformers(self, pair, bias):
        """With every corrected score negative (bias -1.5) masking with 0.0 (transformers <= 5.0) would pick the
        masked experts; 5.x masks with -inf, and so do we."""
        hf_gate, ours = pair.hf.model.layers[1].mlp.gate, pair.ours.model.layers[1].mlp.gate
        ref = Glm4MoeTopkRouter(pair.hf.config)
        ref.load_state_dict(hf_gate.state_dict())
        with torch.no_grad():
            ref.e_score_correction_bias.add_(bias)
            ours.e_score_correction_bias.copy_(ref.e_score_correction_bias)
            x = torch.randn(256, 64, generator=torch.Generator().manual_seed(3))
            _, want_w, want_ids = ref(x)
            got_ids, got_w = ours(x)
            ours.e_score_correction_bias.copy_(hf_gate.e_score_correction_bias)
        order_got, order_want = got_ids.argsort(-1), want_ids.argsort(-1)
        assert got_ids.gather(1, order_got).equal(want_ids.gather(1, order_want))
        torch.testing.assert_close(got_w.gather(1, order_got), want_w.gather(1, order_want), rtol=0, atol=1e-6)
        assert (got_ids // 4).min(-1).values.equal((got_ids // 4).max(-1).values), "experts span two groups"


def _reloaded(pair: Pair, dst, tensors, shards=1):
    return Pair(pair.hf, load_model(write_checkpoint(pair.path, dst, tensors, shards)), dst)


def test_per_expert_hub_layout_with_mtp_layer_loads_and_matches(pair, tmp_path):
    tensors = to_per_expert(read_checkpoint(pair.path))
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in tensors
    tensors |= mtp_layer_tensors(tensors, source_layer=2, mtp_layer=pair.hf.config.num_hidden_layers)
    check_dense(_reloaded(pair, tmp_path / "hub", tensors, shards=3), batch_prompts())


def test_fused_expert_layout_loads_and_matches(pair, tmp_path):
    tensors = to_fused_experts(read_checkpoint(pair.path))
    assert tensors["model.layers.2.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    check_dense(_reloaded(pair, tmp_path / "fused", tensors), batch_prompts())


def test_checkpoint_without_routing_bias_is_rejected(pair, tmp_path):
    tensors = {n: t for n, t in read_checkpoint(pair.path).items() if "e_score_correction_bias" not in n}
    with pytest.raises(ModelFormatError, match="e_score_correction_bias"):
        load_model(write_checkpoint(pair.path, tmp_path / "nobias", tensors))


def test_checkpoint_with_wrong_expert_count_is_rejected(pair, tmp_path):
    tensors = to_per_expert(read_checkpoint(pair.path))
    tensors["model.layers.1.mlp.experts.8.down_proj.weight"] = torch.zeros(64, 32)
    with pytest.raises(ModelFormatError, match="expert 8 does not exist"):
        load_model(write_checkpoint(pair.path, tmp_path / "extra_expert", tensors))


def test_inconsistent_group_config_is_rejected(pair, tmp_path):
    dst = write_checkpoint(pair.path, tmp_path / "groups3", read_checkpoint(pair.path))
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config | {"n_group": 3}))
    with pytest.raises(ModelFormatError, match="n_group"):
        load_model(dst)
