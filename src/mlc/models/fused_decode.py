"""A step of decode tokens through a Llama, GLM or GLM-4-0414 model's layers, one C++ op a layer
(`csrc/decode_layer.cpp`).

The op calls the eager layer's own kernels in the eager order, so its result is the eager result bit for bit; it
only removes the Python and dispatch between them (a quarter of a decode step on the default model). It applies
where every op of the eager layer is one of those kernels: a layer of exactly the model's own classes (`Fusable`:
Llama's half-split rotary over the whole head; GLM's interleaved rotary over part of it, a qkv bias, and GLM-4-0414's
sandwich norms) whose four projections are `GGUFLinear`s (a run of kernel calls each, as `GGUFLinear.matmul` makes
them) with no bias but qkv's, 16-bit activations (the C++ RMSNorm and SiLU x up), one rank, no LoRA adapter, a
plain paged KV cache in the compute dtype, and a step in which every sequence decodes one generated token in place
(`in_place_decode`). Anything else (MoE layers, int4/int8 layers, prefill and mixed steps) runs the eager layers.

A model's plans are built at its first decode step and kept; `CausalLM.modules_changed` (called where a LoRA
adapter wraps a projection) drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mlc.distributed.state import tp_size
from mlc.layers.attention import AttentionMetadata
from mlc.layers.cpu_kernels import cpu_op
from mlc.layers.gguf_linear import GGUFLinear
from mlc.layers.kv_store import LayerCache, PagedTensor
from mlc.layers.mlp import GatedMLP
from mlc.layers.norm import RMSNorm

HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fusable:
    """The layer and attention classes a model's op runs for, and what their eager forward does."""

    layer_cls: type
    attention_cls: type
    interleaved: bool  # GLM's pairwise rotary over cos's width; else half-split over the whole head
    sandwich: bool  # GLM-4-0414: post_self_attn_layernorm and post_mlp_layernorm before the residual adds


@dataclass(frozen=True)
class LayerPlan:
    """One layer's arguments to the op (csrc/decode_layer.cpp says their order)."""

    weights: list[torch.Tensor]
    kinds: list[int]
    dims: list[int]
    eps: float
    scale: float


def _runs(m: nn.Module, bias_ok: bool = False) -> list[tuple[torch.Tensor, int]] | None:
    """A projection's kernel calls (packed tiles, format), as `GGUFLinear.matmul` makes them."""
    if type(m) is not GGUFLinear or (m.bias is not None and not bias_ok):
        return None
    return [(getattr(m, f"packed{i}"), kind) for i, (kind, _) in enumerate(m.runs)]


def layer_plan(layer: Any, fusable: Fusable) -> LayerPlan | None:
    """The op's arguments for `layer`, or None where the op would not compute what its eager forward does."""
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    plain = type(layer) is fusable.layer_cls and type(attn) is fusable.attention_cls and type(mlp) is GatedMLP
    if not plain or not (fusable.interleaved or attn.fused_rope):
        return None
    names = ["input_layernorm", "post_attention_layernorm"]
    names += ["post_self_attn_layernorm", "post_mlp_layernorm"] if fusable.sandwich else []
    norms: list[Any] = [getattr(layer, n, None) for n in names]
    dtype = norms[0].weight.dtype if type(norms[0]) is RMSNorm else None
    if dtype not in HALF or any(type(n) is not RMSNorm or n.weight.dtype != dtype or n.eps != norms[0].eps
                                for n in norms):
        return None
    projections = [_runs(attn.qkv_proj, bias_ok=True), _runs(attn.o_proj), _runs(mlp.gate_up_proj),
                   _runs(mlp.down_proj)]
    if any(p is None for p in projections):
        return None
    bias = [attn.qkv_proj.bias.to(dtype)] if attn.qkv_proj.bias is not None else []  # as `_add_bias` casts it
    runs = [run for p in projections if p is not None for run in p]
    dims = [attn.num_heads, attn.num_kv_heads, attn.head_dim, int(fusable.interleaved), int(fusable.sandwich),
            len(bias), *(len(p) for p in projections if p is not None)]
    return LayerPlan([n.weight for n in norms] + bias + [packed for packed, _ in runs], [k for _, k in runs], dims,
                     float(norms[0].eps), float(attn.scale))


def model_plans(layers: nn.ModuleList, fusable: Fusable) -> list[LayerPlan] | None:
    """Every layer's plan, or None when one layer does not qualify (or the op is not built, or under TP)."""
    if tp_size() != 1 or cpu_op("decode_layer") is None:
        return None
    plans = [layer_plan(layer, fusable) for layer in layers]
    return None if any(p is None for p in plans) else [p for p in plans if p is not None]


def step_qualifies(plans: list[LayerPlan], h: torch.Tensor, cos: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[LayerCache] | None) -> bool:
    """This step can run the op: decode tokens only, in place, in the plans' dtype, with plain paged caches."""
    group = meta.in_place_decode
    if group is None or kv_caches is None or meta.slot_mapping is None or h.device.type != "cpu":
        return False
    if torch.is_grad_enabled() or h.dtype != plans[0].weights[0].dtype or cos.dtype != h.dtype:
        return False
    head_dim, interleaved = plans[0].dims[2], plans[0].dims[3]
    if not (cos.shape[-1] <= head_dim and cos.shape[-1] % 2 == 0 if interleaved else cos.shape[-1] == head_dim):
        return False
    return all(type(c.get("k")) is PagedTensor and type(c.get("v")) is PagedTensor and
               c["k"].data.dtype == c["v"].data.dtype == h.dtype for c in kv_caches)


def run_layers(plans: list[LayerPlan], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               meta: AttentionMetadata, kv_caches: list[LayerCache]) -> torch.Tensor:
    """h after every layer, one op call each (the caller checked `step_qualifies`)."""
    op = cpu_op("decode_layer")
    group = meta.in_place_decode
    assert group is not None and op is not None and meta.slot_mapping is not None
    for p, cache in zip(plans, kv_caches, strict=True):
        h = op(h, cos, sin, p.weights, p.kinds, p.dims, p.eps, p.scale, cache["k"].data, cache["v"].data,
               meta.slot_mapping, group.pages, group.context, group.page_size)
    return h
