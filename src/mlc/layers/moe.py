"""The DeepSeek-V3 / GLM mixture-of-experts block: sigmoid router with a correction bias and group-limited top-k,
routed SwiGLU experts stored as 3-D tensors, and shared experts added last.

Module tree and parameter names follow transformers (`gate.weight`, `gate.e_score_correction_bias`,
`experts.gate_up_proj`, `experts.down_proj`, `shared_experts.*`), so checkpoints load by their HF names;
`map_moe_weight_name` also reads the hub's per-expert layout (`experts.{e}.{gate,up,down}_proj.weight`).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from mlc.distributed.state import ep_enabled, reduce_from_tp, tp_rank, tp_size
from mlc.errors import ModelFormatError
from mlc.layers.linear import split_evenly
from mlc.layers.mlp import GatedMLP
from mlc.layers.weight_target import WeightTarget

_FUSED_EXPERTS = re.compile(r"(?P<prefix>.*\.experts)\.(?P<param>gate_up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_SHARED = re.compile(r"(?P<prefix>.*\.shared_experts)\.(?P<proj>gate_proj|up_proj)\.(?P<kind>weight|bias)$")
_ROUTER = re.compile(r".*\.gate\.(weight|e_score_correction_bias)$")


def map_moe_weight_name(name: str, moe_intermediate: int) -> WeightTarget | None:
    """Target of a MoE block's checkpoint tensor, in either expert layout; None if `name` is no MoE tensor (the
    caller maps it). `moe_intermediate` is the routed experts' I: per-expert gate goes to rows [0, I) of
    `experts.gate_up_proj[e]`, up to rows [I, 2I)."""
    if _FUSED_EXPERTS.match(name):
        return WeightTarget(name)
    if m := _PER_EXPERT.match(name):
        expert, proj = int(m["expert"]), m["proj"]
        if proj == "down_proj":
            return WeightTarget(f"{m['prefix']}.down_proj", expert=expert)
        rows = (0, moe_intermediate) if proj == "gate_proj" else (moe_intermediate, 2 * moe_intermediate)
        return WeightTarget(f"{m['prefix']}.gate_up_proj", expert=expert, rows=rows)
    if m := _SHARED.match(name):
        return WeightTarget(f"{m['prefix']}.gate_up_proj.{m['kind']}", shard=0 if m["proj"] == "gate_proj" else 1)
    if _ROUTER.match(name) or name.endswith(".shared_experts.down_proj.weight"):
        return WeightTarget(name)
    return None


class TopkRouter(nn.Module):
    """Picks `top_k` experts per token with bias-corrected sigmoid scores, weights them with the uncorrected ones."""

    e_score_correction_bias: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, hidden: int, n_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        if n_experts % n_group or top_k > n_experts or topk_group > n_group:
            raise ModelFormatError(
                f"MoE config is inconsistent: {n_experts} experts, n_group={n_group}, topk_group={topk_group}, "
                f"num_experts_per_tok={top_k}; fix config.json so n_group divides n_routed_experts, "
                "topk_group <= n_group and num_experts_per_tok <= n_routed_experts"
            )
        self.weight = nn.Parameter(torch.empty(n_experts, hidden), requires_grad=False)
        # a learned load-balancing offset; transformers keeps it in fp32 whatever the model dtype
        self.register_buffer("e_score_correction_bias", torch.zeros(n_experts, dtype=torch.float32))
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.scale = norm_topk_prob, routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[T, hidden]` -> (expert ids `[T, top_k]`, fp32 weights `[T, top_k]`)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.n_group > 1:
            choice = self._limit_groups(choice)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scale

    def _limit_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask (with -inf, as transformers 5.x does) the experts outside each token's `topk_group` best groups,
        a group scoring the sum of its two best experts."""
        grouped = choice.view(choice.shape[0], self.n_group, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)


