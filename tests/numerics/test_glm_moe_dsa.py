"""glm_moe_dsa (GLM-5) vs transformers' GlmMoeDsaForCausalLM: MLA over the latent paged cache, the DSA indexer
(index_topk 4, layers full/shared/full, so sequences longer than 4 are sparse), a dense first layer then MoE."""

import pytest
import torch
from transformers import DynamicCache, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from mlc.engine.kv_cache import KVCache
from mlc.errors import ModelFormatError
from mlc.layers.attention import KEY_QUANTUM
from mlc.layers.moe import SparseMoeBlock
from mlc.models.glm_moe_dsa import GlmMoeDsaForCausalLM as OurGlmMoeDsa
from mlc.models.glm_moe_dsa import latent_cache_spec
from mlc.models.loader import load_model
from tests.support.hf_reference import (
    Pair,
    assert_close,
    check_dense,
    hf_logits,
    mtp_layer_tensors,
    prompt,
    read_checkpoint,
    reference_model,
    to_fused_experts,
    write_checkpoint,
)
from tests.support.paged import PagedRunner, incremental_logits

LENGTHS = (3, 12, 40)  # 3 <= index_topk (DSA keeps every key); 12 and 40 are sparse
BATCH = (12, 3, 40, 7)
MIN_GAP = 1e-4  # smallest allowed gap between the k-th and (k+1)-th index score (fp32 noise is ~1e-6)
SEED = 4  # model seed; a seed whose prompts all have a clear top-k (checked by the tie test below)


def tiny_config(**overrides) -> GlmMoeDsaConfig:
    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                index_topk=4, index_head_dim=16, index_n_heads=2, indexer_types=["full", "shared", "full"],
                max_position_embeddings=256, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    return GlmMoeDsaConfig(**(args | overrides))


@torch.no_grad()
def separate_index_scores_(hf: GlmMoeDsaForCausalLM, seed: int = 0) -> None:
    """Keep indexer head 0's score positive for every (query, key), so ReLU never zeroes a whole index score:
    exact zeros tie, and torch.topk breaks ties differently for different context lengths, so dense and decode
    would disagree by chance. Hidden dim 0 carries a constant (embedding column 0; no layer writes to it),
    q_a_proj row 0 and head 0's pass rows of wq_b read only it, and a positive LayerNorm bias dominates the
    indexer key's pass dims. Everything else stays random."""
    gen = torch.Generator().manual_seed(seed)
    cfg = hf.config
    rope, dim = cfg.qk_rope_head_dim, cfg.index_head_dim
    hf.model.embed_tokens.weight[:, 0] = 4.0
    for layer in hf.model.layers:
        layer.input_layernorm.weight[0] = layer.input_layernorm.weight[0].abs() + 0.5
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj.weight[0] = 0
        if hasattr(mlp, "experts"):
            mlp.experts.down_proj[:, 0] = 0
            mlp.shared_experts.down_proj.weight[0] = 0
        else:
            mlp.down_proj.weight[0] = 0
        if attn.indexer is None:
            continue
        attn.q_a_proj.weight[0] = 0
        attn.q_a_proj.weight[0, 0] = 8.0
        attn.q_a_layernorm.weight[0] = attn.q_a_layernorm.weight[0].abs() + 0.5
        wq_b = attn.indexer.wq_b.weight
        wq_b[:rope] *= 0.2
        wq_b[rope:dim] = 0
        wq_b[rope:dim, 0] = 2.0 + torch.rand(dim - rope, generator=gen)
        attn.indexer.k_norm.weight[rope:] *= 0.1
        attn.indexer.k_norm.bias[rope:] = 1.0 + 0.2 * torch.rand(dim - rope, generator=gen)


def build_pair(path, seed: int = SEED, **overrides) -> Pair:
    hf = reference_model(GlmMoeDsaForCausalLM, tiny_config(**overrides), seed)
    separate_index_scores_(hf, seed)
    hf.save_pretrained(path)
    return Pair(hf, load_model(path), path)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("glm_moe_dsa"))


