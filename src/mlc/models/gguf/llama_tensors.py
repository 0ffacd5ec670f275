"""A llama (or glm4) GGUF's tensors under their HF names, with llama q/k rows returned from llama.cpp's rope layout
to HF's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from mlc.errors import ModelFormatError
from mlc.models.gguf.dequant import dequantize_tensor
from mlc.models.gguf.reader import GGUFFile

TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for names with no HF counterpart."""
    from mlc.models.gguf.glm4 import GLM4_LAYER_NAMES

    layer_names = GLM4_LAYER_NAMES if arch == "glm4" else LAYER_NAMES
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    return None


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: per head, half-split rope layout -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `permute_rope_rows`: back to HF's half-split layout."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_hf_tensors(gf: GGUFFile, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, fp32 array) for every tensor, with q/k rows returned to HF's rope layout."""
    if gf.architecture == "glm4moe":
        from mlc.models.gguf.glm4_moe import iter_glm4_moe_tensors

        yield from iter_glm4_moe_tensors(gf, cfg)
        return
    for t in gf.reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into rope_parameters by hf_config
        name = hf_tensor_name(t.name, gf.architecture)
        if name is None:
            raise ModelFormatError(
                f"{gf.path.name}: tensor {t.name!r} has no place in a dense {gf.architecture} model; "
                "this GGUF holds a variant mlc does not convert"
            )
        values = dequantize_tensor(t)
        # glm4 rows are stored as HF has them (GLM's rope pairs adjacent dims, as llama.cpp's does)
        permuted = gf.architecture == "llama"
        if permuted and ".attn_q." in t.name:
            values = unpermute_rope_rows(values, cfg["num_attention_heads"])
        elif permuted and ".attn_k." in t.name:
            values = unpermute_rope_rows(values, cfg["num_key_value_heads"])
        yield name, values
