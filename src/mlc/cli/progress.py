"""Rich progress bars for long commands: on stderr, and only when stderr is a terminal (or not --quiet)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


def progress_bar(quiet: bool = False, counts: bool = True) -> Progress:
    """A transient bar on stderr; disabled when stderr is not a terminal (pipes, CI logs) or when `quiet`.
    `counts` shows "done/total" (rows, tasks, layers); otherwise a percentage (bytes read)."""
    console = Console(stderr=True)
    middle = MofNCompleteColumn() if counts else TaskProgressColumn()
    return Progress(
        SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn(), middle,
        TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True,
        disable=quiet or not console.is_terminal,
    )
