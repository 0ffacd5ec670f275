"""`train(cfg)`: the recipe a config's `stage` picks: sft runs `trainer.LoRATrainer`; dpo, kto and rm run
`pref_trainer.PreferenceTrainer` (which builds on it)."""

from __future__ import annotations

from mlc.config.train_config import TrainConfig
from mlc.train.pref_trainer import PreferenceTrainer
from mlc.train.trainer import LoRATrainer, RunOptions, TrainResult

__all__ = ["RunOptions", "TrainResult", "train"]


def train(cfg: TrainConfig, opts: RunOptions | None = None) -> TrainResult:
    recipe = LoRATrainer if cfg.stage == "sft" else PreferenceTrainer
    return recipe(cfg, opts).run()
