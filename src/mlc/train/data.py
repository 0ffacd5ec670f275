"""Training data in steps: which rows each optimizer step (and each rank) sees, and how rows become tensors.

The order is a function of (seed, epoch, step) only, so a resumed run sees exactly the rows the interrupted
one would have, and `nproc` ranks with accumulation G see, per step, the same rows as one rank with G * nproc.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils.data import DistributedSampler

from mlc.config.train_config import TrainConfig
from mlc.errors import DataError
from mlc.train.preprocess import IGNORE_INDEX, PreprocessOptions, load_dataset_rows, pad_token_id, tokenize_file

# Preprocess options that change the rows; a preprocessed dir must have been made with the run's values.
MUST_MATCH = ("max_seq_len", "pad_to_multiple_of", "train_on_prompt", "packing")


def load_rows(path: str | Path, tokenizer, opts: PreprocessOptions) -> tuple[list[dict], dict]:
    """A `mlc-cli preprocess` output dir is read as is (its options must match `opts`); a JSONL file is tokenized
    now."""
    path = Path(path)
    if path.is_dir():
        rows, stats = load_dataset_rows(path)
        made_with = stats.get("options", {})
        wrong = [f"{k}={made_with.get(k)!r} (run: {getattr(opts, k)!r})" for k in MUST_MATCH
                 if made_with.get(k) != getattr(opts, k)]
        if wrong:
            raise DataError(
                f"{path} was preprocessed with {', '.join(wrong)}; preprocess it again with the run's settings "
                "or point data.train at the JSONL file"
            )
        return rows, stats
    rows, file_stats = tokenize_file(path, tokenizer, opts)
    return rows, asdict(file_stats)


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row (rows are already multiples of pad_to_multiple_of, so the batch is too)."""
    width = max(len(r["input_ids"]) for r in rows)

    def column(key: str, fill: int) -> torch.Tensor:
        return torch.tensor([r[key] + [fill] * (width - len(r[key])) for r in rows], dtype=torch.long)

    batch = {
        "input_ids": column("input_ids", pad_id),
        "labels": column("labels", IGNORE_INDEX),
        "attention_mask": column("attention_mask", 0),
    }
    if "position_ids" in rows[0]:
        # Packed rows: per-row position ids and no 2-D mask make transformers build a block-diagonal mask.
        batch["position_ids"] = torch.tensor(
            [r["position_ids"] + list(range(width - len(r["position_ids"]))) for r in rows], dtype=torch.long
        )
    return batch


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> dict:
    """Forward kwargs. No cache: with one, transformers would not derive the packed-rows mask from position ids."""
    inputs = {"input_ids": batch["input_ids"].to(device), "use_cache": False}
    if "position_ids" in batch:
        inputs["position_ids"] = batch["position_ids"].to(device)
    else:
        inputs["attention_mask"] = batch["attention_mask"].to(device)
    return inputs


def target_count(batch: dict[str, torch.Tensor]) -> int:
    """Tokens that carry loss: labels after the causal shift that are not masked."""
    return int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


@dataclass
class StepPlan:
    """Row indices per optimizer step for one rank: `accum` micro-batches of `batch_size` rows."""

    num_rows: int
    batch_size: int
    accum: int
    seed: int
    world_size: int = 1
    rank: int = 0

    def __post_init__(self):
        need = self.batch_size * self.accum * self.world_size
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the training set has {self.num_rows} rows but one step needs {need} "
                f"(batch_size {self.batch_size} x gradient_accumulation_steps {self.accum} x {self.world_size} "
                "processes); add data or lower batch_size / gradient_accumulation_steps"
            )
        self._epoch: int | None = None
        self._order: list[int] = []

    @property
    def steps_per_epoch(self) -> int:
        return (self.num_rows // self.world_size) // (self.batch_size * self.accum)

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, step within epoch) of 0-based global step `step`."""
        return divmod(step, self.steps_per_epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            sampler: DistributedSampler[int] = DistributedSampler(
                range(self.num_rows),  # type: ignore[arg-type]  # it only takes len(); torch's stub asks a Dataset
                num_replicas=self.world_size, rank=self.rank,
                shuffle=True, seed=self.seed, drop_last=True,
            )
            sampler.set_epoch(epoch)
            self._epoch, self._order = epoch, list(sampler)
        return self._order

    def micro_batches(self, step: int) -> list[list[int]]:
        epoch, in_epoch = self.position(step)
        order = self._epoch_order(epoch)
        per_step = self.batch_size * self.accum
        rows = order[in_epoch * per_step : (in_epoch + 1) * per_step]
        return [rows[i : i + self.batch_size] for i in range(0, per_step, self.batch_size)]


def batches_for(rows: list[dict], plan: StepPlan, step: int, tokenizer) -> list[dict[str, torch.Tensor]]:
    pad_id = pad_token_id(tokenizer)
    return [collate([rows[i] for i in idx], pad_id) for idx in plan.micro_batches(step)]


@dataclass
class TrainingData:
    """A run's rows, held-out rows, step plan and length; `note`: what the user should hear about dropped rows."""

    rows: list[dict]
    eval_rows: list[dict]
    plan: StepPlan
    total_steps: int
    stats: dict
    note: str | None


def training_data(cfg: TrainConfig, tokenizer, data_world: int, data_rank: int, stats_file: Path) -> TrainingData:
    """Tokenize (or read) the run's training and eval data as its options say, and plan its steps for this rank;
    `stats_file` is where the dropped rows are listed (the caller writes it)."""
    opts = PreprocessOptions(
        max_seq_len=cfg.max_seq_len, pad_to_multiple_of=cfg.data.pad_to_multiple_of,
        train_on_prompt=cfg.train_on_prompt, packing=cfg.data.packing, format=cfg.data.format,
        on_error=cfg.data.on_error,
    )
    rows, stats = load_rows(cfg.data.train, tokenizer, opts)
    eval_opts = PreprocessOptions(**{**asdict(opts), "packing": False})
    eval_rows = load_rows(cfg.data.eval, tokenizer, eval_opts)[0] if cfg.data.eval else []
    note = None
    if stats.get("dropped"):
        first = stats["dropped"][0]
        note = (f"{len(stats['dropped'])} training row(s) dropped (first: line {first['line']}: {first['reason']}); "
                f"all of them are listed in {stats_file}")
    plan = StepPlan(len(rows), cfg.batch_size, cfg.gradient_accumulation_steps, cfg.seed, data_world, data_rank)
    total = cfg.max_steps if cfg.max_steps is not None else max(1, round((cfg.epochs or 1.0) * plan.steps_per_epoch))
    return TrainingData(rows, eval_rows, plan, total, stats, note)
