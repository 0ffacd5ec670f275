"""config.json and generation_config.json for a llama-architecture GGUF, from its `llama.*` and tokenizer keys;
GLM-4-0414 (`glm4.*`, the same keys) is the llama config turned into Glm4Config by `gguf_glm4`."""

from __future__ import annotations

from typing import Any

import numpy as np

from mlc.errors import ModelFormatError
from mlc.models.gguf.dequant import dequantize_tensor
from mlc.models.gguf.reader import GGUFFile

CONVERTIBLE_ARCHITECTURES = ("llama", "glm4", "glm4moe")
# llama.* keys that map one to one onto config.json fields
LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# llama.* keys read elsewhere below (head_dim, rope, MoE checks) or that carry no config meaning
LLAMA_KEYS_HANDLED = {
    "attention.key_length", "attention.value_length", "rope.dimension_count", "rope.freq_base",
    "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.attn_factor", "rope.scaling.finetuned", "rope.scaling.yarn_log_multiplier",
    "expert_count", "expert_used_count",
}


def f32_value(x) -> float:
    """The shortest decimal that a stored float32 came from (1e-05, not 9.999999747378752e-06)."""
    return float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))


def _require(gf: GGUFFile, key: str):
    value = gf.arch_key(key)
    if value is None:
        raise ModelFormatError(
            f"{gf.path.name}: metadata key {gf.architecture}.{key} is missing; the GGUF is incomplete")
    return value


def _special_ids(gf: GGUFFile) -> dict[str, Any]:
    meta = gf.metadata
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    eos = [meta[k] for k in eos_keys if meta.get(k) is not None]
    eos = list(dict.fromkeys(int(e) for e in eos))
    return {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if not eos else eos[0] if len(eos) == 1 else eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def _rope_parameters(gf: GGUFFile, head_dim: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": f32_value(gf.arch_key("rope.freq_base", 10000.0))}
    rot_dim = gf.arch_key("rope.dimension_count")
    if rot_dim is not None and int(rot_dim) != head_dim:
        params["partial_rotary_factor"] = int(rot_dim) / head_dim
    kind = gf.arch_key("rope.scaling.type")
    if kind in ("linear", "yarn"):
        params["rope_type"] = kind
        params["factor"] = float(_require(gf, "rope.scaling.factor"))
        if kind == "yarn":
            params["original_max_position_embeddings"] = int(_require(gf, "rope.scaling.original_context_length"))
            if gf.arch_key("rope.scaling.attn_factor") is not None:
                params["attention_factor"] = float(gf.arch_key("rope.scaling.attn_factor"))
    elif kind not in (None, "none"):
        raise ModelFormatError(f"{gf.path.name}: rope scaling type {kind!r} is not supported (linear, yarn are)")
    if "rope_freqs.weight" in gf.tensor_names():
        params.update(_llama3_rope(gf, params["rope_theta"], int(rot_dim or head_dim)))
    return params


def _llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """llama.cpp's per-frequency divisors for llama3 rope scaling (what it stores as rope_freqs.weight)."""
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def _llama3_rope(gf: GGUFFile, theta: float, rot_dim: int) -> dict[str, Any]:
    """Llama 3.1-style GGUFs keep rope scaling only as a factor table; find the llama3 parameters that rebuild it."""
    tensor = next(t for t in gf.reader.tensors if t.name == "rope_freqs.weight")
    stored = dequantize_tensor(tensor).reshape(-1).astype(np.float64)
    if np.allclose(stored, 1.0):
        return {}
    inv_freq = 1.0 / theta ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim)
    factor = float(stored.max())
    for original in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
            if np.allclose(_llama3_factors(inv_freq, factor, low, high, original), stored, rtol=1e-4):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": original}
    raise ModelFormatError(
        f"{gf.path.name}: its rope_freqs table matches no llama3 rope scaling mlc recognises; "
        "convert the original HF checkpoint instead"
    )


def hf_config(gf: GGUFFile) -> tuple[dict[str, Any], list[str]]:
    """config.json for a llama-architecture GGUF, and the metadata keys of that architecture it did not use."""
    arch = gf.architecture
    if arch not in CONVERTIBLE_ARCHITECTURES:
        raise ModelFormatError(
            f"{gf.path.name}: GGUF architecture {arch!r} is not supported; mlc converts "
            f"{', '.join(CONVERTIBLE_ARCHITECTURES)} GGUFs (use an HF checkpoint directory for other models)"
        )
    if arch != "glm4moe" and int(gf.arch_key("nextn_predict_layers", 0) or 0):  # glm4moe: the layers are skipped
        raise ModelFormatError(f"{gf.path.name}: GGUFs with multi-token-prediction (NextN) layers are not supported")
    if arch != "glm4moe" and int(gf.arch_key("expert_count", 0) or 0) > 0:
        raise ModelFormatError(f"{gf.path.name}: mixture-of-experts llama GGUFs (Mixtral-style) are not supported")
    names = gf.tensor_names()
    cfg: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu"}
    for key, hf_key in LLAMA_KEYS.items():
        if gf.arch_key(key) is not None:
            cfg[hf_key] = gf.arch_key(key)
    for key in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count"):
        _require(gf, key)
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    embedding = next((t for t in gf.reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ModelFormatError(f"{gf.path.name}: tensor token_embd.weight is missing; the GGUF is incomplete")
    cfg["vocab_size"] = int(embedding.shape[1])  # the embedding's rows are the vocabulary the weights expect
    head_dim = int(gf.arch_key("attention.key_length") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if int(gf.arch_key("attention.value_length") or head_dim) != head_dim:
        raise ModelFormatError(f"{gf.path.name}: key and value head sizes differ, which llama does not support")
    cfg["head_dim"] = head_dim
    cfg["rms_norm_eps"] = f32_value(cfg.get("rms_norm_eps", 1e-5))
    cfg["rope_parameters"] = _rope_parameters(gf, head_dim)
    cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    cfg["mlp_bias"] = "blk.0.ffn_gate.bias" in names
    cfg["tie_word_embeddings"] = "output.weight" not in names
    cfg.update(_special_ids(gf))
    cfg["dtype"] = "float32"
    if arch == "glm4":
        from mlc.models.gguf.glm4 import glm4_config

        cfg = glm4_config(cfg, names)
    handled = set(LLAMA_KEYS_HANDLED)
    if arch == "glm4moe":
        from mlc.models.gguf.glm4_moe import GLM4_MOE_KEYS, glm4_moe_config

        cfg = glm4_moe_config(gf, cfg, names)
        handled |= GLM4_MOE_KEYS
    prefix = f"{arch}."
    unmapped = sorted(
        k for k in gf.metadata
        if k.startswith(prefix) and k[len(prefix):] not in LLAMA_KEYS and k[len(prefix):] not in handled
    )
    return cfg, unmapped


def generation_config(gf: GGUFFile) -> dict[str, Any]:
    return {k: v for k, v in _special_ids(gf).items() if v is not None}
