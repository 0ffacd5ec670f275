"""Load a model from its GGUF file directly: the 4-bit matrices (Q4_0, Q4_1, Q4_K) become int4 layers from their own
codes (`blocks.int4_codes`), and only the rest is dequantized, loaded as floats and quantized as the model's
weight plan says. No float copy of the file is written anywhere, and a matrix served from its codes is never held in
float.

A layer is served from its codes when every tensor it is made of (q, k and v for a fused qkv_proj, gate and up for a
fused gate_up_proj) is stored in one of `INT4_TYPES`. What is not is logged once, by type and tensor kind, with what
it became.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mlc.errors import ModelFormatError
from mlc.layers.linear import Linear, MergedLinear
from mlc.layers.quant_kernels import pack_int4
from mlc.layers.quant_linear import Int4Linear
from mlc.models.base import CausalLM
from mlc.models.gguf.blocks import INT4_TYPES, int4_codes
from mlc.models.gguf.dequant import dequantize_tensor, quant_type_name
from mlc.models.gguf.llama_tensors import hf_tensor_name, unpermute_rope_rows
from mlc.models.gguf.reader import GGUFFile

ARCHITECTURES = ("llama", "glm4")  # dense GGUF layouts read tensor by tensor here (glm4moe: gguf/glm4_moe.py)

log = logging.getLogger("mlc.models")


@dataclass
class _Part:
    """One GGUF tensor bound for a module: which of its shards (or None), weight or bias, and its name."""

    tensor: Any
    hf_name: str
    shard: int | None
    is_bias: bool


@dataclass
class NativeReport:
    """What the GGUF's matrices became: served from their codes, or dequantized (by GGUF type)."""

    layers: int = 0
    tensors: Counter = field(default_factory=Counter)  # GGUF type -> tensors served from their codes
    dequantized: Counter = field(default_factory=Counter)  # GGUF type -> matrices loaded as floats
    module_types: dict[str, str] = field(default_factory=dict)  # a float-loaded matrix's module -> its GGUF type


def _rope_heads(gf: GGUFFile, cfg: dict[str, Any], name: str) -> int | None:
    """llama.cpp stores a llama's q and k rows in its own rope order; the heads to undo it over (None: as stored)."""
    if gf.architecture != "llama":
        return None
    if ".attn_q." in name:
        return int(cfg["num_attention_heads"])
    if ".attn_k." in name:
        return int(cfg["num_key_value_heads"])
    return None


def _shape(tensor) -> tuple[int, int]:
    rows, cols = (int(n) for n in reversed(tensor.shape))
    return rows, cols


def _codes(gf: GGUFFile, cfg: dict[str, Any], part: _Part) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = _shape(part.tensor)
    codes, pairs = int4_codes(part.tensor.data, quant_type_name(part.tensor), rows, cols, part.tensor.name)
    heads = _rope_heads(gf, cfg, part.tensor.name)
    if heads is not None:  # the same row order the floats are put back in
        codes = torch.from_numpy(unpermute_rope_rows(codes.numpy(), heads))
        pairs = torch.from_numpy(unpermute_rope_rows(pairs.transpose(0, 1).numpy(), heads)).transpose(0, 1)
    return codes, pairs.contiguous()


def _floats(gf: GGUFFile, cfg: dict[str, Any], tensor) -> torch.Tensor:
    values = dequantize_tensor(tensor)
    heads = _rope_heads(gf, cfg, tensor.name)
    return torch.from_numpy(unpermute_rope_rows(values, heads) if heads is not None else values)


