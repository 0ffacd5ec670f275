"""Rich progress bars for long commands: on stderr, and only when stderr is a terminal (or not --quiet)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
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


def bytes_bar(quiet: bool = False) -> Progress:
    """A transient download bar on stderr: bytes done of all, speed and time left; off as `progress_bar` is."""
    console = Console(stderr=True)
    return Progress(
        SpinnerColumn(), TextColumn("[progress.description]{task.description}"), BarColumn(), DownloadColumn(),
        TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
        disable=quiet or not console.is_terminal,
    )
