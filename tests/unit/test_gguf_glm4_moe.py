"""GLM-4.5 GGUFs (llama.cpp architecture glm4moe) convert and load: a tiny random HF Glm4MoeForCausalLM (a dense
first layer, then MoE layers with the shared expert, a non-zero correction bias, q/k norms and half-split partial
rope) is written as llama.cpp's converter writes it (experts stacked per projection, `post_attention_norm`,
`exp_probs_b.bias`, q/k rows not permuted, one trailing NextN layer counted in block_count) with the `gguf`
package; through mlc its logits match transformers' and greedy decoding picks the same tokens."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import ExpertGatingFuncType
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as lib_dequantize
from gguf.quants import quantize as lib_quantize

from mlc.errors import ModelFormatError
from mlc.models.gguf.convert import convert_gguf
from tests.support.gguf_files import byte_vocab, write_gguf
from tests.support.kernel_marks import needs_cpu_kernels

TINY = dict(hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, ffn=96, moe_ffn=32, experts=4, top_k=2)
IDS = [5, 70, 80, 200, 9, 1, 33, 120]
# HF Glm4Moe module -> llama.cpp tensor (gguf-py tensor_mapping for MODEL_ARCH.GLM4_MOE)
HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}


def tiny_hf_glm4_moe(vocab_size: int):
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    cfg = Glm4MoeConfig(
        vocab_size=vocab_size, hidden_size=TINY["hidden"], intermediate_size=TINY["ffn"],
        moe_intermediate_size=TINY["moe_ffn"], num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"],
        num_key_value_heads=TINY["kv_heads"], head_dim=TINY["head_dim"], attention_bias=True, use_qk_norm=True,
        n_routed_experts=TINY["experts"], num_experts_per_tok=TINY["top_k"], n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-5,
        max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = Glm4MoeForCausalLM(cfg).eval()
    saved = set(model.state_dict())
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every saved tensor random, the correction bias included (HF inits it to zeros)
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            if name in saved:
                t.copy_(torch.randn(t.shape, generator=gen) * 0.2)
    return model


def gguf_tensors(model, nextn: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The tensors llama.cpp's converter writes for `model`, plus a NextN layer after the last decoder layer
    (`nextn`, under llama.cpp's names; by default a random one)."""
    out: dict[str, np.ndarray] = {}
    for name, p in model.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        if not name.startswith("model.layers."):
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name]] = w
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if rest == "mlp.experts.gate_up_proj":  # [E, 2I, H] -> two stacked [E, I, H]
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = np.split(w, 2, axis=1)
        elif rest == "mlp.experts.down_proj":
            out[f"blk.{layer}.ffn_down_exps.weight"] = w
        elif rest == "mlp.gate.e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = w
        else:
            module, suffix = rest.rsplit(".", 1)
            out[f"blk.{layer}.{HF_TO_GGUF[module]}.{suffix}"] = w
    if nextn is not None:
        return {**out, **nextn}
    rng = np.random.default_rng(1)
    last, mtp = TINY["layers"] - 1, TINY["layers"]
    for name in [n for n in out if n.startswith(f"blk.{last}.")]:
        out[name.replace(f"blk.{last}.", f"blk.{mtp}.", 1)] = rng.normal(0, 0.2, out[name].shape).astype(np.float32)
    h = TINY["hidden"]
    out[f"blk.{mtp}.nextn.eh_proj.weight"] = rng.normal(0, 0.2, (h, 2 * h)).astype(np.float32)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        out[f"blk.{mtp}.nextn.{norm}.weight"] = np.ones(h, np.float32)
    return out