def batch_prompts() -> list[list[int]]:
    return [prompt(n, seed=i + 1) for i, n in enumerate(BATCH)]


def all_prompts() -> list[list[int]]:
    """Every sequence the tests below run."""
    return [prompt(n) for n in LENGTHS] + batch_prompts()


def indexers(model):
    return [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]


def record_index_scores(model, monkeypatch) -> list[torch.Tensor]:
    seen = []
    for indexer in indexers(model):
        original = indexer.index_scores

        def spy(*args, _original=original):
            seen.append(out := _original(*args))
            return out

        monkeypatch.setattr(indexer, "index_scores", spy)
    return seen


def smallest_topk_gap(scores: list[torch.Tensor], k: int) -> float:
    """Over all queries with more than k attendable keys: min of (k-th best - (k+1)-th best) index score."""
    gaps = []
    for s in scores:
        rows = s.flatten(0, 1)
        rows = rows[torch.isfinite(rows).sum(-1) > k]
        top = rows.topk(k + 1, dim=-1).values
        gaps.append(top[:, k - 1] - top[:, k])
    return float(torch.cat(gaps).min())


def test_layer_kinds_and_cache_layout(pair):
    layers = pair.ours.model.layers
    assert [layer.self_attn.indexer is not None for layer in layers] == [True, False, True]
    assert not isinstance(layers[0].mlp, SparseMoeBlock) and isinstance(layers[1].mlp, SparseMoeBlock)
    assert layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert pair.ours.kv_cache_spec() == [{"latent": (40,), "index_k": (16,)}, {"latent": (40,)},
                                         {"latent": (40,), "index_k": (16,)}]


def test_selection_is_tie_free_and_changes_the_output(pair, monkeypatch):
    """The parity below means something only if top-k has a clear winner set and actually drops keys."""
    seqs = all_prompts()
    scores = record_index_scores(pair.ours, monkeypatch)
    sparse = pair.ours.dense_logits(seqs)
    gap = smallest_topk_gap(scores, k=4)
    print(f"[dsa] smallest top-4 index-score gap {gap:.2e} over {sum(s.shape[1] for s in scores)} queries")
    assert gap > MIN_GAP
    for indexer in indexers(pair.ours):
        monkeypatch.setattr(indexer, "topk", 10**6)
    full = pair.ours.dense_logits(seqs)
    for seq, a, b in zip(seqs, sparse, full):
        changed = float((a - b).abs().max())
        assert changed > 1e-2 if len(seq) > 4 else changed == 0, f"length {len(seq)}: top-k changed logits by {changed}"


@pytest.mark.parametrize("length", LENGTHS)
def test_prompt_matches_transformers(pair, length):
    check_dense(pair, [prompt(length)])


def test_batch_of_different_lengths_matches_transformers(pair):
    check_dense(pair, batch_prompts())


@pytest.mark.parametrize("chunk", (1, 5))
def test_paged_latent_cache_decode_equals_dense(pair, chunk):
    seqs = batch_prompts()
    assert_close(incremental_logits(pair.ours, seqs, prefill=3, chunk=chunk), pair.ours.dense_logits(seqs),
                 f"glm_moe_dsa paged latent cache, chunk {chunk}")


def test_decode_gathers_only_the_selected_latent_slots(pair, monkeypatch):
    runner = PagedRunner(pair.ours, max_len=48, num_seqs=2)
    seqs = batch_prompts()[:2]  # lengths 12 and 3
    runner.step({0: seqs[0][:-1], 1: seqs[1][:-1]})
    gathered = []
    for layer in runner.cache.layers:
        def spy(slots, dtype, _original=layer["latent"].gather):
            gathered.append(tuple(slots.shape))
            return _original(slots, dtype)

        monkeypatch.setattr(layer["latent"], "gather", spy)
    runner.step({0: seqs[0][-1:], 1: seqs[1][-1:]})
    # contexts 3 and 12 decode in separate length groups: 12 gathers only its index_topk (4) selected latent slots;
    # 3 is within index_topk, so it attends its whole context, padded to KEY_QUANTUM like every decode group
    assert sorted(gathered) == sorted([(1, KEY_QUANTUM), (1, 4)] * 3)


