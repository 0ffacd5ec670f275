"""A step of decode tokens through a Llama model's layers, one C++ op a layer (`csrc/decode_layer.cpp`).

The op calls the eager layer's own kernels in the eager order, so its result is the eager result bit for bit; it
only removes the Python and dispatch between them (a quarter of a decode step on the default model). It applies
where every op of the eager layer is one of those kernels: a plain Llama layer (no subclass: GLM's extra norms and
rotary run eagerly) whose four projections are `GGUFLinear`s of one format each and no bias, 16-bit activations
(the C++ RMSNorm and SiLU x up), full-width rotary, one rank, no LoRA adapter, a plain paged KV cache in the
compute dtype, and a step in which every sequence decodes one generated token in place (`in_place_decode`).
Anything else runs the eager layers, as before.

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
class LayerPlan:
    """One layer's arguments to the op: [norm, post-attention norm, then the runs of qkv, o, gate|up and down], each
    run's format, (heads, kv heads, head_dim, and the runs of each projection), the norms' eps, the attention
    scale."""

    weights: list[torch.Tensor]
    kinds: list[int]
    dims: list[int]
    eps: float
    scale: float


def _runs(m: nn.Module) -> list[tuple[torch.Tensor, int]] | None:
    """A projection's kernel calls (packed tiles, format), as `GGUFLinear.matmul` makes them."""
    if type(m) is not GGUFLinear or m.bias is not None:
        return None
    return [(getattr(m, f"packed{i}"), kind) for i, (kind, _) in enumerate(m.runs)]


def layer_plan(layer: Any, layer_cls: type, attention_cls: type) -> LayerPlan | None:
    """The op's arguments for `layer`, or None where the op would not compute what its eager forward does."""
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    plain = type(layer) is layer_cls and type(attn) is attention_cls and type(mlp) is GatedMLP
    if not plain:
        return None
    norms: tuple[Any, Any] = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(n) is not RMSNorm or n.weight.dtype not in HALF for n in norms) or norms[0].eps != norms[1].eps:
        return None
    projections = [_runs(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if not attn.fused_rope or any(p is None for p in projections):
        return None
    runs = [run for p in projections if p is not None for run in p]
    return LayerPlan([norms[0].weight, norms[1].weight, *(packed for packed, _ in runs)], [k for _, k in runs],
                     [attn.num_heads, attn.num_kv_heads, attn.head_dim, *(len(p) for p in projections if p)],
                     float(norms[0].eps), float(attn.scale))


def model_plans(layers: nn.ModuleList, layer_cls: type, attention_cls: type) -> list[LayerPlan] | None:
    """Every layer's plan, or None when one layer does not qualify (or the op is not built, or under TP)."""
    if tp_size() != 1 or cpu_op("decode_layer") is None:
        return None
    plans = [layer_plan(layer, layer_cls, attention_cls) for layer in layers]
    return None if any(p is None for p in plans) else [p for p in plans if p is not None]


def step_qualifies(plans: list[LayerPlan], h: torch.Tensor, cos: torch.Tensor, meta: AttentionMetadata,
                   kv_caches: list[LayerCache] | None) -> bool:
    """This step can run the op: decode tokens only, in place, in the plans' dtype, with plain paged caches."""
    group = meta.in_place_decode
    if group is None or kv_caches is None or meta.slot_mapping is None or h.device.type != "cpu":
        return False
    if torch.is_grad_enabled() or h.dtype != plans[0].weights[0].dtype or cos.dtype != h.dtype:
        return False
    if cos.shape[-1] != plans[0].dims[2]:
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
