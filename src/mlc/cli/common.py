"""Helpers of the commands that run the engine: model verification, ASCEND_* variables, notes on stderr. The engine
options themselves are defined once in `engine_options.py`."""

from __future__ import annotations

from mlc.config.engine_config import EngineConfig


def verify_model(model: str, full: bool) -> None:
    """A store model against its manifest before anything loads (the engine's own load runs the cheap check)."""
    from mlc.models.store import resolve_model_dir
    from mlc.models.store.verifying import check_at_load

    check_at_load(resolve_model_dir(model), full=full)


def ascend_notes(cfg: EngineConfig) -> list[str]:
    """ASCEND_MAX_MEM / ASCEND_ALLOC_MEM from the environment applied to `cfg` (see mlc/config/ascend_env.py)."""
    import os

    from mlc.config.ascend_env import apply_ascend_env

    return apply_ascend_env(cfg, os.environ)


def print_notes(notes: list[str]) -> None:
    """One line on stderr per translated key, flag or variable."""
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True)
    for note in notes:
        err.print(f"[cyan]note:[/] {escape(note)}", highlight=False, soft_wrap=True)