class RoutedExperts(nn.Module):
    """SwiGLU experts as stacked weights: `gate_up_proj [E, 2I, hidden]` (gate rows first), `down_proj [E, hidden, I]`.

    Under tensor parallelism each rank holds either a contiguous block of whole experts (expert parallelism:
    `first`..`first + n_experts`) or every expert with a slice of its intermediate size I; in both cases its output
    is a partial sum that the MoE block reduces across ranks."""

    def __init__(self, hidden: int, intermediate: int, n_experts: int):
        super().__init__()
        self.total = n_experts
        self.n_experts = split_evenly(n_experts, "number of routed experts") if ep_enabled() else n_experts
        self.first = tp_rank() * self.n_experts if ep_enabled() else 0
        self.split = 1 if ep_enabled() else tp_size()
        self.inter = split_evenly(intermediate, "MoE intermediate size", self.split)
        self.gate_up_proj = nn.Parameter(torch.empty(self.n_experts, 2 * self.inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.n_experts, hidden, self.inter), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return dispatch_experts(x, ids, weights, self.total, self._expert, self.first, self.n_experts)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])

    def _cut(self, t: torch.Tensor, dim: int, half: int | None = None) -> torch.Tensor:
        """This rank's slice of the intermediate dimension `dim` (of one half of a fused gate|up)."""
        if self.split == 1:
            return t
        full = t.shape[dim] // (1 if half is None else 2)
        base = 0 if half is None else half * full
        start = base + tp_rank() * (full // self.split)
        return t.narrow(dim, start, full // self.split)

    def load_tensor(self, attr: str, name: str, tensor: torch.Tensor, target: WeightTarget) -> None:
        """One checkpoint tensor: the fused `[E, ...]` stack, or one expert's gate, up or down projection."""
        param = getattr(self, attr)
        if target.expert is None:
            if tensor.shape[0] != self.total:
                raise ModelFormatError(f"{name}: {tensor.shape[0]} experts, the config declares {self.total}; "
                                       "the checkpoint and its config.json disagree")
            tensor = tensor[self.first : self.first + self.n_experts]
            tensor = torch.cat([self._cut(tensor, 1, 0), self._cut(tensor, 1, 1)], dim=1) \
                if attr == "gate_up_proj" and self.split > 1 else self._cut(tensor, 2) \
                if attr == "down_proj" else tensor
            dest = param.data
        else:
            e = target.expert
            if not 0 <= e < self.total:
                raise ModelFormatError(f"{name}: expert {e} does not exist, the config declares {self.total} "
                                       "experts; the checkpoint and its config.json disagree")
            if not self.first <= e < self.first + self.n_experts:
                return  # another rank's expert
            dest = param.data[e - self.first]
            if target.rows is not None:
                half = target.rows[0] // (target.rows[1] - target.rows[0])
                dest = dest[half * self.inter : (half + 1) * self.inter]
                tensor = self._cut(tensor, 0)
            elif attr == "down_proj":
                tensor = self._cut(tensor, 1)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelFormatError(f"{name}: shape {tuple(tensor.shape)} does not match the config's "
                                   f"{tuple(dest.shape)}; the checkpoint and its config.json disagree")
        dest.copy_(tensor)


def dispatch_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_experts: int, expert,
                     first: int = 0, count: int | None = None) -> torch.Tensor:
    """Runs only the experts that received tokens, in ascending expert order, each on its own tokens
    (`expert(e - first, x_rows)`); the weighted outputs are cast to x's dtype before they are summed (transformers'
    order). Only experts `first`..`first + count` run here (this rank's, under expert parallelism)."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    flat_weights = weights.flatten()
    out = torch.zeros_like(x)
    stop = n_experts if count is None else first + count
    start = sum(counts[:first])
    for e in range(first, stop):
        n = counts[e]
        if not n:
            continue
        picks = order[start : start + n]
        start += n
        tokens = picks // top_k
        y = expert(e - first, x[tokens]) * flat_weights[picks, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """`experts(x) + shared_experts(x)` for flat tokens `x [T, hidden]`."""

    def __init__(self, hidden: int, moe_intermediate: int, n_routed_experts: int, top_k: int, n_shared_experts: int,
                 n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0):
        super().__init__()
        self.moe_intermediate = moe_intermediate
        self.gate = TopkRouter(hidden, n_routed_experts, top_k, n_group, topk_group, norm_topk_prob,
                               routed_scaling_factor)
        self.experts = RoutedExperts(hidden, moe_intermediate, n_routed_experts)
        shared = moe_intermediate * n_shared_experts
        self.shared_experts = GatedMLP(hidden, shared, reduce=False) if n_shared_experts else None

    @classmethod
    def from_config(cls, cfg) -> SparseMoeBlock:
        """From a DeepSeek-V3-style HF config (glm4_moe, glm_moe_dsa)."""
        return cls(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                   cfg.n_shared_experts or 0, cfg.n_group or 1, cfg.topk_group or 1, bool(cfg.norm_topk_prob),
                   float(cfg.routed_scaling_factor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return reduce_from_tp(out)  # routed and shared partial sums of every rank, in one reduction
