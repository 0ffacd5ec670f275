"""Which checkpoint a run resumes from: the newest whole one (checked by rank 0, agreed by every rank), and whether
it was saved by the same run (the keys that decide which rows and weights a step sees must not change)."""

from __future__ import annotations

from pathlib import Path

import torch

from mlc.config.train_config import TrainConfig
from mlc.errors import ConfigError, TrainingError
from mlc.train import checkpoint as ckpt
from mlc.train.distributed import DistInfo, all_reduce_sum
from mlc.train.logging import warn

RESUME_KEYS = ("model", "data", "lora", "seed", "max_seq_len", "train_on_prompt", "stage", "pref_loss",
               "finetuning_type")


def _default(key: str):
    field = TrainConfig.model_fields.get(key)
    return field.default if field is not None else None


def check_resumable(cfg: TrainConfig, world_size: int, state: dict, path: Path) -> None:
    saved = state.get("config", {})
    now = cfg.model_dump()
    # keys added later: a checkpoint saved before them had their defaults
    changed = [k for k in RESUME_KEYS if saved.get(k, _default(k)) != now.get(k)]
    if state.get("rows_per_step") != cfg.rows_per_step(world_size):
        changed.append("batch_size x gradient_accumulation_steps x nproc")
    if changed:
        raise ConfigError(
            f"{path} was saved with a different {', '.join(changed)}; resuming would not continue that run. "
            "Use a new output_dir, or pass --fresh to start this one over"
        )


def usable_checkpoint(out: Path, dist: DistInfo, must_resume: bool) -> Path | None:
    """The newest whole checkpoint: rank 0 checks them newest first, says which it skipped and why, and every
    rank takes its choice. None when there is none (an error instead when `must_resume` and some exist)."""
    found = ckpt.list_checkpoints(out)
    chosen, skipped = None, []
    if dist.is_main:
        for path in reversed(found):
            problem = ckpt.checkpoint_problem(path)
            if problem is None:
                chosen = path
                break
            skipped.append((path, problem))
        for path, problem in skipped:
            then = f"resuming from {chosen.name} instead" if chosen else "no older checkpoint is usable"
            warn(f"checkpoint {path} skipped: {problem}; {then}")
    # Every rank must resume from the same step: rank 0's choice as step + 1 (0: none), summed over ranks.
    code = torch.tensor([ckpt.step_of(chosen) + 1 if chosen else 0], dtype=torch.float64)
    step = int(all_reduce_sum(code, dist, per_copy=False).item()) - 1
    if step >= 0:
        return ckpt.checkpoint_root(out) / ckpt.step_dir_name(step)
    if found and must_resume:
        raise TrainingError(
            f"--resume: none of the {len(found)} checkpoint(s) in {ckpt.checkpoint_root(out)} is usable "
            "(the reasons are printed above); pass --fresh to start over"
        )
    if found and dist.is_main:
        warn(f"no usable checkpoint in {ckpt.checkpoint_root(out)} ({len(found)} skipped, see above): "
             "STARTING OVER FROM STEP 0; the damaged ones are deleted as this run saves its own")
    return None
