"""Doctor check of a training log: non-finite losses or gradient norms in train_log.jsonl, with their lines."""

from __future__ import annotations

import json
import math
from pathlib import Path

from mlc.doctor.check import Check

LOSS_KEYS = ("loss", "grad_norm", "eval_loss", "train_loss")


def _number(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)  # "nan", "inf" and "-inf" strings included (how train_log.jsonl writes them)
    except (TypeError, ValueError):
        return None


def check_train_log(path: Path, limit: int = 10) -> Check:
    path = Path(path)
    if path.is_dir():
        path = path / "train_log.jsonl"
    if not path.is_file():
        return Check("train log", "fail", f"{path} does not exist", "pass a run's output dir or its train_log.jsonl")
    bad, unreadable, records = [], 0, 0
    for line_no, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            unreadable += 1
            continue
        if not isinstance(record, dict):
            unreadable += 1
            continue
        records += 1
        for key in LOSS_KEYS:
            value = _number(record.get(key))
            if value is not None and not math.isfinite(value):
                bad.append(f"line {line_no} (step {record.get('step', '?')}): {key} = {record.get(key)}")
    if bad:
        shown = bad[:limit] + ([f"... and {len(bad) - limit} more"] if len(bad) > limit else [])
        return Check("train log", "fail", f"{path}: {len(bad)} non-finite loss/grad_norm value(s) in {records} records",
                     "check in order: lora.r a multiple of 16 (64), optimizer.lr <= 3e-4 (2e-4), "
                     "gradient_accumulation_steps <= 4 with fp16, clip_norm 1.0, bf16 batch_size >= 8; "
                     "then resume from the last finite checkpoint", shown)
    if records == 0:
        return Check("train log", "warn", f"{path}: no JSON records", "is this a train_log.jsonl?")
    extra = f"; {unreadable} unreadable line(s) (a killed run cuts its last line)" if unreadable else ""
    return Check("train log", "warn" if unreadable > 1 else "ok",
                 f"{path}: {records} records, all losses finite{extra}")