def test_bf16_keeps_indexer_head_weights_fp32(pair):
    ours = load_model(pair.path, dtype="bf16")
    assert ours.model.layers[1].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert ours.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    steps = incremental_logits(ours, batch_prompts(), prefill=3, chunk=5)
    assert all(torch.isfinite(s).all() for s in steps)


@torch.inference_mode()
def hf_incremental_logits(hf, tokens: list[int], prefill: int) -> torch.Tensor:
    """transformers' own decode: prefill, then one token a step through its DynamicCache (expanded K/V and
    indexer keys), so each step's top-k runs over every earlier key as ours does."""
    cache = DynamicCache(config=hf.config)
    ids = torch.tensor([tokens])
    out = [hf(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits[0]]
    for t in range(prefill, len(tokens)):
        out.append(hf(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(out).float()


def test_decode_matches_transformers_incremental_decode(pair):
    seqs = [prompt(40), batch_prompts()[0]]
    want = [hf_incremental_logits(pair.hf, s, prefill=3) for s in seqs]
    assert_close(want, [hf_logits(pair.hf, s) for s in seqs], "transformers: cached decode vs its dense forward")
    assert_close(incremental_logits(pair.ours, seqs, prefill=3, chunk=1), want,
                 "glm_moe_dsa paged decode vs transformers cached decode")


def _reloaded(pair: Pair, dst, tensors) -> Pair:
    return Pair(pair.hf, load_model(write_checkpoint(pair.path, dst, tensors)), dst)


def test_hub_layout_with_mtp_layer_loads_and_matches(pair, tmp_path):
    tensors = read_checkpoint(pair.path)  # save_pretrained writes the hub's per-expert layout
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in tensors
    tensors |= mtp_layer_tensors(tensors, source_layer=2, mtp_layer=pair.hf.config.num_hidden_layers)
    check_dense(_reloaded(pair, tmp_path / "hub", tensors), [prompt(40), prompt(12)])


def test_fused_expert_layout_loads_and_matches(pair, tmp_path):
    tensors = to_fused_experts(read_checkpoint(pair.path))
    assert tensors["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    check_dense(_reloaded(pair, tmp_path / "fused", tensors), [prompt(40)])


def test_checkpoint_without_indexer_weights_is_rejected(pair, tmp_path):
    tensors = {n: t for n, t in read_checkpoint(pair.path).items() if "layers.2.self_attn.indexer" not in n}
    with pytest.raises(ModelFormatError, match="indexer"):
        load_model(write_checkpoint(pair.path, tmp_path / "noindexer", tensors))


@pytest.mark.parametrize("overrides, match", [
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"indexer_types": ["shared", "full", "full"]}, "indexer_types"),
    ({"indexer_types": ["full", "full"]}, "indexer_types"),
])
def test_inconsistent_config_is_rejected(overrides, match):
    with pytest.raises(ModelFormatError, match=match):
        OurGlmMoeDsa(tiny_config(**overrides))


def test_glm5_latent_cache_bytes_per_token():
    """GLM-5: 576 latent values per token and layer (+128 indexer-key values on full layers), vs the 32,768 of
    transformers' expanded K/V."""
    glm5 = GlmMoeDsaConfig()  # defaults are GLM-5's: 78 layers, kv_lora_rank 512, rope 64, index_head_dim 128
    spec = latent_cache_spec(glm5)
    assert spec[0] == {"latent": (576,), "index_k": (128,)} and len(spec) == 78
    assert KVCache.bytes_per_token_for(spec[:1], torch.bfloat16) == 1408
    assert KVCache.bytes_per_token_for(spec, torch.bfloat16) == 78 * 1408
    glm52 = GlmMoeDsaConfig(indexer_types=["full"] * 21 + ["shared"] * 57)
    assert KVCache.bytes_per_token_for(latent_cache_spec(glm52), torch.bfloat16) == 21 * 1408 + 57 * 1152