def _int4_layer(gf: GGUFFile, cfg: dict[str, Any], module: Linear, parts: list[_Part]) -> Int4Linear:
    """The module's int4 stand-in from its tensors' codes, shard after shard as the float rows would be."""
    weights = sorted((p for p in parts if not p.is_bias), key=lambda p: p.shard or 0)
    biases = sorted((p for p in parts if p.is_bias), key=lambda p: p.shard or 0)
    codes, pairs = zip(*(_codes(gf, cfg, p) for p in weights))
    bias = torch.cat([_floats(gf, cfg, p.tensor) for p in biases]) if biases else None
    shape = torch.empty(module.weight.shape, device="meta")  # the float layer's shape; no memory
    shards = module.shard_sizes if isinstance(module, MergedLinear) else None
    return Int4Linear(shape, bias, shards, group_size=32,
                      codes={"qweight": pack_int4(torch.cat(codes)), "scale_offsets": torch.cat(pairs, dim=1)})


def _servable(module: nn.Module, parts: list[_Part]) -> bool:
    """Every weight tensor of this (Merged)Linear is an int4 GGUF type, and every shard has its tensor."""
    if not isinstance(module, Linear) or isinstance(module, nn.Embedding):
        return False
    weights = [p for p in parts if not p.is_bias]
    shards = len(module.shard_sizes) if isinstance(module, MergedLinear) else 1
    return (len(weights) == shards and all(quant_type_name(p.tensor) in INT4_TYPES for p in weights)
            and module.in_features % 32 == 0)


def load_gguf(net: CausalLM, gf: GGUFFile, cfg: dict[str, Any], native: bool) -> NativeReport:
    """Load `gf` into `net` (built empty, its float parameters not yet written): with `native`, int4 matrices as
    int4 layers from their codes; every other tensor dequantized into the float parameters."""
    from mlc.layers.quant import _swap

    report = NativeReport()
    modules = dict(net.named_modules())
    by_module: dict[str, list[_Part]] = defaultdict(list)
    for t in gf.reader.tensors:
        if t.name == "rope_freqs.weight":
            continue  # folded into rope_parameters when config.json was written
        hf = hf_tensor_name(t.name, gf.architecture)
        if hf is None:
            raise ModelFormatError(f"{gf.path.name}: tensor {t.name!r} has no place in a dense {gf.architecture} "
                                   "model; this GGUF holds a variant mlc does not read")
        target = net.map_weight_name(hf)
        if target is None:
            continue
        module_name, _, attr = target.param.rpartition(".")
        by_module[module_name].append(_Part(t, hf, target.shard, attr == "bias"))
    served: set[str] = set()
    if native:
        for module_name, parts in by_module.items():
            module = modules.get(module_name)
            if not isinstance(module, Linear) or not _servable(module, parts):
                continue
            _swap(net, module_name, _int4_layer(gf, cfg, module, parts))
            served.add(module_name)
            report.layers += 1
            report.tensors.update(quant_type_name(p.tensor) for p in parts if not p.is_bias)
    rest = [p for name, parts in by_module.items() if name not in served for p in parts]
    for name, parts in by_module.items():
        kinds = [quant_type_name(p.tensor) for p in parts if not p.is_bias and len(p.tensor.shape) == 2]
        if name not in served and kinds and isinstance(modules.get(name), Linear):
            report.module_types[name] = Counter(kinds).most_common(1)[0][0]
            report.dequantized.update(k for k in kinds if k not in ("F32", "F16", "BF16"))
    with torch.no_grad():
        net.load_weights(_float_tensors(gf, cfg, rest))
    return report


def _float_tensors(gf: GGUFFile, cfg: dict[str, Any], parts: list[_Part]) -> Iterator[tuple[str, torch.Tensor]]:
    for p in parts:
        yield p.hf_name, _floats(gf, cfg, p.tensor)


def describe(report: NativeReport) -> str:
    """'int4 from the GGUF's own Q4_K / Q4_0 codes (160 layers; 30 Q6_K matrices dequantized)' (the weights line)."""
    native = " / ".join(t for t, _ in report.tensors.most_common())
    rest = ", ".join(f"{n} {t}" for t, n in report.dequantized.most_common())
    return (f"int4 from the GGUF's own {native} codes ({report.layers} layers"
            + (f"; dequantized, then quantized: {rest}" if rest else "") + ")")
