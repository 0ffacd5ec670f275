"""`loss.png` from a run's train_log.jsonl: raw loss, its exponential moving average, and eval points; for the
preference stages (dpo, kto, rm) a second panel with rewards/chosen, rewards/rejected, rewards/margins and
rewards/accuracies (right axis)."""

from __future__ import annotations

import math
from pathlib import Path

from mlc.errors import DataError
from mlc.train.logging import TrainLog, parse_number


def smooth(values: list[float], weight: float = 0.9) -> list[float]:
    """Bias-corrected EMA (TensorBoard-style), so the curve starts at the first value instead of at 0."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight**i))
    return out


def auto_weight(n: int) -> float:
    """Less smoothing for short runs (an EMA of 0.9 over 20 points mostly shows its own lag), up to 0.9."""
    return min(0.9, 1.8 * (1 / (1 + math.exp(-0.05 * n)) - 0.5))


def plot_loss(run_dir: str | Path, out: str | Path | None = None, weight: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log = TrainLog(run_dir)
    points = [(r["step"], parse_number(r["loss"])) for r in log.step_records() if not r.get("skipped")]
    points = [(s, v) for s, v in points if v is not None and math.isfinite(v)]
    if not points:
        raise DataError(f"{log.path} has no finite loss values to plot; has the run logged a step yet?")
    steps, losses = zip(*points)
    weight = auto_weight(len(points)) if weight is None else weight
    rewards = [r for r in log.step_records() if "rewards/margins" in r and not r.get("skipped")]
    if rewards:
        fig, (ax, rax) = plt.subplots(2, 1, figsize=(8, 8), dpi=100, sharex=True)
        _plot_rewards(rax, rewards)
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="train loss")
    ax.plot(steps, smooth(list(losses), weight), color="tab:blue", linewidth=2, label=f"smoothed (EMA {weight:.2f})")
    evals = [(r["step"], parse_number(r["eval_loss"])) for r in log.eval_records()]
    evals = [(s, v) for s, v in evals if v is not None and math.isfinite(v)]
    if evals:
        ax.plot(*zip(*evals), "o-", color="tab:orange", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "loss.png"
    fig.savefig(out)
    plt.close(fig)
    return out


REWARD_SERIES = (("rewards/chosen", "tab:green"), ("rewards/rejected", "tab:red"), ("rewards/margins", "tab:purple"))


def _plot_rewards(ax, records: list[dict]) -> None:
    for key, color in REWARD_SERIES:
        points = [(r["step"], parse_number(r.get(key))) for r in records]
        points = [(s, v) for s, v in points if v is not None and math.isfinite(v)]
        if points:
            ax.plot(*zip(*points), color=color, linewidth=1.5, label=key.split("/")[1])
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    accuracy = [(r["step"], parse_number(r["rewards/accuracies"])) for r in records if "rewards/accuracies" in r]
    if accuracy:
        acc_ax = ax.twinx()
        acc_ax.plot(*zip(*accuracy), "--", color="tab:gray", linewidth=1, label="accuracy")
        acc_ax.set_ylim(-0.05, 1.05)
        acc_ax.set_ylabel("accuracy")
        acc_ax.legend(loc="lower right")
    ax.legend(loc="upper left")
