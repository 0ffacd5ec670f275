"""Load a model from its GGUF file directly. With the C++ kernels, every matrix of a type the gguf kernel reads
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS) becomes a `GGUFLinear` from its own blocks, each
tensor keeping its type, and the token embedding is looked up in the mapped file (`GGUFEmbedding`; a tied head is a
`GGUFLinear` of the same blocks). Without them, the 4-bit matrices (Q4_0, Q4_1, Q4_K) become int4 layers from
their codes (`blocks.int4_codes`, torch's int4 kernel). Only the rest is dequantized, loaded as floats and quantized
as the model's weight plan says (logged by type, with what it became). No float copy of the file is written
anywhere, and a matrix served from its blocks is never held in float.

A layer is served from its blocks when every tensor it is made of (q, k and v for a fused qkv_proj, gate and up for
a fused gate_up_proj) is of a type that path reads. A glm4moe file's routed experts, stacked per layer, become
one pair of `GGUFLinear`s per expert over slices of the stacks (`native_moe.py`).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from mlc.errors import ModelFormatError
from mlc.layers.gguf_linear import (
    GGUFEmbedding,
    GGUFLinear,
    GGUFPart,
    as_tensor,
    gguf_kernel_fits,
    gguf_kernels_available,
)
from mlc.layers.linear import Linear, MergedLinear
from mlc.layers.moe import RoutedExperts
from mlc.layers.quant import _swap, release_free_memory
from mlc.layers.quant_kernels import pack_int4
from mlc.layers.quant_linear import Int4Linear
from mlc.models.base import CausalLM, Embedding
from mlc.models.gguf.blocks import INT4_TYPES, int4_codes
from mlc.models.gguf.dequant import dequantize_tensor, quant_type_name
from mlc.models.gguf.glm4_moe import (
    NEXTN_COPIES,
    Stacks,
    check_stacks,
    float_experts,
    glm4_moe_tensor_name,
    nextn_tensor_name,
    stacked_projection,
)
from mlc.models.gguf.llama_tensors import hf_tensor_name, unpermute_rope_rows
from mlc.models.gguf.native_moe import gguf_experts, servable
from mlc.models.gguf.reader import GGUFFile

# a GGUF's tensor type -> the weight dtype it is served in where it is not served from its blocks (its own bit
# width, never blown up to fp32)
GGUF_WEIGHT_DTYPES = {
    **dict.fromkeys(("Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS"), "int4"),
    **dict.fromkeys(("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_K"), "int8"),
    "F16": "fp16", "BF16": "bf16",
}
FLOAT_TYPES = ("F32", "F16", "BF16")
ARCHITECTURES = ("llama", "glm4", "glm4moe")  # GGUF layouts read tensor by tensor here

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
    kernel: str = "gguf"  # "gguf" (the C++ gguf kernel) or "int4" (torch's int4 kernel, without the C++ kernels)
    tensors: Counter = field(default_factory=Counter)  # GGUF type -> tensors served from their blocks
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


def _gguf_part(gf: GGUFFile, cfg: dict[str, Any], tensor) -> GGUFPart:
    rows, _ = _shape(tensor)
    heads = _rope_heads(gf, cfg, tensor.name)
    order = None if heads is None else torch.from_numpy(unpermute_rope_rows(np.arange(rows), heads))
    return GGUFPart(as_tensor(tensor.data), quant_type_name(tensor), order, tensor.name)


def _gguf_layer(gf: GGUFFile, cfg: dict[str, Any], module: Linear, parts: list[_Part]) -> GGUFLinear:
    weights = sorted((p for p in parts if not p.is_bias), key=lambda p: p.shard or 0)
    biases = sorted((p for p in parts if p.is_bias), key=lambda p: p.shard or 0)
    bias = torch.cat([_floats(gf, cfg, p.tensor) for p in biases]) if biases else None
    shards = module.shard_sizes if isinstance(module, MergedLinear) else None
    return GGUFLinear([_gguf_part(gf, cfg, p.tensor) for p in weights], module.in_features, bias, shards)


def _servable(module: nn.Module, parts: list[_Part], gguf: bool) -> bool:
    """Every weight tensor of this (Merged)Linear is of a type the chosen kernel reads (the gguf kernel's, else the
    int4 ones), and every shard has its tensor (or one tensor holds them all)."""
    if not isinstance(module, Linear):
        return False
    weights = [p for p in parts if not p.is_bias]
    shards = len(module.shard_sizes) if isinstance(module, MergedLinear) else 1
    # one tensor a shard, or one stacking every shard (GLM-4's ffn_up holds gate and up)
    whole = len(weights) == 1 and weights[0].shard is None and _shape(weights[0].tensor) == tuple(module.weight.shape)
    if not whole and len(weights) != shards:
        return False
    if gguf:
        return all(gguf_kernel_fits(quant_type_name(p.tensor), *_shape(p.tensor)) for p in weights)
    return all(quant_type_name(p.tensor) in INT4_TYPES for p in weights) and module.in_features % 32 == 0


def _embedding(net: CausalLM, gf: GGUFFile, cfg: dict[str, Any], name: str, parts: list[_Part],
               report: NativeReport) -> bool:
    """The token embedding looked up in the file's blocks, and a tied head computed from them; False where its
    type is not one the gguf kernel reads (it is then loaded as floats)."""
    module = net.get_submodule(name)
    tensor = parts[0].tensor
    if not isinstance(module, Embedding) or module.rows != module.full_rows or len(parts) != 1:
        return False
    kind, (rows, cols) = quant_type_name(tensor), _shape(tensor)
    if not gguf_kernel_fits(kind, rows, cols):
        return False
    part = _gguf_part(gf, cfg, tensor)
    if net.lm_head is module:  # tied: the head multiplies by the same blocks
        net.lm_head = GGUFLinear([part], cols)
        report.layers += 1
        report.tensors[kind] += 1
    _swap(net, name, GGUFEmbedding(part, cols, module.weight.dtype))
    return True


def load_gguf(net: CausalLM, gf: GGUFFile, cfg: dict[str, Any], native: bool) -> NativeReport:
    """Load `gf` into `net` (built empty, its float parameters not yet written): with `native`, the matrices the
    gguf kernel (or, without the C++ kernels, the int4 kernel) reads from their blocks; every other tensor
    dequantized into the float parameters."""
    report = NativeReport()
    modules = dict(net.named_modules())
    by_module: dict[str, list[_Part]] = defaultdict(list)
    stacks: Stacks = defaultdict(dict)
    mtp = net.mtp is not None
    name_of = _hf_names(gf, cfg, mtp)
    for t in gf.reader.tensors:
        if gf.architecture == "glm4moe" and (stacked := stacked_projection(t.name)) is not None:
            if stacked[0] < cfg["num_hidden_layers"] + mtp:
                stacks[stacked[0]][stacked[1]] = t
            continue
        hf = name_of(t.name)
        if hf is None:
            continue
        target = net.map_weight_name(hf)
        if target is None:
            continue
        module_name, _, attr = target.param.rpartition(".")
        by_module[module_name].append(_Part(t, hf, target.shard, attr == "bias"))
    check_stacks(gf, stacks)
    served: set[str] = set()
    if native:
        report.kernel = "gguf" if gguf_kernels_available() else "int4"
        for module_name, parts in by_module.items():
            module = modules.get(module_name)
            if report.kernel == "gguf" and isinstance(module, Embedding):
                if _embedding(net, gf, cfg, module_name, parts, report):
                    served.add(module_name)
                continue
            if not isinstance(module, Linear) or not _servable(module, parts, report.kernel == "gguf"):
                continue
            make = _gguf_layer if report.kernel == "gguf" else _int4_layer
            _swap(net, module_name, make(gf, cfg, module, parts))
            gf.release([p.tensor for p in parts])
            release_free_memory()  # what repacking freed (the heap would hold it to the end of the load)
            served.add(module_name)
            report.layers += 1
            report.tensors.update(quant_type_name(p.tensor) for p in parts if not p.is_bias)
    float_stacks = _experts(net, gf, stacks, native and report.kernel == "gguf", report)
    rest = [p for name, parts in by_module.items() if name not in served for p in parts]
    for name, parts in by_module.items():
        kinds = [quant_type_name(p.tensor) for p in parts if not p.is_bias and len(p.tensor.shape) == 2]
        if name not in served and kinds and isinstance(modules.get(name), Linear):
            _loaded_as_floats(report, name, kinds)
    for layer, stack in float_stacks.items():
        _loaded_as_floats(report, _experts_name(net, layer), [quant_type_name(t) for t in stack.values()])
    if native:
        _log_dequantized([p.tensor for p in rest] + [t for stack in float_stacks.values() for t in stack.values()])
    experts = ((name, torch.from_numpy(values)) for layer, stack in float_stacks.items()
               for name, values in float_experts(layer, stack))
    with torch.no_grad():
        net.load_weights(itertools.chain(_float_tensors(gf, cfg, rest), experts))
    gf.release(gf.reader.tensors)  # a token embedding read from the mapping faults back the rows it looks up
    return report


def _loaded_as_floats(report: NativeReport, module: str, kinds: list[str]) -> None:
    """A matrix layer loaded as floats: the type it is then quantized in follows its most common GGUF type."""
    report.module_types[module] = Counter(kinds).most_common(1)[0][0]
    report.dequantized.update(k for k in kinds if k not in FLOAT_TYPES)


def _hf_names(gf: GGUFFile, cfg: dict[str, Any], mtp: bool) -> Callable[[str], str | None]:
    """A GGUF tensor name -> its HF name (None: a tensor the forward does not use; the NextN layer's are read with
    `mtp`, for speculative method "mtp"); a tensor with no place in the architecture is an error."""
    first_moe, n_layers = cfg.get("first_k_dense_replace", 0), cfg["num_hidden_layers"]

    def name_of(name: str) -> str | None:
        if name == "rope_freqs.weight":
            return None  # folded into rope_parameters when config.json was written
        if gf.architecture == "glm4moe":
            if (layer := re.match(r"blk\.(\d+)\.", name)) and int(layer[1]) >= n_layers:
                if not mtp or int(layer[1]) != n_layers or NEXTN_COPIES.match(name):
                    return None  # a multi-token-prediction (NextN) layer, or its copy of the embedding or head
                hf = nextn_tensor_name(name, first_moe)
            else:
                hf = glm4_moe_tensor_name(name, first_moe)
        else:
            hf = hf_tensor_name(name, gf.architecture)
        if hf is None:
            raise ModelFormatError(f"{gf.path.name}: tensor {name!r} has no place in a {gf.architecture} model "
                                   f"as its config.json describes it; this GGUF holds a variant mlc does not read")
        return hf

    return name_of


def _experts_name(net: CausalLM, layer: int) -> str:
    """The routed experts' module of decoder layer `layer` (the one after the trunk is the MTP layer)."""
    return "mtp.mlp.experts" if layer == net.config.num_hidden_layers else f"model.layers.{layer}.mlp.experts"


