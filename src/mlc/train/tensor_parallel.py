"""LoRA training on a tensor-parallel model (the tutorial's `parallel_config.model_parallel`), Megatron-style.

The transformers model gets its LoRA adapter whole, exactly as one process would (same random init), and is then
cut: q/k/v/gate/up projections keep this rank's output rows (column-parallel; with their lora_B rows), o/down keep
its input columns (row-parallel; with their lora_A columns, bias on rank 0 only). Hooks put the collectives of
`mlc.distributed.state` around them: the input of a column-parallel layer is `copy_to_tp` (its gradient is summed
over the ranks), the output of a row-parallel layer is `reduce_from_tp`. Embedding, norms and head stay whole.

Two LoRA matrices are whole on every rank but only see a rank's part: lora_A of a column-parallel layer and lora_B of
a row-parallel one. Their gradients are summed over the ranks (`sync_grads`). The gradient norm counts each
parameter once (`clip_grad_norm`), and checkpoints hold the whole adapter (`full_state` / `local_state`), so a
saved adapter serves at any tensor-parallel size and a run resumes at the same one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mlc.distributed.state import copy_to_tp, reduce_from_tp
from mlc.errors import ConfigError

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "gate_up_proj")
ROW = ("o_proj", "down_proj")
HALVES = ("gate_up_proj",)  # fused gate|up: each half is split on its own


@dataclass
class TPTraining:
    rank: int
    size: int
    group: object
    sharded: dict[str, tuple[int, bool]] = field(default_factory=dict)  # param name -> (dim, halves)
    partial: list[nn.Parameter] = field(default_factory=list)  # whole on every rank, gradient from a part

    def sync_grads(self) -> None:
        for p in self.partial:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self.group)

    def clip_grad_norm(self, named_params: list[tuple[str, nn.Parameter]], max_norm: float) -> float:
        """torch's clip_grad_norm_ over the whole (unsharded) parameters."""
        whole = torch.zeros((), dtype=torch.float64)
        parts = torch.zeros((), dtype=torch.float64)
        for name, p in named_params:
            if p.grad is None:
                continue
            sq = p.grad.detach().double().pow(2).sum()
            if name in self.sharded:
                parts += sq
            else:
                whole += sq
        dist.all_reduce(parts, group=self.group)
        total = math.sqrt(float(whole + parts))
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for _, p in named_params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        return total

    def full_state(self, peft_model) -> dict[str, torch.Tensor]:
        """The whole adapter's state dict (PEFT's keys), gathered from the ranks' slices (a collective)."""
        from peft import get_peft_model_state_dict

        names = {_peft_key(n): n for n, _ in peft_model.named_parameters()}
        state = get_peft_model_state_dict(peft_model)
        for key, value in state.items():
            name = names.get(key)
            if name in self.sharded:
                dim, halves = self.sharded[name]
                parts = [torch.empty_like(value) for _ in range(self.size)]
                dist.all_gather(parts, value.contiguous(), group=self.group)
                if halves:
                    gate = [p.chunk(2, dim=dim)[0] for p in parts]
                    up = [p.chunk(2, dim=dim)[1] for p in parts]
                    parts = gate + up
                state[key] = torch.cat(parts, dim=dim)
        return state

    def local_state(self, peft_model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's slices of a whole adapter state dict."""
        names = {_peft_key(n): n for n, _ in peft_model.named_parameters()}
        return {k: (_cut(v, *self.sharded[names[k]], self.rank, self.size) if names.get(k) in self.sharded else v)
                for k, v in state.items()}


def _peft_key(param_name: str) -> str:
    """PEFT's saved key for a parameter name (the adapter's name is dropped)."""
    return param_name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


def _cut(t: torch.Tensor, dim: int, halves: bool, rank: int, size: int) -> torch.Tensor:
    if halves:
        return torch.cat([_cut(h, dim, False, rank, size) for h in t.chunk(2, dim=dim)], dim=dim)
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n).clone()


def check_trainable(cfg, size: int) -> None:
    """Only dense models whose heads, KV heads and MLP width split evenly."""
    if getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None):
        raise ConfigError(f"model_parallel {size}: LoRA training of mixture-of-experts models is not split across "
                          "ranks yet; use model_parallel 1 with data_parallel")
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    for what, n in (("attention heads", cfg.num_attention_heads), ("KV heads", kv),
                    ("MLP intermediate size", cfg.intermediate_size)):
        if n % size:
            raise ConfigError(f"model_parallel {size} does not divide the model's {what} ({n}); use a size that "
                              f"divides {n}")


def shard_for_training(peft_model, rank: int, size: int, group) -> TPTraining:
    """Cut the LoRA-wrapped model in place to this rank's part and install the collectives (see the module doc)."""
    from mlc.distributed.state import set_parallel_state

    check_trainable(peft_model.config, size)
    set_parallel_state(rank, size, group=group)
    tp = TPTraining(rank, size, group)
    names = {id(p): n for n, p in peft_model.named_parameters()}
    for path, module in list(peft_model.named_modules()):
        leaf = path.rsplit(".", 1)[-1]
        if leaf not in COLUMN + ROW or not isinstance(getattr(module, "base_layer", module), nn.Linear):
            continue
        col, halves = leaf in COLUMN, leaf in HALVES
        base = getattr(module, "base_layer", module)
        if col:
            base.weight = nn.Parameter(_cut(base.weight.data, 0, halves, rank, size), requires_grad=False)
            if base.bias is not None:
                base.bias = nn.Parameter(_cut(base.bias.data, 0, halves, rank, size), requires_grad=False)
            base.out_features = base.weight.shape[0]
        else:
            base.weight = nn.Parameter(_cut(base.weight.data, 1, False, rank, size), requires_grad=False)
            if base.bias is not None and rank:
                base.bias.data.zero_()  # the reduced sum adds rank 0's bias once
            base.in_features = base.weight.shape[1]
        for adapter in getattr(module, "lora_A", {}):
            a, b = module.lora_A[adapter], module.lora_B[adapter]
            cut, whole, dim = (b, a, 0) if col else (a, b, 1)
            name = names[id(cut.weight)]
            cut.weight = nn.Parameter(_cut(cut.weight.data, dim, halves and col, rank, size))
            if col:
                cut.out_features = cut.weight.shape[0]
            else:
                cut.in_features = cut.weight.shape[1]
            tp.sharded[name] = (dim, halves and col)
            tp.partial.append(whole.weight)
        if col:
            module.register_forward_pre_hook(lambda m, args: (copy_to_tp(args[0]), *args[1:]))
        else:
            module.register_forward_hook(lambda m, args, out: reduce_from_tp(out))
    return tp


def groups(world: int, tp: int) -> tuple[object, object | None, int, int]:
    """(this rank's tensor-parallel group, its data-parallel group or None, tp rank, data rank). Ranks
    `k*tp .. k*tp + tp - 1` hold one copy of the model; ranks with the same tp rank form a data-parallel group."""
    rank = dist.get_rank()
    tp_group = dp_group = None
    for k in range(world // tp):
        g = dist.new_group(list(range(k * tp, (k + 1) * tp)))
        if rank // tp == k:
            tp_group = g
    if world // tp > 1:
        for r in range(tp):
            g = dist.new_group(list(range(r, world, tp)))
            if rank % tp == r:
                dp_group = g
    return tp_group, dp_group, rank % tp, rank // tp
