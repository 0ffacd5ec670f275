"""A training run as the web UI shows it: its logged steps and evaluations, checkpoints, progress and ETA, read from
the files `mlc-cli train` writes in output_dir (train_log.jsonl, train_config.json, checkpoints/, summary.json).

Read-only, and safe to call while the run writes: a half-written last log line is skipped, files that do not
exist yet are simply absent from the answer.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from mlc.errors import DataError
from mlc.train import checkpoint as ckpt
from mlc.train.logging import LOG_FILE, TrainLog

CONFIG_FILE = "train_config.json"
SUMMARY_FILE = "summary.json"
RUN_MARKERS = (LOG_FILE, CONFIG_FILE, SUMMARY_FILE)
MAX_POINTS = 4000  # a longer log is thinned evenly (the last step always kept)
ACTIVE_S = 120.0  # a run whose log changed this recently counts as running
ETA_WINDOW = 20  # logged steps whose speed predicts the rest
CONFIG_KEYS = ("model", "max_steps", "epochs", "batch_size", "gradient_accumulation_steps", "max_seq_len",
               "log_every", "save_every", "eval_every", "clip_norm", "precision", "seed")


def _number(value) -> float | None:
    """A logged number; None for absent or non-finite ("inf"/"nan" strings), which a chart cannot draw."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def run_dir(path: str) -> Path:
    """`path` as a run directory, or a DataError that says what a run directory is."""
    try:
        p = Path(path).expanduser().resolve()
        ok = p.is_dir() and any((p / name).is_file() for name in RUN_MARKERS)
    except (OSError, ValueError, RuntimeError):
        ok, p = False, Path(path)
    if not ok:
        raise DataError(f"{path!r} is not a training run directory (no {LOG_FILE} or {CONFIG_FILE} in it); give "
                        "the output_dir of `mlc-cli train`", field="dir")
    return p


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _thin(rows: list[dict]) -> list[dict]:
    if len(rows) <= MAX_POINTS:
        return rows
    stride = math.ceil(len(rows) / MAX_POINTS)
    kept = rows[::stride]
    return kept if kept[-1] is rows[-1] else [*kept, rows[-1]]


def _steps(records: list[dict]) -> list[dict]:
    return [{"step": int(r["step"]), "loss": _number(r.get("loss")), "lr": _number(r.get("lr")),
             "grad_norm": _number(r.get("grad_norm")), "tokens_per_s": _number(r.get("tokens_per_s")),
             "tokens": _number(r.get("tokens")), "epoch": _number(r.get("epoch")), "skipped": bool(r.get("skipped"))}
            for r in records if isinstance(r.get("step"), int)]


def _total_steps(config: dict | None, summary: dict | None, steps: list[dict]) -> int | None:
    if summary and isinstance(summary.get("steps"), int):
        return summary["steps"]
    if config and isinstance(config.get("max_steps"), int):
        return config["max_steps"]
    last = steps[-1] if steps else None
    if config and last and last["epoch"]:
        per_epoch = last["step"] / last["epoch"]  # the log's epoch is step / steps_per_epoch
        return max(1, round((config.get("epochs") or 1.0) * per_epoch))
    return None


def _seconds_per_step(p: Path, steps: list[dict], checkpoints: list[dict], updated: float | None) -> float | None:
    """Wall-clock seconds per step of this process (evaluations and saves included): train_config.json is written
    when it starts, after it resumed from the newest checkpoint saved before then. Without that, the last steps'
    compute time (tokens / tokens_per_s)."""
    try:
        started = (p / CONFIG_FILE).stat().st_mtime
    except OSError:
        started = None
    if started is not None and updated is not None and steps:
        first = max((c["step"] for c in checkpoints if c["saved_at"] < started), default=0)
        done = steps[-1]["step"] - first
        if done > 0 and updated > started:
            return (updated - started) / done
    times = [s["tokens"] / s["tokens_per_s"] for s in steps[-ETA_WINDOW:] if s["tokens"] and s["tokens_per_s"]]
    return sum(times) / len(times) if times else None


def _checkpoints(path: Path) -> list[dict]:
    out = []
    for cp in ckpt.list_checkpoints(path):
        try:
            saved = cp.stat().st_mtime
        except OSError:
            continue  # pruned while we looked
        out.append({"step": ckpt.step_of(cp), "path": str(cp), "saved_at": saved})
    return out


def _config_view(config: dict | None) -> dict:
    if not config:
        return {}
    view = {k: config[k] for k in CONFIG_KEYS if k in config}
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict) and "lr" in optimizer:
        view["lr"] = optimizer["lr"]
    return view


def read_run(path: str) -> dict:
    """The run in `path` for the UI (JSON-ready). Raises DataError when `path` is not a run directory."""
    p = run_dir(path)
    log = TrainLog(p)
    records = log.read()
    steps = _steps([r for r in records if "loss" in r])
    evals = [{"step": int(r["step"]), "eval_loss": _number(r.get("eval_loss")), "eval_ppl": _number(r.get("eval_ppl"))}
             for r in records if "eval_loss" in r and isinstance(r.get("step"), int)]
    config, summary = _read_json(p / CONFIG_FILE), _read_json(p / SUMMARY_FILE)
    try:
        updated = max((p / n).stat().st_mtime for n in RUN_MARKERS if (p / n).is_file())
    except (OSError, ValueError):
        updated = None
    step = steps[-1]["step"] if steps else 0
    total = _total_steps(config, summary, steps)
    finished = summary is not None and (total is None or step >= total or summary.get("steps") == step)
    running = not finished and updated is not None and time.time() - updated < ACTIVE_S
    checkpoints = _checkpoints(p)
    per_step = _seconds_per_step(p, steps, checkpoints, updated)
    eta = per_step * (total - step) if running and per_step is not None and total is not None else None
    good = [s for s in steps if not s["skipped"]]
    return {
        "dir": str(p), "name": p.name, "status": "finished" if finished else ("running" if running else "stopped"),
        "updated_at": updated, "step": step, "total_steps": total, "eta_s": eta, "seconds_per_step": per_step,
        "skipped_total": sum(1 for s in steps if s["skipped"]),
        "last": {"loss": good[-1]["loss"] if good else None, "lr": steps[-1]["lr"] if steps else None,
                 "grad_norm": steps[-1]["grad_norm"] if steps else None,
                 "tokens_per_s": steps[-1]["tokens_per_s"] if steps else None,
                 "eval_loss": evals[-1]["eval_loss"] if evals else None},
        "steps": _thin(steps), "evals": evals, "checkpoints": checkpoints,
        "config": _config_view(config),
        "summary": summary,
    }
