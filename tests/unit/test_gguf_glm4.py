"""GLM-4-0414 GGUFs (architecture glm4) convert and load like llama ones: a tiny random HF Glm4ForCausalLM is
written as llama.cpp's converter writes it (fused ffn_up, sandwich norms, q/k rows unpermuted, attention biases)
with the `gguf` package, and its logits through mlc match transformers'."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as lib_dequantize
from gguf.quants import quantize as lib_quantize

from mlc.errors import ModelFormatError
from mlc.models.gguf.convert import convert_gguf
from tests.support.gguf_files import byte_vocab, gguf_name, write_gguf

TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96)
# HF Glm4 module -> llama.cpp tensor (gguf/tensor_mapping.py, "glm-4-0414")
HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_self_attn_layernorm": "post_attention_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "post_mlp_layernorm": "post_ffw_norm",
}


def tiny_hf_glm4(vocab_size: int):
    from transformers import Glm4Config, Glm4ForCausalLM

    torch.manual_seed(0)
    cfg = Glm4Config(
        vocab_size=vocab_size, hidden_size=TINY["hidden"], intermediate_size=TINY["ffn"],
        num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"], num_key_value_heads=TINY["kv_heads"],
        head_dim=TINY["head_dim"], max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        attention_bias=True, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    model = Glm4ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def write_tiny_glm4_gguf(path: Path, quant: dict[str, Q] | None = None, extra_meta=None):
    tokens, merges, types = byte_vocab()
    model = tiny_hf_glm4(len(tokens))
    tensors = {}
    for name, p in model.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        gname = gguf_name(name, HF_TO_GGUF)
        qtype = (quant or {}).get(gname)
        tensors[gname] = (lib_quantize(w, qtype), qtype) if qtype is not None else (w, None)
    meta = {
        "add_context_length": 512, "add_embedding_length": TINY["hidden"], "add_block_count": TINY["layers"],
        "add_feed_forward_length": TINY["ffn"], "add_head_count": TINY["heads"], "add_head_count_kv": TINY["kv_heads"],
        "add_key_length": TINY["head_dim"], "add_value_length": TINY["head_dim"],
        "add_rope_dimension_count": TINY["head_dim"] // 2, "add_rope_freq_base": 10000.0,
        "add_layer_norm_rms_eps": 1e-5, "add_vocab_size": len(tokens), "add_tokenizer_model": "gpt2",
        "add_tokenizer_pre": "glm4", "add_token_list": (tokens,), "add_token_types": (types,),
        "add_token_merges": (merges,), "add_eos_token_id": 2, "add_pad_token_id": 0, "add_add_bos_token": False,
        **(extra_meta or {}),
    }
    write_gguf(path, tensors, arch="glm4", meta=meta)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm4")
    model = write_tiny_glm4_gguf(root / "tiny.gguf", quant={"blk.1.ffn_up.weight": Q.Q8_0})
    report = convert_gguf(root / "tiny.gguf", root / "hf")
    return model, root / "hf", report


def test_config_is_glm4(tiny):
    model, out, report = tiny
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "glm4" and cfg["architectures"] == ["Glm4ForCausalLM"]
    assert cfg["rope_parameters"] == {"partial_rotary_factor": 0.5, "rope_type": "default", "rope_theta": 10000.0}
    assert cfg["attention_bias"] is True and cfg["tie_word_embeddings"] is False and cfg["head_dim"] == 16
    assert report.architecture == "glm4" and report.unmapped_keys == []
    assert report.tensor_types == {"F32": len(model.state_dict()) - 1, "Q8_0": 1}


def test_logits_match_transformers(tiny):
    from transformers import AutoModelForCausalLM

    from mlc.models.loader import load_model

    model, out, _ = tiny
    ids = [5, 70, 80, 200, 9, 1, 33, 120]
    with torch.no_grad():
        up = model.model.layers[1].mlp.gate_up_proj.weight
        up.copy_(torch.from_numpy(np.array(lib_dequantize(lib_quantize(up.numpy(), Q.Q8_0), Q.Q8_0))))
        ref = model(torch.tensor([ids])).logits[0]
        # transformers reads the converted dir back as the same model
        back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        assert (back(torch.tensor([ids])).logits[0] - ref).abs().max().item() < 1e-5
    ours = load_model(out).dense_logits([ids])[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_nextn_glm4_is_refused(tmp_path):
    path = tmp_path / "mtp.gguf"
    write_tiny_glm4_gguf(path, extra_meta={"add_nextn_predict_layers": 1})
    with pytest.raises(ModelFormatError, match="multi-token-prediction"):
        convert_gguf(path, tmp_path / "out")
