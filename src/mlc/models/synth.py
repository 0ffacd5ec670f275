"""Random-weight GGUF checkpoints of real architectures and sizes (`mlc-cli models synth`): what speed is measured on
where the real weights cannot be downloaded. The shapes are the real models' (Llama-3.2-1B/3B, Llama-3.1-8B,
SmolLM2-135M, GLM-4-9B-0414 and a narrower GLM-4-0414, GLM-4.5-Air's MoE layout scaled down), the tokenizer the
default model's with its vocabulary padded to the real size (the timing is real, the text is not), the tensor names
and layouts llama.cpp's converter writes, so llama.cpp loads the same file.

Written tensor by tensor (a few hundred MB of memory at 8B): F16, F32 and the types the `gguf` package quantizes
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) from normal weights; the K-quant and IQ4 types as random blocks (each code and
sub-block scale drawn at random, fp16 scales sized for weights of about +-0.03); llama-quantize's mixes
(Q4_K_M, Q5_K_M, ...) by running llama-quantize on an F16 file written first.
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlc.errors import ConfigError

DIRECT = ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # quantized from normal weights
RANDOM_BLOCKS = ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")  # written as random blocks
MIXES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K_MIX", "Q3_K_M", "Q2_K", "IQ4_NL_MIX")
_AMPLITUDE = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32, "IQ4_NL": 127, "IQ4_XS": 32 * 127}
_HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}  # fp16 scale offsets
STD = 0.02  # the weights' standard deviation (HF's initializer range)


@dataclass(frozen=True)
class Shape:
    arch: str  # the GGUF architecture: llama, glm4 or glm4moe
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float
    like: str  # the real model it copies
    rope_dim: int | None = None  # glm4: half the head
    bias: bool = False  # glm4: q, k and v biases
    experts: int = 0  # glm4moe: routed experts (stacked), of which top_k run per token, beside `shared` always run
    top_k: int = 0
    shared: int = 0
    moe_ffn: int = 0  # one expert's intermediate size
    dense_layers: int = 0  # the leading layers with a dense MLP of `ffn`

    def params(self, active: bool = False) -> int:
        """Parameters in all; with `active`, those one token reads (top_k of the routed experts)."""
        attn = self.hidden * (2 * self.heads + 2 * self.kv_heads) * self.head_dim
        dense = 3 * self.hidden * self.ffn
        routed = self.top_k if active else self.experts
        moe = 3 * self.hidden * self.moe_ffn * (routed + self.shared) + self.hidden * self.experts
        mlp = dense * self.layers if not self.experts else dense * self.dense_layers + moe * (
            self.layers - self.dense_layers)
        return self.layers * attn + mlp + self.vocab * self.hidden * (1 if self.tied else 2)


SHAPES = {
    "llama-135M": Shape("llama", 576, 30, 9, 3, 64, 1536, 49152, True, 100000.0, "SmolLM2-135M"),
    "llama-360M": Shape("llama", 960, 32, 15, 5, 64, 2560, 49152, True, 100000.0, "SmolLM2-360M"),
    "llama-1B": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, True, 500000.0, "Llama-3.2-1B"),
    "llama-3B": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, True, 500000.0, "Llama-3.2-3B"),
    "llama-8B": Shape("llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 500000.0, "Llama-3.1-8B"),
    "glm4-0.5B": Shape("glm4", 1024, 16, 8, 2, 128, 3584, 151552, False, 10000.0,
                       "GLM-4-9B-0414 at quarter width, 16 layers", rope_dim=64, bias=True),
    "glm4-1.5B": Shape("glm4", 2048, 24, 16, 2, 128, 4096, 151552, False, 10000.0,
                       "GLM-4-9B-0414 at half width, 24 layers", rope_dim=64, bias=True),
    "glm4-3B": Shape("glm4", 4096, 10, 32, 2, 128, 13696, 151552, False, 10000.0,
                     "GLM-4-9B-0414 at its width, 10 of its 40 layers", rope_dim=64, bias=True),
    "glm4-9B": Shape("glm4", 4096, 40, 32, 2, 128, 13696, 151552, False, 10000.0, "GLM-4-9B-0414", rope_dim=64,
                     bias=True),
    "glm4moe-2B": Shape("glm4moe", 2048, 12, 16, 4, 128, 5632, 151552, False, 1000000.0,
                        "GLM-4.5-Air at half width, 12 layers, 32 experts (2 routed + 1 shared)", rope_dim=64,
                        bias=True, experts=32, top_k=2, shared=1, moe_ffn=768, dense_layers=1),
}
F32_MATRICES = ("ffn_gate_inp",)  # the router stays F32 (llama.cpp's converter and llama-quantize keep it so)


def shape_for(arch: str, size: str) -> Shape:
    key = f"{arch}-{size}"
    if key not in SHAPES:
        known = ", ".join(f"{k.split('-', 1)[0]} --size {k.split('-', 1)[1]}" for k in SHAPES)
        raise ConfigError(f"no synthetic shape {arch} {size}; known: {known}")
    return SHAPES[key]


def _tensors(s: Shape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) in the order llama.cpp's converter writes them."""
    yield "token_embd.weight", (s.vocab, s.hidden)
    for i in range(s.layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (s.hidden,)
        for what, rows in (("attn_q", s.heads), ("attn_k", s.kv_heads), ("attn_v", s.kv_heads)):
            yield b + what + ".weight", (rows * s.head_dim, s.hidden)
            if s.bias:
                yield b + what + ".bias", (rows * s.head_dim,)
        yield b + "attn_output.weight", (s.hidden, s.heads * s.head_dim)
        if s.arch == "glm4moe":
            yield from _glm4moe_mlp(s, i)
        elif s.arch == "glm4":
            yield b + "post_attention_norm.weight", (s.hidden,)
            yield b + "ffn_norm.weight", (s.hidden,)
            yield b + "ffn_up.weight", (2 * s.ffn, s.hidden)  # gate and up fused, as GLM-4 stores them
            yield b + "ffn_down.weight", (s.hidden, s.ffn)
            yield b + "post_ffw_norm.weight", (s.hidden,)
        else:
            yield b + "ffn_norm.weight", (s.hidden,)
            yield b + "ffn_gate.weight", (s.ffn, s.hidden)
            yield b + "ffn_up.weight", (s.ffn, s.hidden)
            yield b + "ffn_down.weight", (s.hidden, s.ffn)
    yield "output_norm.weight", (s.hidden,)
    if not s.tied:
        yield "output.weight", (s.vocab, s.hidden)


def _glm4moe_mlp(s: Shape, i: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    b = f"blk.{i}."
    yield b + "post_attention_norm.weight", (s.hidden,)
    if i < s.dense_layers:
        yield b + "ffn_gate.weight", (s.ffn, s.hidden)
        yield b + "ffn_up.weight", (s.ffn, s.hidden)
        yield b + "ffn_down.weight", (s.hidden, s.ffn)
        return
    yield b + "ffn_gate_inp.weight", (s.experts, s.hidden)
    yield b + "exp_probs_b.bias", (s.experts,)
    yield b + "ffn_gate_exps.weight", (s.experts, s.moe_ffn, s.hidden)
    yield b + "ffn_up_exps.weight", (s.experts, s.moe_ffn, s.hidden)
    yield b + "ffn_down_exps.weight", (s.experts, s.hidden, s.moe_ffn)
    yield b + "ffn_gate_shexp.weight", (s.moe_ffn * s.shared, s.hidden)
    yield b + "ffn_up_shexp.weight", (s.moe_ffn * s.shared, s.hidden)
    yield b + "ffn_down_shexp.weight", (s.hidden, s.moe_ffn * s.shared)


def _type(name: str, shape: tuple[int, ...], kind: str) -> str:
    """The type a tensor is written in: `kind` for the matrices (and expert stacks), F32 for the rest."""
    return kind if len(shape) >= 2 and name.split(".")[-2] not in F32_MATRICES else "F32"


def _random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    n = rows * cols // per
    b = rng.integers(0, 256, (n, size), dtype=np.uint8)
    d = 0.03 / _AMPLITUDE[kind]
    for at in _HALVES[kind]:
        b[:, at : at + 2] = rng.uniform(d / 2, d, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return b.reshape(rows, cols // per * size)


def _values(name: str, shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if len(shape) == 1:  # norms near 1, biases near 0
        base = 0.0 if name.endswith(".bias") else 1.0
        return (base + rng.standard_normal(shape, dtype=np.float32) * 0.05).astype(np.float32)
    if kind in RANDOM_BLOCKS:
        blocks = _random_blocks(kind, int(np.prod(shape[:-1])), shape[-1], rng)
        return blocks.reshape(*shape[:-1], blocks.shape[-1])
    w = rng.standard_normal(shape, dtype=np.float32) * STD
    if kind == "F32":
        return w
    if kind == "F16":
        return w.astype(np.float16)
    return quantize(w, GGMLQuantizationType[kind])


def _metadata(writer, s: Shape, kind: str) -> None:
    """The architecture's keys, and the default model's tokenizer with its vocabulary padded to the real size."""
    arch = s.arch
    writer.add_name(f"mlc synthetic {s.like} ({kind}, random weights)")
    writer.add_context_length(8192)
    writer.add_embedding_length(s.hidden)
    writer.add_block_count(s.layers)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_dimension_count(s.rope_dim or s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(s.vocab)
    assert writer.arch == arch
    tok = _default_tokenizer()
    pad = s.vocab - len(tok["tokens"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tok["pre"])
    writer.add_token_list(tok["tokens"] + [f"<|synthetic_{i}|>" for i in range(pad)])
    writer.add_token_types(tok["types"] + [4] * pad)  # user-defined tokens: never produced by the BPE merges
    writer.add_token_merges(tok["merges"])
    writer.add_bos_token_id(tok["bos"])
    writer.add_eos_token_id(tok["eos"])
    writer.add_pad_token_id(tok["padding"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok["template"])
    if s.experts:
        _moe_metadata(writer, s)


def _moe_metadata(writer, s: Shape) -> None:
    """glm4moe's keys, as GLM-4.5's converter writes them (sigmoid router scaled by 1.0, no NextN layer)."""
    from gguf import ExpertGatingFuncType

    writer.add_expert_count(s.experts)
    writer.add_expert_used_count(s.top_k)
    writer.add_expert_shared_count(s.shared)
    writer.add_expert_feed_forward_length(s.moe_ffn)
    writer.add_leading_dense_block_count(s.dense_layers)
    writer.add_expert_weights_scale(1.0)
    writer.add_expert_weights_norm(True)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_nextn_predict_layers(0)


@functools.cache
def _default_tokenizer() -> dict[str, Any]:
    """The default model's tokenizer fields, read once."""
    from mlc.models.gguf.reader import open_gguf
    from mlc.models.store import pull

    meta = open_gguf(pull("smollm2-135m-instruct").path / "model.gguf").metadata
    return {"tokens": meta["tokenizer.ggml.tokens"], "merges": meta["tokenizer.ggml.merges"],
            "types": meta["tokenizer.ggml.token_type"], "pre": meta["tokenizer.ggml.pre"],
            "template": meta["tokenizer.chat_template"],
            **{key: int(meta[f"tokenizer.ggml.{key}_token_id"]) for key in ("bos", "eos", "padding")}}


def write_synthetic(shape: Shape, kind: str, out: Path, seed: int = 0,
                    progress: Callable[[int, int, str], None] | None = None) -> Path:
    """Write a random-weight GGUF of `shape` with matrices of `kind` (DIRECT or RANDOM_BLOCKS); norms and biases
    F32. Streams: each tensor is made, written and dropped before the next."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES

    if kind not in DIRECT + RANDOM_BLOCKS:
        raise ConfigError(f"--quant {kind} cannot be written directly; use one of {', '.join(DIRECT + RANDOM_BLOCKS)}"
                          f" or a llama-quantize mix ({', '.join(MIXES)})")
    widths = {"hidden": shape.hidden, "intermediate": shape.ffn, "expert intermediate": shape.moe_ffn}
    odd = next(((what, n) for what, n in widths.items() if n % 256), None)
    if kind in RANDOM_BLOCKS and odd is not None:
        raise ConfigError(f"{kind} needs rows of whole 256-value super-blocks; {odd[0]} size {odd[1]} is not; "
                          "use Q4_0, Q8_0 or F16 for this shape (or a llama-quantize mix, which falls back per tensor)")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out), shape.arch)
    _metadata(writer, shape, kind)
    plan = list(_tensors(shape))
    for name, shp in plan:
        t = _type(name, shp, kind)
        if t in ("F32", "F16"):
            dtype = np.float32 if t == "F32" else np.float16
            writer.add_tensor_info(name, shp, np.dtype(dtype), int(np.prod(shp)) * np.dtype(dtype).itemsize)
        else:
            per, size = GGML_QUANT_SIZES[GGMLQuantizationType[t]]
            byte_shape = (*shp[:-1], shp[-1] // per * size)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   raw_dtype=GGMLQuantizationType[t])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, shp) in enumerate(plan):
        writer.write_tensor_data(_values(name, shp, _type(name, shp, kind), rng))
        if progress is not None:
            progress(i + 1, len(plan), name)
    writer.close()
    return out


def quantize_mix(source: Path, mix: str, out: Path, llama_quantize: Path) -> Path:
    """llama-quantize `source` (F16) into one of its mixes, as the files people download are made."""
    preset = mix.removesuffix("_MIX")
    run = subprocess.run([str(llama_quantize), str(source), str(out), preset], capture_output=True, text=True)
    if run.returncode != 0:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        raise ConfigError(f"llama-quantize {preset} failed: {' | '.join(tail)}")
    return out


def synthesize(shape: Shape, quant: str, path: Path, seed: int = 0, llama_quantize: Path | None = None,
               progress: Callable[[int, int, str], None] | None = None) -> Path:
    """`path` as a random-weight GGUF of `shape` in `quant`: written directly, or for a llama-quantize mix (which
    needs `llama_quantize`) written as F16 beside it first, quantized, and the F16 file removed."""
    quant = quant.upper()
    if quant not in MIXES:
        return write_synthetic(shape, quant, path, seed, progress)
    if llama_quantize is None:
        raise ConfigError(f"{quant} is a llama-quantize mix: it needs llama.cpp's llama-quantize")
    source = path.with_name(path.stem + "-F16.gguf")
    try:
        write_synthetic(shape, "F16", source, seed, progress)
        return quantize_mix(source, quant, path, llama_quantize)
    finally:
        source.unlink(missing_ok=True)
