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

from mlc.errors import ModelFormatError
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
    """SwiGLU experts as stacked weights: `gate_up_proj [E, 2I, hidden]` (gate rows first), `down_proj [E, hidden, I]`."""

    def __init__(self, hidden: int, intermediate: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, intermediate), requires_grad=False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return dispatch_experts(x, ids, weights, self.n_experts, self._expert)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


def dispatch_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, n_experts: int, expert) -> torch.Tensor:
    """Runs only the experts that received tokens, in ascending expert order, each on its own tokens
    (`expert(e, x_rows)`); the weighted outputs are cast to x's dtype before they are summed (transformers' order)."""
    top_k = ids.shape[1]
    flat = ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    flat_weights = weights.flatten()
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        picks = order[start : start + count]
        start += count
        tokens = picks // top_k
        y = expert(e, x[tokens]) * flat_weights[picks, None]
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """`experts(x) + shared_experts(x)` for flat tokens `x [T, hidden]`."""

    def __init__(self, hidden: int, moe_intermediate: int, n_routed_experts: int, top_k: int, n_shared_experts: int,
                 n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0):
        super().__init__()
        self.moe_intermediate = moe_intermediate
        self.gate = TopkRouter(hidden, n_routed_experts, top_k, n_group, topk_group, norm_topk_prob,
                               routed_scaling_factor)
        self.experts = RoutedExperts(hidden, moe_intermediate, n_routed_experts)
        self.shared_experts = GatedMLP(hidden, moe_intermediate * n_shared_experts) if n_shared_experts else None

    @classmethod
    def from_config(cls, cfg) -> SparseMoeBlock:
        """From a DeepSeek-V3-style HF config (glm4_moe, glm_moe_dsa)."""
        return cls(cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok,
                   cfg.n_shared_experts or 0, cfg.n_group or 1, cfg.topk_group or 1, bool(cfg.norm_topk_prob),
                   float(cfg.routed_scaling_factor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        return out + self.shared_experts(x) if self.shared_experts is not None else out
