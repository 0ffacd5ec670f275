"""The LoRA recipe: one readable loop (torchtune-style) over transformers + PEFT.

Per optimizer step: gradient accumulation over micro-batches (loss = summed token CE / the step's target tokens
across all ranks, so N ranks with accumulation G equal one rank with G * N), gradient clipping at `clip_norm`,
an overflow guard (non-finite loss or gradient norm: no update, counted, logged; too many in a row stops the
run), AdamW, warmup + decay. Checkpoints hold everything a resumed run needs to continue bit-for-bit.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import resource
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

from mlc.config.device import resolve_device
from mlc.config.train_config import TrainConfig
from mlc.errors import ConfigError, TrainingError
from mlc.models.store import resolve_model_dir
from mlc.models.tokenizer import load_tokenizer
from mlc.train import checkpoint as ckpt
from mlc.train import distributed
from mlc.train.data import batches_for, target_count, training_data
from mlc.train.distributed import DistInfo, all_reduce_sum, barrier, device_for_rank, init_distributed, shutdown
from mlc.train.evaluate import score_rows
from mlc.train.logging import ConsoleReporter, TrainLog
from mlc.train.model import attach_lora, compute_dtype, load_base_model, loss_sum, trainable_parameters
from mlc.train.plot import plot_loss
from mlc.train.resume import check_resumable, usable_checkpoint

if TYPE_CHECKING:
    from mlc.train.tensor_parallel import TPTraining

ADAPTER_DIR = "adapter"
SUMMARY_FILE = "summary.json"


@dataclass
class RunOptions:
    resume: Literal["auto", "always", "never"] = "auto"
    fresh: bool = False  # delete this output_dir's checkpoints, log and adapter first
    progress: bool = True
    inject_nonfinite_steps: frozenset[int] = frozenset()  # testing aid: these (1-based) steps get loss * inf


@dataclass
class TrainResult:
    output_dir: str
    steps: int
    skipped_steps: int
    train_loss: float | None
    eval_loss_before: float | None
    eval_loss_after: float | None
    tokens_per_s: float
    train_seconds: float
    peak_rss_mb: float
    resumed_from: int | None
    adapter_dir: str
    world_size: int = 1


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def build_scheduler(cfg: TrainConfig, optimizer, total_steps: int):
    from transformers import get_scheduler

    kind = "constant_with_warmup" if cfg.lr_schedule.type == "constant" else cfg.lr_schedule.type
    return get_scheduler(
        kind, optimizer, num_warmup_steps=cfg.lr_schedule.warmup_for(total_steps), num_training_steps=total_steps
    )


class LoRATrainer:
    tp: TPTraining | None  # set when the model is split (cfg.tensor_parallel > 1)
    reporter_note: str | None
    quantized: dict[str, int] | None = None  # finetuning_type qlora: what quantize_base stored 4-bit
    eval_before: float | None
    resumed_from: int | None

    def __init__(self, cfg: TrainConfig, opts: RunOptions | None = None):
        self.cfg = cfg
        self.opts = opts or RunOptions()
        self.out = Path(cfg.output_dir)
        self.device = resolve_device(cfg.device)
        self.dist: DistInfo = init_distributed(self.device, cfg.tensor_parallel)
        self.tp = None  # TPTraining when the model is split (cfg.tensor_parallel > 1)
        self.device = device_for_rank(self.device, self.dist)
        self.dtype = compute_dtype(cfg.precision, self.device)
        self.log = TrainLog(self.out)

    # set-up
    def _prepare_output(self) -> None:
        if self.dist.is_main:
            if self.opts.fresh:
                for name in (ckpt.CHECKPOINTS, ADAPTER_DIR):
                    shutil.rmtree(self.out / name, ignore_errors=True)
                for name in (self.log.path.name, SUMMARY_FILE, "loss.png"):
                    (self.out / name).unlink(missing_ok=True)
            self.out.mkdir(parents=True, exist_ok=True)
        barrier(self.dist)

    def _load_data(self) -> None:
        stats_file = self.out / "data_stats.json"
        data = training_data(self.cfg, self.tokenizer, self.dist.data_world, self.dist.data_rank, stats_file)
        self.rows, self.eval_rows, self.plan, self.total_steps = data.rows, data.eval_rows, data.plan, data.total_steps
        if self.dist.is_main:
            stats_file.write_text(json.dumps(data.stats, indent=2, ensure_ascii=False), encoding="utf-8")
            self.reporter_note = data.note

    def _build_model(self) -> None:
        load_dtype = self.dtype if self.dtype != torch.float16 else torch.float32
        base = load_base_model(self.model_dir, load_dtype, self.device)
        self.peft_model = self._attach(base)
        if self.cfg.finetuning_type == "qlora":
            from mlc.train.qlora import quantize_base

            self.quantized = q = quantize_base(self.peft_model)
            note = (f"qlora: {q['layers']} linear layers of the base stored 4-bit, {q['bytes_before'] / 2**20:.1f} -> "
                    f"{q['bytes_after'] / 2**20:.1f} MiB ({q['bytes_after'] / q['bytes_before']:.2f}x)")
            self.reporter_note = f"{self.reporter_note}; {note}" if self.reporter_note else note
        self.peft_model.train()
        self.model = self.peft_model
        dp_group = None
        if self.cfg.tensor_parallel > 1:
            from mlc.train.tensor_parallel import groups, shard_for_training

            if not self.dist.enabled:
                raise ConfigError(f"tensor_parallel {self.cfg.tensor_parallel} needs one process per rank: run "
                                  "`mlc-cli train`, which starts them")
            tp_group, dp_group, tp_rank, _ = groups(self.dist.world_size, self.cfg.tensor_parallel)
            self.tp = shard_for_training(self.peft_model, tp_rank, self.cfg.tensor_parallel, tp_group)
        if self.dist.data_world > 1:
            self.model = distributed.data_parallel(self.peft_model, self.device, dp_group)
        self.params = trainable_parameters(self.peft_model)
        self.named_params = [(n, p) for n, p in self.peft_model.named_parameters() if p.requires_grad]
        o = self.cfg.optimizer
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.scheduler = build_scheduler(self.cfg, self.optimizer, self.total_steps)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.dtype == torch.float16 else None

    def _attach(self, base):
        """The trainable model around the loaded base (the reward stage adds its head here)."""
        return attach_lora(base, self.cfg.lora)

    def _restore(self) -> int:
        """The step to start from (0 without a usable checkpoint)."""
        if self.opts.resume == "never" and ckpt.latest_checkpoint(self.out) is not None:
            raise ConfigError(
                f"{self.out} already has checkpoints; pass --resume to continue, --fresh to start over, "
                "or choose a new output_dir"
            )
        latest = usable_checkpoint(self.out, self.dist, self.opts.resume == "always") \
            if self.opts.resume != "never" else None
        if latest is None:
            if self.opts.resume == "always":
                raise ConfigError(f"--resume: {self.out} has no complete checkpoint to resume from")
            if self.dist.is_main and self.log.path.exists():
                self.log.truncate_after(-1)  # a run killed before its first checkpoint starts over
            return 0
        state = ckpt.read_state(latest)
        check_resumable(self.cfg, self.dist.data_world, state, latest)
        ckpt.load_checkpoint(latest, self.peft_model, self.optimizer, self.scheduler, self.scaler, self.dist.rank,
                             self.tp)
        self.skipped, self.consecutive_bad = state["skipped_steps"], state["consecutive_bad_steps"]
        self.eval_before = state.get("eval_loss_before")
        self.resumed_from, self.resumed_path = state["step"], latest
        if self.dist.is_main:
            self.log.truncate_after(state["step"])
        barrier(self.dist)
        return state["step"]

    def setup(self) -> None:
        self._prepare_output()
        self.model_dir = resolve_model_dir(self.cfg.model)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.reporter_note = None
        self._load_data()
        seed_everything(self.cfg.seed)
        self._build_model()
        # Dropout streams differ per rank; set after the adapter's random init so that init is the same everywhere.
        seed_everything(self.cfg.seed + self.dist.data_rank)  # the ranks of one model copy draw the same numbers
        self.skipped = self.consecutive_bad = 0
        self.eval_before = None
        self.resumed_from = None
        self.start_step = self._restore()
        if self.dist.is_main:
            (self.out / "train_config.json").write_text(self.cfg.model_dump_json(indent=2), encoding="utf-8")

    # one step
    def _no_sync(self, last: bool):
        if self.dist.data_world > 1 and not last:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def train_step(self, step: int) -> dict:
        """Step `step` (0-based): accumulate, clip, guard, update. Returns the log record."""
        t0 = time.perf_counter()
        batches = batches_for(self.rows, self.plan, step, self.tokenizer)
        counts = torch.tensor(
            [sum(target_count(b) for b in batches), sum(int(b["attention_mask"].sum()) for b in batches)],
            dtype=torch.float64,
        )
        targets, tokens = all_reduce_sum(counts, self.dist).tolist()
        # DDP averages gradients over ranks; multiplying by world_size makes the step's loss the mean over all its
        # tokens.
        scale = self.dist.data_world / max(targets, 1.0)
        local_sum = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(batches):
            with self._no_sync(last=i == len(batches) - 1):
                summed = loss_sum(self.model, batch, self.device, self.dtype)
                if i == 0 and step + 1 in self.opts.inject_nonfinite_steps:
                    summed = summed * float("inf")
                loss = summed * scale
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            local_sum += summed.detach().double().cpu()
        mean_loss = float(all_reduce_sum(local_sum, self.dist)) / max(targets, 1.0)
        grad_norm, lr, finite = self._update(mean_loss)
        elapsed = time.perf_counter() - t0
        return {
            "step": step + 1, "epoch": round((step + 1) / self.plan.steps_per_epoch, 4), "loss": mean_loss,
            "lr": lr, "grad_norm": grad_norm, "tokens": int(tokens), "tokens_per_s": tokens / elapsed,
            "skipped": not finite, "seconds": elapsed,
        }

    def _update(self, mean_loss: float) -> tuple[float, float, bool]:
        """Clip, guard and step on the accumulated gradients: (grad norm, lr used, whether the update was made)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = self.cfg.clip_norm if self.cfg.clip_norm is not None else float("inf")
        if self.tp is not None:
            self.tp.sync_grads()
            grad_norm = self.tp.clip_grad_norm(self.named_params, clip)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, clip))
        lr = self.scheduler.get_last_lr()[0]
        finite = math.isfinite(mean_loss) and math.isfinite(grad_norm)
        if finite and self.scaler is not None:
            self.scaler.step(self.optimizer)
        elif finite:
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()  # a skipped step still advances the schedule, so the run ends on schedule
        return grad_norm, lr, finite

    def _count(self, record: dict, reporter: ConsoleReporter) -> None:
        """Overflow bookkeeping: a skipped step is counted and announced; a good one resets the streak."""
        if not record["skipped"]:
            self.consecutive_bad = 0
        else:
            self.skipped += 1
            self.consecutive_bad += 1
            reporter.note(
                f"[yellow]step {record['step']}: loss {record['loss']} / grad norm {record['grad_norm']} is not "
                f"finite; update skipped ({self.consecutive_bad} in a row, {self.skipped} in total)[/]"
            )
        record["skipped_total"] = self.skipped

    def _stop_if_diverged(self, record: dict) -> None:
        if self.consecutive_bad >= self.cfg.max_consecutive_bad_steps:
            raise TrainingError(
                f"{self.consecutive_bad} steps in a row (up to step {record['step']}) had a non-finite loss or "
                "gradient norm; stopping. Try: lower optimizer.lr (e.g. 1e-4), keep clip_norm at 1.0, use "
                "precision fp32 or bf16 instead of fp16, lower gradient_accumulation_steps, and check the data for "
                f"broken rows; then continue from the last checkpoint with --resume (see {self.log.path})"
            )

    # evaluation and saving
    @torch.no_grad()
    def evaluate(self) -> float | None:
        if not self.eval_rows:
            return None
        self.peft_model.eval()
        mine = self.eval_rows[self.dist.data_rank :: self.dist.data_world]
        total, count = score_rows(self.peft_model, mine, self.tokenizer, self.device, self.dtype, self.cfg.batch_size)
        self.peft_model.train()
        totals = torch.tensor([total, count], dtype=torch.float64)
        total, count = all_reduce_sum(totals, self.dist).tolist()
        return total / max(count, 1.0)

    def _log_eval(self, step: int, loss: float | None, reporter: ConsoleReporter) -> None:
        if loss is None:
            return
        if self.dist.is_main:
            self.log.append({"step": step, "eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))})
        reporter.note(f"step {step}: eval loss {loss:.4f} (ppl {math.exp(min(loss, 50.0)):.2f})")

    def save(self, step: int) -> None:
        tmp = ckpt.begin_save(self.out, step) if self.dist.is_main else ckpt.tmp_dir(self.out, step)
        barrier(self.dist)
        ckpt.save_rank_state(tmp, self.dist.rank)
        adapter = self.tp.full_state(self.peft_model) if self.tp is not None else None  # a collective
        if self.tp is not None and self.dist.data_rank == 0 and self.tp.rank > 0:
            torch.save(self.optimizer.state_dict(), tmp / f"optimizer-tp{self.tp.rank}.pt")
        barrier(self.dist)
        if self.dist.is_main:
            epoch, in_epoch = self.plan.position(step)
            state = {
                "step": step, "next_position": {"epoch": epoch, "step_in_epoch": in_epoch},
                "skipped_steps": self.skipped, "consecutive_bad_steps": self.consecutive_bad,
                "eval_loss_before": self.eval_before, "world_size": self.dist.world_size,
                "rows_per_step": self.cfg.rows_per_step(self.dist.data_world), "config": self.cfg.model_dump(),
            }
            ckpt.finish_save(
                tmp, step, self.peft_model, self.optimizer, self.scheduler, self.scaler, state,
                self.cfg.keep_checkpoints, adapter,
            )
        barrier(self.dist)

    def _save_adapter(self) -> Path:
        final = self.out / ADAPTER_DIR
        adapter = self.tp.full_state(self.peft_model) if self.tp is not None else None  # a collective
        if self.dist.is_main:
            tmp = self.out / f".{ADAPTER_DIR}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            ckpt.save_adapter(self.peft_model, tmp, adapter)
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        barrier(self.dist)
        return final

    # the loop
    def run(self) -> TrainResult:
        try:
            return self._run()
        finally:
            shutdown(self.dist)

    def _run(self) -> TrainResult:
        self.setup()
        cfg = self.cfg
        reporter = ConsoleReporter(self.total_steps, self.start_step, enabled=self.opts.progress and self.dist.is_main)
        if self.reporter_note:
            reporter.note(f"[yellow]{self.reporter_note}[/]")
        if self.resumed_from is not None:
            reporter.note(f"resuming from step {self.resumed_from} ({self.resumed_path})")
        try:
            if self.start_step == 0:
                self.eval_before = self.evaluate()
                self._log_eval(0, self.eval_before, reporter)
            train_seconds, train_tokens, last_loss = 0.0, 0, None
            for step in range(self.start_step, self.total_steps):
                record = self.train_step(step)
                train_seconds += record.pop("seconds")
                train_tokens += record["tokens"]
                self._count(record, reporter)
                done = step + 1
                if not record["skipped"]:
                    last_loss = record["loss"]
                show = done % cfg.log_every == 0 or record["skipped"] or done == self.total_steps
                if self.dist.is_main and show:
                    self.log.append(record)
                reporter.step(record, print_line=show)
                self._stop_if_diverged(record)
                if cfg.eval_every and done % cfg.eval_every == 0 and done != self.total_steps:
                    self._log_eval(done, self.evaluate(), reporter)
                if done % cfg.save_every == 0 or done == self.total_steps:
                    self.save(done)
            eval_after = self.evaluate()
            self._log_eval(self.total_steps, eval_after, reporter)
            adapter = self._save_adapter()
        finally:
            reporter.close()
        result = TrainResult(
            output_dir=str(self.out), steps=self.total_steps, skipped_steps=self.skipped, train_loss=last_loss,
            eval_loss_before=self.eval_before, eval_loss_after=eval_after,
            tokens_per_s=train_tokens / train_seconds if train_seconds else 0.0, train_seconds=train_seconds,
            peak_rss_mb=peak_rss_mb(), resumed_from=self.resumed_from, adapter_dir=str(adapter),
            world_size=self.dist.world_size,
        )
        if self.dist.is_main:
            (self.out / SUMMARY_FILE).write_text(json.dumps(asdict(result), indent=2), encoding="utf-8")
            if self.log.step_records():
                plot_loss(self.out)
        return result
