"""Our GGUF reader: dequantization, the q/k rope permutation, config + weights of a synthetic llama GGUF against the
HF model it was written from, and the rebuilt tokenizer against transformers' GGUF tokenizer path."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as lib_dequantize
from gguf.quants import quantize as lib_quantize

from mlc.errors import ModelFormatError
from mlc.models.gguf.convert import (
    convert_gguf,
    dequantize_tensor,
    hf_tensor_name,
    open_gguf,
    permute_rope_rows,
    unpermute_rope_rows,
)
from mlc.models.gguf.tokenizer import build_tokenizer
from tests.support.gguf_files import TINY, byte_vocab, llama_cpp_permute, write_gguf, write_tiny_llama_gguf

GPL3 = Path("/usr/share/common-licenses/GPL-3")


def read_single(path: Path):
    return open_gguf(path).reader.tensors[0]


# dequantization
def test_q8_0_block_is_scale_times_int8(tmp_path):
    q = np.arange(-16, 16, dtype=np.int8)
    block = np.float16(0.25).tobytes() + q.tobytes()
    raw = np.frombuffer(block * 2, dtype=np.uint8).reshape(2, 34)
    t = read_single(write_gguf(tmp_path / "q8.gguf", {"w": (raw, Q.Q8_0)}))
    out = dequantize_tensor(t)
    assert out.shape == (2, 32) and out.dtype == np.float32
    np.testing.assert_array_equal(out[1], 0.25 * q.astype(np.float32))


def test_q4_1_block_is_scale_times_nibble_plus_min(tmp_path):
    nibbles = np.arange(32) % 16  # element j < 16 is byte j's low nibble, element j + 16 its high nibble
    packed = (nibbles[:16] | (nibbles[16:] << 4)).astype(np.uint8)
    block = np.float16(0.5).tobytes() + np.float16(-2.0).tobytes() + packed.tobytes()
    t = read_single(write_gguf(tmp_path / "q41.gguf", {"w": (np.frombuffer(block, np.uint8).reshape(1, 20), Q.Q4_1)}))
    np.testing.assert_array_equal(dequantize_tensor(t)[0], 0.5 * nibbles - 2.0)


def test_q4_0_block_is_scale_times_centered_nibble(tmp_path):
    nibbles = (np.arange(32) * 7) % 16
    packed = (nibbles[:16] | (nibbles[16:] << 4)).astype(np.uint8)
    block = np.float16(1.5).tobytes() + packed.tobytes()
    t = read_single(write_gguf(tmp_path / "q40.gguf", {"w": (np.frombuffer(block, np.uint8).reshape(1, 18), Q.Q4_0)}))
    np.testing.assert_array_equal(dequantize_tensor(t)[0], 1.5 * (nibbles - 8))


@pytest.mark.parametrize(
    "qtype, rel_err",
    [(Q.F16, 1e-3), (Q.BF16, 1e-2), (Q.Q8_0, 1e-2), (Q.Q5_0, 0.07), (Q.Q5_1, 0.04), (Q.Q4_0, 0.15), (Q.Q4_1, 0.08)],
)
def test_quant_round_trip(tmp_path, qtype, rel_err):
    rng = np.random.default_rng(int(qtype))
    w = rng.standard_normal((8, 64)).astype(np.float32)
    data = w.astype(np.float16) if qtype == Q.F16 else lib_quantize(w, qtype)
    t = read_single(write_gguf(tmp_path / "rt.gguf", {"w": (data, None if qtype == Q.F16 else qtype)}))
    out = dequantize_tensor(t)
    assert out.shape == w.shape
    np.testing.assert_array_equal(out, lib_dequantize(data.view(np.uint8) if qtype != Q.F16 else data, qtype)
                                  .reshape(w.shape))
    block_max = np.abs(w.reshape(8, -1, 32)).max(-1, keepdims=True)
    assert (np.abs(out - w).reshape(8, -1, 32) <= rel_err * block_max + 1e-6).all()


def test_f32_tensor_is_a_writable_copy(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = dequantize_tensor(read_single(write_gguf(tmp_path / "f.gguf", {"w": (w, None)})))
    np.testing.assert_array_equal(out, w)
    out[0, 0] = 99.0  # the memmap stays untouched


def test_unsupported_quant_names_tensor_and_type(tmp_path):
    raw = np.zeros((4, 40), dtype=np.uint8)  # one Q8_1 block (40 bytes) per row
    path = write_gguf(tmp_path / "q81.gguf", {"blk.0.attn_q.weight": (raw, Q.Q8_1)})
    with pytest.raises(ModelFormatError, match=r"blk\.0\.attn_q\.weight.*Q8_1"):
        dequantize_tensor(read_single(path))


# permutation and names
def test_unpermute_matches_known_layout():
    rows = np.arange(4, dtype=np.float32)  # one head of 4: HF pairs (0, 2) and (1, 3); llama.cpp interleaves them
    np.testing.assert_array_equal(llama_cpp_permute(rows, 1), [0, 2, 1, 3])
    np.testing.assert_array_equal(unpermute_rope_rows(np.array([0, 2, 1, 3], np.float32), 1), rows)


@pytest.mark.parametrize("heads, head_dim, cols", [(9, 64, 576), (3, 64, 576), (4, 16, 1), (2, 8, 0)])
def test_permutation_inverse(heads, head_dim, cols):
    shape = (heads * head_dim, cols) if cols else (heads * head_dim,)
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.testing.assert_array_equal(permute_rope_rows(w, heads), llama_cpp_permute(w, heads))
    np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w, heads), heads), w)
    assert not np.array_equal(permute_rope_rows(w, heads), w)


def test_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None


# a synthetic llama GGUF, converted, against the HF model it came from
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = write_tiny_llama_gguf(root / "tiny.gguf", quant={"blk.1.ffn_up.weight": Q.Q8_0})
    report = convert_gguf(root / "tiny.gguf", root / "hf")
    return model, root / "hf", report


def test_config_from_metadata(tiny_gguf):
    model, out, report = tiny_gguf
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (64, 2, 96)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["max_position_embeddings"] == 512
    assert cfg["tie_word_embeddings"] is True and cfg["vocab_size"] == model.config.vocab_size
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2,
                                                                        "pad_token_id": 0}
    assert report.tensor_types == {"F32": 19, "Q8_0": 1} and report.unmapped_keys == []


def test_weights_return_to_hf_layout(tiny_gguf):
    from safetensors.torch import load_file

    model, out, _ = tiny_gguf
    ours = load_file(str(out / "model.safetensors"))
    ref = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert set(ours) == set(ref)
    for name, value in ref.items():
        if name == "model.layers.1.mlp.up_proj.weight":
            expected = lib_dequantize(lib_quantize(value.numpy(), Q.Q8_0), Q.Q8_0)
            np.testing.assert_array_equal(ours[name].numpy(), expected)
        else:
            assert torch.equal(ours[name], value), name
        assert ours[name].dtype == torch.float32


def test_converted_model_matches_hf_logits(tiny_gguf):
    from mlc.models.loader import load_model

    model, out, _ = tiny_gguf
    model = copy.deepcopy(model)  # the fixture's model stays as written
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.copy_(torch.from_numpy(np.array(
            lib_dequantize(lib_quantize(model.model.layers[1].mlp.up_proj.weight.numpy(), Q.Q8_0), Q.Q8_0))))
        ids = [5, 70, 80, 200, 9, 1, 33, 120]
        ref = model(torch.tensor([ids])).logits[0]
    ours = load_model(out).dense_logits([ids])[0]
    assert (ours - ref).abs().max().item() < 1e-4


def test_converted_tokenizer_loads_with_template(tiny_gguf):
    from mlc.models.tokenizer import load_tokenizer, render_chat

    _, out, _ = tiny_gguf
    tok = load_tokenizer(out)
    text = render_chat(tok, [{"role": "user", "content": "the and"}])
    assert text == "<|im_start|>user\nthe and<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == 1 and 2 in ids  # control tokens stay whole
    assert tok.decode(ids) == text


def test_rope_scaling_metadata(tmp_path):
    from gguf import RopeScalingType

    from mlc.models.gguf.convert import hf_config

    meta = {"add_rope_scaling_type": RopeScalingType.LINEAR, "add_rope_scaling_factor": 2.0}
    write_tiny_llama_gguf(tmp_path / "linear.gguf", extra_meta=meta)
    cfg, _ = hf_config(open_gguf(tmp_path / "linear.gguf"))
    assert cfg["rope_parameters"] == {"rope_type": "linear", "rope_theta": 50000.0, "factor": 2.0}


def test_llama3_rope_factors_are_recovered(tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mlc.models.gguf.llama_config import _llama3_factors, hf_config

    dim = TINY["head_dim"]
    inv_freq = 1.0 / 50000.0 ** (np.arange(0, dim, 2) / dim)
    factors = _llama3_factors(inv_freq, 8.0, 1.0, 4.0, 8192).astype(np.float32)
    assert 1.0 < factors[5] < 8.0  # one frequency falls in the smoothed band
    write_tiny_llama_gguf(tmp_path / "l3.gguf", extra_tensors={"rope_freqs.weight": (factors, None)})
    cfg, _ = hf_config(open_gguf(tmp_path / "l3.gguf"))
    params = cfg["rope_parameters"]
    assert params == {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=dim, rope_parameters=params)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, torch.device("cpu"))
    np.testing.assert_allclose(hf_inv_freq.numpy(), inv_freq / factors, rtol=1e-5)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)}, arch="qwen2")
    with pytest.raises(ModelFormatError, match="architecture 'qwen2' is not supported"):
        convert_gguf(path, tmp_path / "out")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelFormatError, match="is not a GGUF file"):
        open_gguf(bad)


def test_truncated_gguf(tmp_path):
    path = tmp_path / "t.gguf"
    write_tiny_llama_gguf(path)
    path.write_bytes(path.read_bytes()[:-5000])
    with pytest.raises(ModelFormatError, match="the file is truncated: download it again"):
        open_gguf(path)


# tokenizer parity on the real SmolLM2 GGUF
@pytest.fixture(scope="module")
def smollm_tokenizers():
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from mlc.models.store import KNOWN_MODELS, gguf_source_file

    path = gguf_source_file(KNOWN_MODELS["smollm2-135m-instruct"])
    ours = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(open_gguf(path)))
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers' GGUF path ignores tokenizer.ggml.pre='smollm'; the original SmolLM2 tokenizer.json (and
    # llama.cpp) split digits out first, so compare against it with that pre-tokenizer as well
    backend = Tokenizer.from_str(theirs.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    original = PreTrainedTokenizerFast(tokenizer_object=backend)
    return ours, theirs, original


CHATS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\n你是一个乐于助人的助手。<|im_end|>\n<|im_start|>user\n请用中文介绍一下北京的历史，"
    "包括2008年的奥运会。<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nTranslate 'good morning' into French, Spanish and 日本語.<|im_end|>\n<|im_start|>assistant\n",
]


def test_tokenizer_matches_original_smollm2_on_gpl3(smollm_tokenizers):
    ours, _, original = smollm_tokenizers
    text = GPL3.read_text()
    ids = ours(text)["input_ids"]
    assert ids == original(text)["input_ids"]
    assert len(ids) > 7000 and ours.decode(ids) == text


@pytest.mark.parametrize("text", CHATS)
def test_tokenizer_matches_transformers_gguf_on_chat_prompts(smollm_tokenizers, text):
    ours, theirs, original = smollm_tokenizers
    ids = ours(text)["input_ids"]
    assert ids == theirs(text)["input_ids"] == original(text)["input_ids"]
    assert ids[0] == 1 and ours.decode(ids) == text


def test_digits_split_like_llama_cpp_smollm(smollm_tokenizers):
    ours, theirs, _ = smollm_tokenizers
    # llama.cpp isolates every digit first, so the space run before "0" stays one piece
    assert ours.convert_ids_to_tokens(ours("\n\n  0.")["input_ids"]) == ["ĊĊĠĠ", "0", "."]
    assert theirs.convert_ids_to_tokens(theirs("\n\n  0.")["input_ids"]) == ["ĊĊĠ", "Ġ", "0", "."]
    assert ours.convert_ids_to_tokens(ours("year 2007")["input_ids"]) == ["year", "Ġ", "2", "0", "0", "7"]


# SentencePiece vocabularies
def test_sentencepiece_vocab_matches_transformers(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    pieces = ["▁", "t", "h", "e", "a", "n", "d", "▁t", "he", "▁the", "an", "▁an", "▁and", "▁a", "c", "▁c", "at",
              "▁cat", "s", "o", "▁s", "▁o", "on", "▁on"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    meta = {"add_tokenizer_model": "llama", "add_token_list": (tokens,), "add_token_types": (types,),
            "add_token_scores": (scores,), "add_bos_token_id": 1, "add_eos_token_id": 2, "add_unk_token_id": 0,
            "add_add_bos_token": True, "add_add_space_prefix": True}
    path = write_gguf(tmp_path / "spm.gguf", {"token_embd.weight": (np.zeros((len(tokens), 4), np.float32), None)},
                      meta=meta)
    ours = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(open_gguf(path)))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["the cat sat on the mat", "and a cat", " leading space", "ünïcode → bytes 7", "the\nand"]:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text
        if not text.startswith(" "):  # like SentencePiece, decoding drops the one prefix space it added
            assert ours.decode(ours(text)["input_ids"], skip_special_tokens=True) == text
    assert ours("the cat")["input_ids"][:1] == [1]


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    tokens, merges, types = byte_vocab()
    meta = {"add_tokenizer_model": "gpt2", "add_tokenizer_pre": "made-up", "add_token_list": (tokens,),
            "add_token_types": (types,), "add_token_merges": (merges,)}
    path = write_gguf(tmp_path / "p.gguf", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)}, meta=meta)
    with pytest.raises(ModelFormatError, match="pre-tokenizer 'made-up'"):
        build_tokenizer(open_gguf(path))


# the real default model against transformers' GGUF loader (about 15-35 s)
@pytest.mark.slow
def test_default_model_weights_match_transformers_gguf_loader(default_model_dir):
    from transformers import AutoModelForCausalLM

    from mlc.models.hf_checkpoint import checkpoint_tensors
    from mlc.models.store import KNOWN_MODELS, gguf_source_file

    path = gguf_source_file(KNOWN_MODELS["smollm2-135m-instruct"])
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ours = dict(checkpoint_tensors(default_model_dir))  # the store's GGUF, dequantized as every float path reads it
    state = ref.state_dict()
    assert set(ours) == set(state) - {"lm_head.weight"}
    for name, value in ours.items():
        assert torch.equal(value, state[name]), name
