"""`train_log.jsonl`: one JSON object per logged step (and per evaluation), appended as training goes.

Step records: step, loss, lr, grad_norm, tokens, tokens_per_s, skipped (bool), skipped_total.
Eval records: step, eval_loss, eval_ppl. Non-finite numbers are written as the strings "inf", "-inf", "nan"
so the file stays valid JSON and `grep inf` finds them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

LOG_FILE = "train_log.jsonl"


def _finite_or_text(value):
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def parse_number(value) -> float | None:
    """A logged number back to float ("inf" strings included); None when absent."""
    if value is None:
        return None
    return float(value)


class TrainLog:
    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / LOG_FILE

    def append(self, record: dict) -> None:
        line = json.dumps({k: _finite_or_text(v) for k, v in record.items()}, ensure_ascii=False)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(line + "\n")
            handle.flush()

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the last line of a killed run may be cut short
        return records

    def truncate_after(self, step: int) -> None:
        """Drop records past `step`: a resumed run re-does those steps and logs them again."""
        kept = [r for r in self.read() if r.get("step", 0) <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def step_records(self) -> list[dict]:
        return [r for r in self.read() if "loss" in r]

    def eval_records(self) -> list[dict]:
        return [r for r in self.read() if "eval_loss" in r]


def warn(text: str) -> None:
    """One yellow line on stderr, shown even with --quiet (a fallback or a fresh start the user must know about)."""
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)


class ConsoleReporter:
    """A rich progress bar on a terminal; plain lines every `log_every` steps otherwise (CI logs, pipes)."""

    def __init__(self, total: int, start: int, enabled: bool = True):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = Console(stderr=True)
        self.enabled = enabled
        self.live = enabled and self.console.is_terminal
        self.progress = None
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"), console=self.console,
            )
            self.task = self.progress.add_task("train", total=total, completed=start, status="")
            self.progress.start()

    def step(self, record: dict, print_line: bool = True) -> None:
        status = (
            f"loss {record['loss']:.4f}  lr {record['lr']:.2e}  |g| {record['grad_norm']:.3f}  "
            f"{record['tokens_per_s']:.0f} tok/s"
        )
        if self.progress is not None:
            self.progress.update(self.task, completed=record["step"], status=status)
        elif self.enabled and print_line:
            self.console.print(f"step {record['step']}: {status}", highlight=False)

    def note(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