def write_tiny_glm4_moe_gguf(path: Path, quant: dict[str, Q] | None = None, extra_meta=None, drop=(), pad=1,
                             nextn: dict[str, np.ndarray] | None = None):
    """`pad`: the vocabulary padded to a multiple of it (16: the head fits the gguf kernel's tiles); `nextn`: the
    NextN layer's tensors (`gguf_tensors`)."""
    tokens, merges, types = byte_vocab()
    extra = -len(tokens) % pad
    tokens, types = tokens + [f"<|extra_{i}|>" for i in range(extra)], types + [3] * extra
    model = tiny_hf_glm4_moe(len(tokens))
    tensors = {}
    for gname, w in gguf_tensors(model, nextn).items():
        if gname in drop:
            continue
        qtype = (quant or {}).get(gname)
        tensors[gname] = (lib_quantize(w, qtype), qtype) if qtype is not None else (w, None)
    meta = {
        "add_context_length": 512, "add_embedding_length": TINY["hidden"], "add_block_count": TINY["layers"] + 1,
        "add_feed_forward_length": TINY["ffn"], "add_head_count": TINY["heads"], "add_head_count_kv": TINY["kv_heads"],
        "add_key_length": TINY["head_dim"], "add_value_length": TINY["head_dim"],
        "add_rope_dimension_count": TINY["head_dim"] // 2, "add_rope_freq_base": 10000.0,
        "add_layer_norm_rms_eps": 1e-5, "add_expert_count": TINY["experts"], "add_expert_used_count": TINY["top_k"],
        "add_expert_shared_count": 1, "add_expert_feed_forward_length": TINY["moe_ffn"],
        "add_leading_dense_block_count": 1, "add_expert_weights_scale": 2.5, "add_expert_weights_norm": True,
        "add_expert_gating_func": ExpertGatingFuncType.SIGMOID, "add_nextn_predict_layers": 1,
        "add_vocab_size": len(tokens), "add_tokenizer_model": "gpt2", "add_tokenizer_pre": "glm4",
        "add_token_list": (tokens,), "add_token_types": (types,), "add_token_merges": (merges,),
        "add_eos_token_id": 2, "add_pad_token_id": 0, "add_add_bos_token": False,
        **(extra_meta or {}),
    }
    write_gguf(path, tensors, arch="glm4moe", meta=meta)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One routed-expert projection stored as Q8_0 (the HF reference gets the same rounding)."""
    root = tmp_path_factory.mktemp("glm4moe")
    model = write_tiny_glm4_moe_gguf(root / "tiny.gguf", quant={"blk.2.ffn_down_exps.weight": Q.Q8_0})
    with torch.no_grad():
        down = model.model.layers[2].mlp.experts.down_proj
        down.copy_(torch.from_numpy(np.array(lib_dequantize(lib_quantize(down.numpy(), Q.Q8_0), Q.Q8_0))))
    report = convert_gguf(root / "tiny.gguf", root / "hf")
    return model, root / "hf", report


def test_config_is_glm4_moe(tiny):
    model, out, report = tiny
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["architectures"] == ["Glm4MoeForCausalLM"]
    assert cfg["num_hidden_layers"] == 3 and cfg["num_nextn_predict_layers"] == 1  # declared; read only for "mtp"
    assert cfg["rope_parameters"] == {"partial_rotary_factor": 0.5, "rope_type": "default", "rope_theta": 10000.0}
    want = dict(first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                moe_intermediate_size=32, intermediate_size=96, routed_scaling_factor=2.5, norm_topk_prob=True,
                n_group=1, topk_group=1, use_qk_norm=True, attention_bias=True, head_dim=16,
                tie_word_embeddings=False)
    assert {k: cfg[k] for k in want} == want
    assert report.architecture == "glm4moe" and report.unmapped_keys == []
    assert report.tensor_types["Q8_0"] == 1


def test_weights_are_the_hf_ones(tiny):
    from safetensors.numpy import load_file

    model, out, _ = tiny
    got = load_file(str(out / "model.safetensors"))
    want = {k: v.numpy() for k, v in model.state_dict().items()}
    assert set(got) == set(want)  # nothing of the NextN layer, nothing missing
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=0, atol=1e-6, err_msg=name)


def test_logits_match_transformers(tiny):
    from transformers import AutoModelForCausalLM

    from mlc.models.loader import load_model

    model, out, _ = tiny
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0]
        back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()  # transformers reads it too
        assert (back(torch.tensor([IDS])).logits[0] - ref).abs().max().item() < 1e-5
    ours = load_model(out, dtype="float32").dense_logits([IDS])[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_gguf_file_serves_greedy_tokens_like_transformers(tmp_path, monkeypatch):
    """The user's path: `LLM(model="x.gguf")` converts into the store, then paged decoding picks HF's argmax."""
    from mlc import LLM, SamplingParams

    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    model = write_tiny_glm4_moe_gguf(tmp_path / "x.gguf")  # all F32: the store keeps fp32 weights
    ids, steps = IDS[:5], 8
    with torch.no_grad():
        want = list(ids)
        for _ in range(steps):
            want.append(int(model(torch.tensor([want])).logits[0, -1].argmax()))
    llm = LLM(model=str(tmp_path / "x.gguf"), dtype="float32", kv_cache_memory="8MiB", max_seq_len=64)
    out = llm.generate([ids], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))[0]
    assert list(out.outputs[0].token_ids) == want[len(ids):]


def test_softmax_gating_is_refused(tmp_path):
    path = tmp_path / "softmax.gguf"
    write_tiny_glm4_moe_gguf(path, extra_meta={"add_expert_gating_func": ExpertGatingFuncType.SOFTMAX})
    with pytest.raises(ModelFormatError, match="sigmoid"):
        convert_gguf(path, tmp_path / "out")


def test_half_of_the_stacked_experts_is_refused(tmp_path):
    path = tmp_path / "half.gguf"
    write_tiny_glm4_moe_gguf(path, drop={"blk.1.ffn_up_exps.weight"})
    with pytest.raises(ModelFormatError, match=r"layer 1 .*ffn_up_exps.*incomplete"):
        convert_gguf(path, tmp_path / "out")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)}, arch="qwen3moe")
    with pytest.raises(ModelFormatError, match=r"'qwen3moe' is not supported; mlc converts llama, glm4, glm4moe GGUFs"):
        convert_gguf(path, tmp_path / "out")


def _quantized_file(path: Path, kind, **override) -> None:
    """Every matrix in `kind` but the router's (llama.cpp keeps ffn_gate_inp in F32) and the embedding."""
    names = gguf_tensors(tiny_hf_glm4_moe(len(byte_vocab()[0])))
    quant = {n: kind for n, w in names.items() if w.ndim >= 2 and "nextn" not in n and "ffn_gate_inp" not in n}
    write_tiny_glm4_moe_gguf(path, quant={**quant, **override}, pad=16)


