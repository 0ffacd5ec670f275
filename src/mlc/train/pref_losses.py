"""The preference losses, written out (no TRL at run time: it is not a dependency, and these are a few lines each).

They follow TRL 1.x's definitions, which the tests check them against:
- sigmoid (DPO): -log σ(β((π_c - ref_c) - (π_r - ref_r))), log-probs summed over the reply's tokens.
- ipo: ((π_c - ref_c)/n_c - (π_r - ref_r)/n_r - 1/(2β))², TRL's length-normalized IPO.
- orpo: NLL(chosen) - β log σ(log odds(chosen) - log odds(rejected)), with per-token mean log-probs; no reference.
- simpo: -log σ(β(mean π_c - mean π_r) - γ); no reference.
- kto: desirable 1 - σ(β(π - ref - KL)), undesirable 1 - σ(β(KL - (π - ref))), weighted; KL is the detached mean
  log-ratio over mismatched (prompt, reply) pairs, clamped at 0.
- rm: -log σ(r_c - r_r), Bradley-Terry over the reward head's scalars.

Each returns (loss, chosen rewards, rejected rewards); rewards are what TRL logs (β · log-ratio, or β · mean
log-prob without a reference, the raw scores for rm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlc.train.preprocess import IGNORE_INDEX

Tensor = torch.Tensor


def sequence_logps(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: the summed log-probability of its unmasked labels (after the causal shift), and their count."""
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1), mask.sum(-1)


def dpo_sigmoid(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor, beta: float) -> tuple[Tensor, Tensor, Tensor]:
    chosen, rejected = pc - rc, pr - rr
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    return loss, beta * chosen.detach(), beta * rejected.detach()


def ipo(pc: Tensor, pr: Tensor, rc: Tensor, rr: Tensor, nc: Tensor, nr: Tensor,
        beta: float) -> tuple[Tensor, Tensor, Tensor]:
    chosen, rejected = pc - rc, pr - rr
    delta = chosen / nc.clamp(min=1) - rejected / nr.clamp(min=1)
    loss = ((delta - 1 / (2 * beta)) ** 2).mean()
    return loss, beta * chosen.detach(), beta * rejected.detach()


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo(avg_c: Tensor, avg_r: Tensor, nll: Tensor, beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """`avg_*`: per-token mean log-probs; `nll`: the chosen replies' mean token cross-entropy."""
    avg_c, avg_r = avg_c.float(), avg_r.float()
    log_odds = (avg_c - avg_r) - (log1mexp(avg_c) - log1mexp(avg_r))
    loss = nll - (beta * F.logsigmoid(log_odds)).mean()
    return loss, beta * avg_c.detach(), beta * avg_r.detach()


def simpo(avg_c: Tensor, avg_r: Tensor, beta: float, gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    logits = (avg_c - avg_r) - gamma / beta
    loss = -F.logsigmoid(beta * logits).mean()
    return loss, beta * avg_c.detach(), beta * avg_r.detach()


def kto(policy: Tensor, ref: Tensor, desirable: Tensor, kl_policy: Tensor, kl_ref: Tensor, beta: float,
        w_desirable: float, w_undesirable: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (loss, desirable rewards, undesirable rewards, KL estimate)."""
    kl = (kl_policy - kl_ref).mean().detach().clamp(min=0)
    ratio = policy - ref
    chosen, rejected = ratio[desirable], ratio[~desirable]
    losses = torch.cat((w_desirable * (1 - torch.sigmoid(beta * (chosen - kl))),
                        w_undesirable * (1 - torch.sigmoid(beta * (kl - rejected)))))
    return losses.mean(), beta * chosen.detach(), beta * rejected.detach(), kl


def bradley_terry(score_c: Tensor, score_r: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    loss = -F.logsigmoid(score_c - score_r).mean()
    return loss, score_c.detach(), score_r.detach()


def reward_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    """TRL's logged names; accuracy and margin only for pairs (KTO's replies are not paired)."""
    out = {}
    if chosen.numel():
        out["rewards/chosen"] = float(chosen.float().mean())
    if rejected.numel():
        out["rewards/rejected"] = float(rejected.float().mean())
    if chosen.shape == rejected.shape and chosen.numel():
        out["rewards/margins"] = float((chosen - rejected).float().mean())
        out["rewards/accuracies"] = float((chosen > rejected).float().mean())
    return out
