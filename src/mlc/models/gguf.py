"""Read a GGUF file (llama.cpp's format) with the `gguf` package and write it out as an HF checkpoint dir:
config.json, generation_config.json, tokenizer files and an fp32 model.safetensors with HF tensor names."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlc.errors import ModelFormatError

CONVERTER_VERSION = "1"
CONVERTIBLE_ARCHITECTURES = ("llama",)
# Types `gguf.quants.dequantize` implements in numpy; anything else (Q8_1, Q8_K, integer types) is refused.
SUPPORTED_QUANTS = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "MXFP4",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
)

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


@dataclass
class GGUFFile:
    """An opened GGUF: its metadata (key -> python value) and its tensors (memory-mapped)."""

    path: Path
    reader: Any
    metadata: dict[str, Any]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing>"))

    @property
    def tensors(self) -> list:
        return list(self.reader.tensors)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)


@dataclass
class ConversionReport:
    architecture: str
    tensor_types: dict[str, int]
    unmapped_keys: list[str] = field(default_factory=list)
    seconds: float = 0.0


def open_gguf(path: str | Path) -> GGUFFile:
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path} does not exist or is not a file; pass the path of a .gguf file")
    try:
        reader = GGUFReader(str(path))
        metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    except Exception as e:  # the reader raises ValueError, IndexError or struct errors on damaged files
        raise ModelFormatError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); re-download it") from None
    return GGUFFile(path, reader, metadata)


def f32_value(x) -> float:
    """The shortest decimal that a stored float32 came from (1e-05, not 9.999999747378752e-06)."""
    return float(repr(np.float32(x)).removeprefix("np.float32(").removesuffix(")"))


# -- config -------------------------------------------------------------------------------------------------------
def _require(gf: GGUFFile, key: str):
    value = gf.arch_key(key)
    if value is None:
        raise ModelFormatError(f"{gf.path.name}: metadata key {gf.architecture}.{key} is missing; the GGUF is incomplete")
    return value


def _special_ids(gf: GGUFFile) -> dict[str, Any]:
    meta = gf.metadata
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if meta.get(k) is not None]
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
    if int(gf.arch_key("expert_count", 0) or 0) > 0:
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
    prefix = f"{arch}."
    unmapped = sorted(
        k for k in gf.metadata
        if k.startswith(prefix) and k[len(prefix):] not in LLAMA_KEYS and k[len(prefix):] not in LLAMA_KEYS_HANDLED
    )
    return cfg, unmapped


def generation_config(gf: GGUFFile) -> dict[str, Any]:
    return {k: v for k, v in _special_ids(gf).items() if v is not None}


# -- tensors ------------------------------------------------------------------------------------------------------
def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for names with no HF counterpart."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem in TOP_LEVEL_NAMES:
        return f"{TOP_LEVEL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: per head, half-split rope layout -> interleaved pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of `permute_rope_rows`: back to HF's half-split layout."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quant_type_name(tensor) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(int(tensor.tensor_type)).name
    except ValueError:
        return f"type {int(tensor.tensor_type)}"


def check_quant_types(gf: GGUFFile) -> None:
    """Fail before any work when a tensor uses a type we cannot dequantize."""
    for t in gf.reader.tensors:
        kind = quant_type_name(t)
        if kind not in SUPPORTED_QUANTS:
            raise ModelFormatError(
                f"{gf.path.name}: tensor {t.name!r} is stored as {kind}, which mlc cannot dequantize; "
                f"supported types: {', '.join(SUPPORTED_QUANTS)} (re-quantize with llama-quantize, e.g. to Q8_0)"
            )


def dequantize_tensor(tensor) -> np.ndarray:
    """fp32 array in numpy (row-major, HF `[out, in]`) order."""
    from gguf.quants import dequantize

    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ModelFormatError(
            f"tensor {tensor.name!r} is stored as {quant_type_name(tensor)}, which mlc cannot dequantize; "
            f"supported types: {', '.join(SUPPORTED_QUANTS)}"
        ) from None
    return np.array(values.reshape(shape), dtype=np.float32, order="C")  # a copy: F32 data is a read-only memmap


def iter_hf_tensors(gf: GGUFFile, cfg: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, fp32 array) for every tensor, with q/k rows returned to HF's rope layout."""
    for t in gf.reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into rope_parameters by hf_config
        name = hf_tensor_name(t.name)
        if name is None:
            raise ModelFormatError(
                f"{gf.path.name}: tensor {t.name!r} has no place in a dense llama model; "
                "this GGUF holds a variant mlc does not convert"
            )
        values = dequantize_tensor(t)
        if ".attn_q." in t.name:
            values = unpermute_rope_rows(values, cfg["num_attention_heads"])
        elif ".attn_k." in t.name:
            values = unpermute_rope_rows(values, cfg["num_key_value_heads"])
        yield name, values


# -- writing ------------------------------------------------------------------------------------------------------
ProgressFn = Callable[[int, int, str], None]


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(path: str | Path, out_dir: str | Path, progress: ProgressFn | None = None) -> ConversionReport:
    """Write an HF checkpoint dir for `path` into `out_dir` (created; existing files are overwritten)."""
    import torch
    from safetensors.torch import save_file

    from mlc.models.gguf_tokenizer import write_tokenizer_files

    start = time.perf_counter()
    gf = open_gguf(path)
    cfg, unmapped = hf_config(gf)
    check_quant_types(gf)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(gf, out)
    write_json(out / "config.json", cfg)
    write_json(out / "generation_config.json", generation_config(gf))
    tensors: dict[str, torch.Tensor] = {}
    total = len(gf.reader.tensors)
    for i, (name, values) in enumerate(iter_hf_tensors(gf, cfg), start=1):
        tensors[name] = torch.from_numpy(values)
        if progress is not None:
            progress(i, total, name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    types = Counter(quant_type_name(t) for t in gf.reader.tensors)
    return ConversionReport(gf.architecture, dict(types), unmapped, time.perf_counter() - start)
