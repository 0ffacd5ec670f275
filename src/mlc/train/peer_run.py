"""One side of `bench train` (`mlc/bench/train_compare.py`), run in a fresh process:
`python -m mlc.train.peer_run mlc|hf SPEC_JSON` sets up our `LoRATrainer` from SPEC's training config, then runs its
steps with our trainer (`mlc`) or hands the same PEFT model, rows and step plan to transformers' `Trainer` (`hf`), and
writes per-step loss, seconds, tokens and RSS, and the peak RSS, to SPEC's `out` file as JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path


def _rss_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux 4.0+)
        return True
    except OSError:
        return False


def _setup(raw: dict):
    from mlc.config.loader import validate_train_config
    from mlc.train.trainer import LoRATrainer, RunOptions

    trainer = LoRATrainer(validate_train_config(raw), RunOptions(fresh=True, progress=False))
    trainer.setup()
    return trainer


def run_mlc(trainer) -> list[dict]:
    steps = []
    last = time.perf_counter()
    for step in range(trainer.total_steps):
        record = trainer.train_step(step)
        now = time.perf_counter()
        steps.append({"loss": record["loss"], "seconds": now - last, "tokens": record["tokens"],
                      "rss_kib": _rss_kib("VmRSS")})
        last = now
    return steps


def run_hf(trainer) -> list[dict]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from mlc.train.data import collate, model_inputs

    cfg, plan = trainer.cfg, trainer.plan
    if cfg.gradient_accumulation_steps != 1:
        raise ValueError("bench train compares one micro-batch a step (gradient_accumulation_steps: 1)")
    order = [i for step in range(trainer.total_steps) for i in plan.micro_batches(step)[0]]
    dataset = [trainer.rows[i] for i in order]
    pad = trainer.tokenizer.pad_token_id if trainer.tokenizer.pad_token_id is not None else 0

    def collator(rows: list[dict]) -> dict:
        batch = collate(rows, pad)
        return {**model_inputs(batch, torch.device("cpu")), "labels": batch["labels"]}

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(dataset)

    steps: list[dict] = []
    tokens = [sum(sum(r["attention_mask"]) for r in dataset[i : i + cfg.batch_size])
              for i in range(0, len(dataset), cfg.batch_size)]

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            steps.append({"seconds": now - self.last, "tokens": tokens[len(steps)], "rss_kib": _rss_kib("VmRSS")})
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs and steps:
                steps[-1]["loss"] = float(logs["loss"])

    o = cfg.optimizer
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=cfg.batch_size, gradient_accumulation_steps=1,
            max_steps=trainer.total_steps, learning_rate=o.lr, adam_beta1=o.betas[0], adam_beta2=o.betas[1],
            adam_epsilon=o.eps, weight_decay=o.weight_decay, max_grad_norm=cfg.clip_norm or 0.0,
            lr_scheduler_type="constant_with_warmup" if cfg.lr_schedule.type == "constant" else cfg.lr_schedule.type,
            warmup_steps=cfg.lr_schedule.warmup_for(trainer.total_steps), bf16=trainer.dtype == torch.bfloat16,
            fp16=trainer.dtype == torch.float16, optim="adamw_torch",  # ours: torch's AdamW, not the fused one
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
            use_cpu=trainer.device.type == "cpu", dataloader_num_workers=0, remove_unused_columns=False, seed=cfg.seed)
        hf = InOrder(model=trainer.peft_model, args=args, train_dataset=dataset, data_collator=collator,
                           callbacks=[Timer()])
        hf.train()
    return steps


def side_main(side: str, spec: dict) -> dict:
    """One side's run, in this process: set-up, then the steps; what it measured."""
    start = time.perf_counter()
    trainer = _setup(spec["config"])
    setup_s = time.perf_counter() - start
    load_peak = _rss_kib("VmHWM")
    reset = _reset_peak()
    steps = (run_mlc if side == "mlc" else run_hf)(trainer)
    return {"side": side, "setup_s": setup_s, "steps": steps, "process_peak_kib": max(load_peak, _rss_kib("VmHWM")),
            "train_peak_kib": _rss_kib("VmHWM") if reset else None, "dtype": str(trainer.dtype),
            "finetuning_type": trainer.cfg.finetuning_type, "quantized": trainer.quantized}


if __name__ == "__main__":
    side_arg, spec_arg = sys.argv[1], json.loads(sys.argv[2])
    Path(spec_arg["out"]).write_text(json.dumps(side_main(side_arg, spec_arg)))