def _experts(net: CausalLM, gf: GGUFFile, stacks: Stacks, gguf: bool, report: NativeReport) -> Stacks:
    """Each MoE layer's routed experts served from their stacked blocks where `gguf` and the kernel reads them; the
    stacks left to be dequantized."""
    rest: Stacks = {}
    for layer, stack in sorted(stacks.items()):
        name = _experts_name(net, layer)
        module = net.get_submodule(name)
        if not (gguf and isinstance(module, RoutedExperts) and servable(stack, module)):
            rest[layer] = stack
            continue
        experts = gguf_experts(stack, module)
        _swap(net, name, experts)
        gf.release(list(stack.values()))
        release_free_memory()
        report.layers += 2 * experts.n_experts
        report.tensors.update(quant_type_name(t) for t in stack.values())
    return rest


def _log_dequantized(tensors: list) -> None:
    """One line per quantized type served some other way than from its blocks: which tensors, and what they became."""
    by_type: dict[str, list[str]] = defaultdict(list)
    for t in tensors:
        kind = quant_type_name(t)
        if kind not in FLOAT_TYPES and len(t.shape) >= 2:
            by_type[kind].append(t.name)
    for kind, names in by_type.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        log.warning("%d %s tensor(s) (%s) have no native kernel here: dequantized, then served as %s", len(names),
                    kind, shown, GGUF_WEIGHT_DTYPES.get(kind, "floats"))


def _float_tensors(gf: GGUFFile, cfg: dict[str, Any], parts: list[_Part]) -> Iterator[tuple[str, torch.Tensor]]:
    for p in parts:
        yield p.hf_name, _floats(gf, cfg, p.tensor)


def describe(report: NativeReport) -> str:
    """'the GGUF's own Q4_K / Q6_K blocks (gguf kernel, 169 layers)' (the weights line)."""
    native = " / ".join(t for t, _ in report.tensors.most_common())
    rest = ", ".join(f"{n} {t}" for t, n in report.dequantized.most_common())
    how = "gguf kernel" if report.kernel == "gguf" else "as int4 codes, torch's int4 kernel"
    return (f"the GGUF's own {native} blocks ({how}, {report.layers} layers"
            + (f"; dequantized, then quantized: {rest}" if rest else "") + ")")
