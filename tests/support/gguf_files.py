"""Write GGUF files the way llama.cpp's converter does (`gguf` package): a raw writer, a small byte-level BPE
vocabulary, and a tiny random HF llama written out with llama.cpp's names and q/k permutation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize as lib_quantize

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out independently of ours."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q | None]], arch: str = "llama", meta=None) -> Path:
    """Tensors as (array, raw type): None writes the array as F32/F16; a type means the array holds its bytes."""
    w = GGUFWriter(str(path), arch)
    for key, value in (meta or {}).items():
        getattr(w, key)(*value) if isinstance(value, tuple) else getattr(w, key)(value)
    for name, (data, raw) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_vocab() -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE vocabulary: 3 control tokens, the 256 byte symbols, a few merges."""
    from mlc.models.gguf.tokenizer import byte_alphabet

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġa n", "Ġan d"]
    tokens = specials + list(byte_alphabet().values()) + [m.replace(" ", "") for m in merges]
    return tokens, merges, [3] * len(specials) + [1] * (len(tokens) - len(specials))


TINY = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=96)


def tiny_hf_llama(vocab_size: int, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=TINY["hidden"], intermediate_size=TINY["ffn"],
        num_hidden_layers=TINY["layers"], num_attention_heads=TINY["heads"], num_key_value_heads=TINY["kv_heads"],
        head_dim=TINY["head_dim"], max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str, modules: dict[str, str] = HF_TO_GGUF) -> str:
    """llama.cpp's tensor name for an HF one, a layer's modules named by `modules` (llama's by default)."""
    if hf_name.startswith("model.layers."):
        layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{layer}.{modules[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def write_tiny_llama_gguf(path: Path, quant: dict[str, Q] | None = None, tie: bool = True, extra_meta=None,
                          extra_tensors=None):
    """An HF tiny llama written as llama.cpp would (names, q/k permutation); `quant` picks per-GGUF-name types."""
    tokens, merges, types = byte_vocab()
    model = tiny_hf_llama(len(tokens), tie)
    tensors = {}
    for name, p in model.state_dict().items():
        if tie and name == "lm_head.weight":
            continue
        w = p.detach().numpy().astype(np.float32)
        gname = gguf_name(name)
        if ".attn_q." in gname:
            w = llama_cpp_permute(w, TINY["heads"])
        elif ".attn_k." in gname:
            w = llama_cpp_permute(w, TINY["kv_heads"])
        qtype = (quant or {}).get(gname)
        if qtype == Q.Q8_1:  # gguf has no Q8_1 quantizer; zero blocks of its size are enough to be refused
            tensors[gname] = (np.zeros((w.shape[0], w.shape[1] // 32 * 40), np.uint8), qtype)
        else:
            tensors[gname] = (lib_quantize(w, qtype), qtype) if qtype is not None else (w, None)
    meta = {
        "add_context_length": 512, "add_embedding_length": TINY["hidden"], "add_block_count": TINY["layers"],
        "add_feed_forward_length": TINY["ffn"], "add_head_count": TINY["heads"], "add_head_count_kv": TINY["kv_heads"],
        "add_rope_dimension_count": TINY["head_dim"], "add_rope_freq_base": 50000.0, "add_layer_norm_rms_eps": 1e-6,
        "add_vocab_size": len(tokens), "add_tokenizer_model": "gpt2", "add_tokenizer_pre": "smollm",
        "add_token_list": (tokens,), "add_token_types": (types,), "add_token_merges": (merges,),
        "add_bos_token_id": 1, "add_eos_token_id": 2, "add_pad_token_id": 0, "add_add_bos_token": False,
        "add_chat_template": CHATML,
        **(extra_meta or {}),
    }
    write_gguf(path, {**tensors, **(extra_tensors or {})}, meta=meta)
    return model


# the largest |code x sub-block scale| of each type's blocks (random bytes reach it)
_AMPLITUDE = {"Q4_0": 8, "Q4_1": 15, "Q5_0": 16, "Q5_1": 31, "Q8_0": 128, "Q4_K": 63 * 15, "Q5_K": 63 * 31,
              "Q6_K": 128 * 32, "IQ4_NL": 127, "IQ4_XS": 32 * 127, "Q2_K": 15 * 3, "Q3_K": 32 * 4}


def write_random_llama_gguf(path: Path, kind: str, hidden: int = 256, ffn: int = 256, layers: int = 2,
                            heads: int = 4, kv_heads: int = 2, kinds: dict[str, str] | None = None,
                            extra: dict | None = None) -> Path:
    """A llama GGUF whose matrices are random blocks of `kind` (any type, K-quants included: the `gguf` package
    cannot quantize to those, and random blocks are valid ones), the vocabulary padded to a multiple of 16 so the
    tied head fits the gguf kernel's tiles. `kinds` overrides the type per tensor kind (e.g. {"attn_v": "Q6_K"});
    `extra` adds tensors (name -> (array, type or None))."""
    from tests.support.kernel_inputs import random_gguf_blocks

    tokens, merges, types = byte_vocab()
    pad = -len(tokens) % 16
    tokens, types = tokens + [f"<|extra_{i}|>" for i in range(pad)], types + [3] * pad
    rng = np.random.default_rng(0)
    seeds = iter(range(10_000))

    def matrix(rows: int, cols: int, what: str):
        chosen = (kinds or {}).get(what, kind)
        d = 0.03 / _AMPLITUDE[chosen]  # weights of about +-0.03 whatever the type's range of codes and scales
        return random_gguf_blocks(chosen, rows, cols, seed=next(seeds), lo=d / 2, hi=d), Q[chosen]

    tensors = {"token_embd.weight": matrix(len(tokens), hidden, "token_embd"),
               "output_norm.weight": (rng.uniform(0.5, 1.5, hidden).astype(np.float32), None)}
    head_dim = hidden // heads
    for i in range(layers):
        shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
                  "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
                  "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
        for what, (rows, cols) in shapes.items():
            tensors[f"blk.{i}.{what}.weight"] = matrix(rows, cols, what)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (rng.uniform(0.5, 1.5, hidden).astype(np.float32), None)
    meta = {
        "add_context_length": 512, "add_embedding_length": hidden, "add_block_count": layers,
        "add_feed_forward_length": ffn, "add_head_count": heads, "add_head_count_kv": kv_heads,
        "add_rope_dimension_count": head_dim, "add_rope_freq_base": 10000.0, "add_layer_norm_rms_eps": 1e-5,
        "add_vocab_size": len(tokens), "add_tokenizer_model": "gpt2", "add_tokenizer_pre": "smollm",
        "add_token_list": (tokens,), "add_token_types": (types,), "add_token_merges": (merges,),
        "add_bos_token_id": 1, "add_eos_token_id": 2, "add_pad_token_id": 0, "add_add_bos_token": False,
        "add_chat_template": CHATML,
    }
    return write_gguf(path, {**tensors, **(extra or {})}, meta=meta)