def _experts_close(ours, reference, layer: int) -> None:
    """Layer `layer`'s experts on the same tokens and routing as the float reference, within the activations'
    rounding."""
    torch.manual_seed(layer)
    x = torch.randn(7, TINY["hidden"])
    ids = torch.randint(0, TINY["experts"], (7, TINY["top_k"]))
    weights = torch.rand(7, TINY["top_k"])
    with torch.no_grad():
        got = ours.model.layers[layer].mlp.experts(x, ids, weights)
        want = reference.model.layers[layer].mlp.experts(x, ids, weights)
    assert ((got - want).norm() / want.norm()).item() < 1e-4


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0])
@needs_cpu_kernels  # the gguf kernel serves the experts' blocks
def test_routed_experts_are_served_from_their_stacked_blocks(kind, tmp_path, monkeypatch):
    """As llama.cpp's files are quantized: each expert is a pair of GGUFLinears over slices of the stacks, equal to
    the same file's experts dequantized within the activations' rounding, and the model predicts as that one."""
    from mlc.layers.gguf_linear import GGUFLinear
    from mlc.layers.quant_moe import QuantizedExperts
    from mlc.models.loader import load_model

    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    _quantized_file(tmp_path / "q.gguf", kind)
    model = load_model(str(tmp_path / "q.gguf"), dtype="float32")
    reference = load_model(str(tmp_path / "q.gguf"), dtype="float32", weight_dtype="fp32")
    for layer in (1, 2):
        experts = model.model.layers[layer].mlp.experts
        assert isinstance(experts, QuantizedExperts) and experts.n_experts == TINY["experts"]
        assert all(isinstance(m, GGUFLinear) and m.kernel == f"gguf-{kind.name}"
                   for m in (*experts.gate_up, *experts.down))
        _experts_close(model, reference, layer)
    assert model.weight_info.startswith(f"the GGUF's own {kind.name} blocks (gguf kernel, ")
    ours, want = model.dense_logits([IDS])[0], reference.dense_logits([IDS])[0]
    assert ((ours - want).norm() / want.norm()).item() < 1e-4
    assert torch.equal(ours.argmax(-1), want.argmax(-1))


@needs_cpu_kernels  # the gguf kernel serves the other layer's experts
def test_a_layer_whose_stacks_the_kernel_cannot_read_is_dequantized(tmp_path, monkeypatch):
    """Layer 2's down stack in F16: that layer's experts are loaded as floats and quantized as the file's body
    (int8 for a Q8_0 file); layer 1's are served from their blocks."""
    from mlc.layers.gguf_linear import GGUFLinear
    from mlc.layers.quant_linear import Int8Linear
    from mlc.layers.quant_moe import QuantizedExperts
    from mlc.models.loader import load_model

    monkeypatch.setenv("MLC_HOME", str(tmp_path / "home"))
    _quantized_file(tmp_path / "m.gguf", Q.Q8_0, **{"blk.2.ffn_down_exps.weight": Q.F16})
    model = load_model(str(tmp_path / "m.gguf"), dtype="float32")
    served, loaded = model.model.layers[1].mlp.experts, model.model.layers[2].mlp.experts
    assert isinstance(served.down[0], GGUFLinear)
    assert isinstance(loaded, QuantizedExperts) and isinstance(loaded.down[0], Int8Linear)
    reference = load_model(str(tmp_path / "m.gguf"), dtype="float32", weight_dtype="fp32")
    _experts_close(model, reference, 1)
    ours, want = model.dense_logits([IDS])[0], reference.dense_logits([IDS])[0]
    assert ((ours - want).norm() / want.norm()).item() < 1e-2  # layer 2's experts requantized to int8
    assert torch.equal(ours.argmax(-1), want.argmax(-1))
