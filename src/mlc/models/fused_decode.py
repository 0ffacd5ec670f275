"""A step of decode tokens through a Llama, GLM, GLM-4-0414 or GLM-4.5 (MoE) model's layers, one C++ op a layer
(`csrc/decode_layer.cpp`).

The op calls the eager layer's own kernels in the eager order, so its result is the eager result bit for bit; it
only removes the Python and dispatch between them (a quarter of a decode step on the default model). It applies
where every op of the eager layer is one of those kernels: a layer of exactly the model's own classes (`Fusable`:
Llama's half-split rotary; GLM's interleaved rotary over part of the head, a qkv bias, GLM-4-0414's sandwich norms;
GLM-4.5's partial half-split rotary without q/k norms and its MoE blocks, router and routed experts as
`layers/moe.py` runs them) whose projections are `GGUFLinear`s (a run of kernel calls each, as `GGUFLinear.matmul`
makes them; an expert's one call each) with no bias but qkv's, 16-bit activations (the C++ RMSNorm and SiLU x up),
one rank, no LoRA adapter, a plain paged KV cache in the compute dtype, and a step in which every sequence decodes
one generated token in place (`in_place_decode`). Anything else (int4/int8 layers, q/k norms, experts split across
ranks, prefill and mixed steps) runs the eager layers.

A model's plans are built at its first decode step and kept; `CausalLM.modules_changed` (called where a LoRA
adapter wraps a projection) drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mlc.distributed.state import tp_size
from mlc.layers.attention import AttentionMetadata
from mlc.layers.cpu_kernels import cpu_op
from mlc.layers.gguf_linear import GGUFLinear
from mlc.layers.kv_store import LayerCache, PagedTensor
from mlc.layers.mlp import GatedMLP
from mlc.layers.moe import SparseMoeBlock, TopkRouter
from mlc.layers.norm import RMSNorm
from mlc.layers.quant_moe import QuantizedExperts

HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fusable:
    """The layer and attention classes a model's op runs for, and what their eager forward does."""

    layer_cls: type
    attention_cls: type
    interleaved: bool  # GLM's pairwise rotary over cos's width; else half-split (over cos's width too)
    sandwich: bool  # GLM-4-0414: post_self_attn_layernorm and post_mlp_layernorm before the residual adds
    own_rotary: bool = False  # the attention's `rotate` is half-split RoPE unless it norms q and k (GLM-4.5)


@dataclass(frozen=True)
class LayerPlan:
    """One layer's arguments to the op (csrc/decode_layer.cpp says their order)."""

    weights: list[torch.Tensor]
    kinds: list[int]
    dims: list[int]
    eps: float
    scale: float
    experts: list[torch.Tensor] = field(default_factory=list)  # a MoE layer's router, then its experts' tiles
    moe: list[int] = field(default_factory=list)
    routed_scale: float = 1.0


def _runs(m: nn.Module, bias_ok: bool = False) -> list[tuple[torch.Tensor, int]] | None:
    """A projection's kernel calls (packed tiles, format), as `GGUFLinear.matmul` makes them."""
    if type(m) is not GGUFLinear or (m.bias is not None and not bias_ok):
        return None
    return [(getattr(m, f"packed{i}"), kind) for i, (kind, _) in enumerate(m.runs)]


def layer_plan(layer: Any, fusable: Fusable) -> LayerPlan | None:
    """The op's arguments for `layer`, or None where the op would not compute what its eager forward does."""
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    moe = _moe(mlp)
    plain = type(layer) is fusable.layer_cls and type(attn) is fusable.attention_cls and (
        type(mlp) is GatedMLP or moe is not None)
    if not plain or not (fusable.interleaved or attn.fused_rope or (
            fusable.own_rotary and not getattr(attn, "use_qk_norm", True))):
        return None
    names = ["input_layernorm", "post_attention_layernorm"]
    names += ["post_self_attn_layernorm", "post_mlp_layernorm"] if fusable.sandwich else []
    norms: list[Any] = [getattr(layer, n, None) for n in names]
    dtype = norms[0].weight.dtype if type(norms[0]) is RMSNorm else None
    if dtype not in HALF or any(type(n) is not RMSNorm or n.weight.dtype != dtype or n.eps != norms[0].eps
                                for n in norms):
        return None
    dense = mlp if type(mlp) is GatedMLP else mlp.shared_experts
    projections = [_runs(attn.qkv_proj, bias_ok=True), _runs(attn.o_proj),
                   *((_runs(dense.gate_up_proj), _runs(dense.down_proj)) if dense is not None else ([], []))]
    if any(p is None for p in projections) or type(dense) not in (GatedMLP, type(None)):
        return None
    bias = [attn.qkv_proj.bias.to(dtype)] if attn.qkv_proj.bias is not None else []  # as `_add_bias` casts it
    runs = [run for p in projections if p is not None for run in p]
    dims = [attn.num_heads, attn.num_kv_heads, attn.head_dim, int(fusable.interleaved), int(fusable.sandwich),
            len(bias), *(len(p) for p in projections if p is not None)]
    plan = LayerPlan([n.weight for n in norms] + bias + [packed for packed, _ in runs], [k for _, k in runs], dims,
                     float(norms[0].eps), float(attn.scale))
    return plan if moe is None else LayerPlan(plan.weights, plan.kinds, plan.dims, plan.eps, plan.scale, *moe)


def _moe(mlp: Any) -> tuple[list[torch.Tensor], list[int], float] | None:
    """A MoE block's router and experts as the op takes them, or None where its eager forward is not the op's:
    only `SparseMoeBlock` with a `TopkRouter` and `QuantizedExperts` of one rank, each expert one kernel call per
    projection (gate|up, down) of one format across the experts."""
    if type(mlp) is not SparseMoeBlock or type(mlp.gate) is not TopkRouter or type(mlp.experts) is not QuantizedExperts:
        return None
    router, experts = mlp.gate, mlp.experts
    if experts.first != 0 or experts.n_experts != experts.total:
        return None
    gate_up = [_runs(m) for m in experts.gate_up]
    down = [_runs(m) for m in experts.down]
    calls = [r for r in gate_up + down if r is not None]
    if len(calls) != 2 * experts.total or any(len(r) != 1 for r in calls):
        return None
    kinds = {r[0][1] for r in calls[: experts.total]}, {r[0][1] for r in calls[experts.total :]}
    if len(kinds[0]) != 1 or len(kinds[1]) != 1:
        return None
    ints = [router.top_k, router.n_group, router.topk_group, int(router.norm_topk_prob),
            int(mlp.shared_experts is not None), kinds[0].pop(), kinds[1].pop()]
    return [router.weight, router.e_score_correction_bias, *(r[0][0] for r in calls)], ints, float(router.scale)


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
    if not (cos.shape[-1] <= plans[0].dims[2] and cos.shape[-1] % 2 == 0):
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
               meta.slot_mapping, group.pages, group.context, group.page_size, p.experts, p.moe, p.routed_scale)
    return h
