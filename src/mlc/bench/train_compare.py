"""`bench train`: LoRA SFT on the default model with our trainer and with transformers' Trainer + PEFT, on the same
config, in the same run (issue 32's goals: >= 1.5x tokens/s, <= 0.6x peak RSS, the same loss curve within 1e-3).
With `finetuning_type: qlora` ours stores the base 4-bit and the peer runs LoRA on the base as loaded: the goals are
then the base's bytes (<= 0.3x) and the last step's loss (within 2% of the peer's).

Each side runs in a fresh process (`python -m mlc.train.peer_run SIDE SPEC`), `rounds` times, alternating
which goes first. Both build their model the same way: our `LoRATrainer.setup()` loads the base, seeds and attaches
the PEFT adapter, reads and tokenizes the data and plans the steps. Ours then runs its own steps; the peer hands the
same PEFT model to a `transformers.Trainer` with the same optimizer settings, schedule, clipping, precision and the
very batches our plan gives, in order (a sequential sampler over the rows in step order). LoRA dropout is 0 so that
the two loss curves can be compared step by step.

Per step each side records its loss, seconds (from one step's end to the next's, collation included), tokens
(non-padding) and RSS. Peak RSS is reported two ways: the process's (loading included) and the training's (VmHWM
reset after set-up, `/proc/self/clear_refs`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlc.config.dotted import set_path

SIDES = ("mlc", "hf")


@dataclass
class TrainBenchConfig:
    out_dir: Path
    model: str = "smollm2-135m-instruct"
    data: str = "data/customer_service.jsonl"
    steps: int = 50
    rounds: int = 1
    overrides: dict = field(default_factory=dict)  # TrainConfig keys (dotted), on top of its defaults


def train_config(cfg: TrainBenchConfig, output_dir: str) -> dict:
    raw: dict = {"model": cfg.model, "data": {"train": cfg.data}, "max_steps": cfg.steps, "lora": {"dropout": 0.0},
                 "save_every": 10**6, "output_dir": output_dir}
    for key, value in cfg.overrides.items():
        set_path(raw, key, value)
    return raw


def _run_side(side: str, cfg: TrainBenchConfig, round_no: int) -> dict:
    out = cfg.out_dir / f"{side}-{round_no}.json"
    raw = train_config(cfg, str(cfg.out_dir / f"run-{side}"))
    if side == "hf":  # the peer's reference for a qlora run is LoRA on the base as loaded
        raw["finetuning_type"] = "lora"
        raw.pop("quantization_bit", None)
    spec = {"config": raw, "out": str(out)}
    proc = subprocess.run([sys.executable, "-m", "mlc.train.peer_run", side, json.dumps(spec)],
                          capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"bench train: the {side} side failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def summarize(run: dict) -> dict:
    steps = run["steps"][1:]  # the first step carries one-off costs (allocations, kernel choice) on both sides
    seconds = sum(s["seconds"] for s in steps)
    return {"tokens_per_s": sum(s["tokens"] for s in steps) / seconds if seconds else 0.0,
            "process_peak_mib": run["process_peak_kib"] / 1024,
            "train_peak_mib": (run["train_peak_kib"] or 0) / 1024 or None, "setup_s": run["setup_s"]}


def run_train_bench(cfg: TrainBenchConfig, progress=print) -> dict:
    from mlc.bench.compare_run import machine

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {s: [] for s in SIDES}
    for r in range(cfg.rounds):
        for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
            progress(f"round {r + 1}: {side} ({cfg.steps} steps)")
            runs[side].append(_run_side(side, cfg, r))
            s = summarize(runs[side][-1])
            progress(f"  {s['tokens_per_s']:.0f} tokens/s, peak RSS {s['process_peak_mib']:.0f} MiB "
                     f"(training {s['train_peak_mib'] or 0:.0f} MiB)")
    return verdict(runs, cfg) | {"machine": machine()}


def verdict(runs: dict[str, list[dict]], cfg: TrainBenchConfig) -> dict:
    per = {side: [summarize(r) for r in runs[side]] for side in SIDES}

    def median(side: str, key: str) -> float:
        xs = sorted(s[key] or 0.0 for s in per[side])
        return xs[len(xs) // 2]

    speed = median("mlc", "tokens_per_s") / median("hf", "tokens_per_s")
    rss = median("mlc", "process_peak_mib") / median("hf", "process_peak_mib")
    a, b = runs["mlc"][0]["steps"], runs["hf"][0]["steps"]
    diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(a, b) if "loss" in x and "loss" in y]
    out: dict = {"config": {**asdict(cfg), "out_dir": str(cfg.out_dir)}, "per_round": per, "runs": runs,
           "speed_ratio": round(speed, 3), "peak_rss_ratio": round(rss, 3),
           "max_loss_diff": max(diffs) if diffs else None, "steps_compared": len(diffs)}
    q = runs["mlc"][0].get("quantized")
    if q:  # qlora against the peer's LoRA on the base as loaded: the goals are memory and the loss it reaches
        last = a[-1].get("loss"), b[-1].get("loss")
        out["base_bytes_ratio"] = round(q["bytes_after"] / q["bytes_before"], 3)
        out["final_loss"] = {"qlora": last[0], "lora": last[1]}
        out["goals"] = {"base weights <= 0.3x": out["base_bytes_ratio"] <= 0.3,
                        "final loss within 2% of LoRA": None not in last and abs(last[0] - last[1]) <= 0.02 * last[1]}
        return out
    out["goals"] = {"tokens_per_s >= 1.5x": speed >= 1.5, "peak RSS <= 0.6x": rss <= 0.6,
                    "loss within 1e-3 every step": bool(diffs) and max(diffs) <= 1e-3 and len(diffs) == cfg.steps}
    return out


def plot(result: dict, path: Path) -> Path:
    from mlc.bench.plots import pyplot

    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.5, 6.5), dpi=110, sharex=True)
    ours = "mlc QLoRA" if result.get("base_bytes_ratio") else "mlc"
    for side, label in (("mlc", ours), ("hf", "transformers Trainer + PEFT")):
        steps = result["runs"][side][0]["steps"]
        xs = list(range(1, len(steps) + 1))
        ax1.plot(xs, [s.get("loss", float("nan")) for s in steps], label=label)
        ax2.plot(xs, [s["rss_kib"] / 1024 for s in steps], label=label)
    ax1.set_ylabel("training loss")
    ax2.set_ylabel("RSS (MiB)")
    ax2.set_xlabel("step")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    kind = "QLoRA" if result.get("base_bytes_ratio") else "LoRA"
    fig.suptitle(f"{kind} SFT: {result['speed_ratio']:.2f}x tokens/s, {result['peak_rss_ratio']:.2f}x peak RSS "
                 "(mlc / transformers Trainer + PEFT LoRA)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
