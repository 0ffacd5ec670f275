"""Where mlc keeps things on disk."""

from __future__ import annotations

import os
from pathlib import Path


def mlc_home() -> Path:
    """The model store root: `$MLC_HOME`, else `~/.cache/mlc`."""
    return Path(os.environ.get("MLC_HOME") or Path.home() / ".cache" / "mlc").expanduser()


def models_dir() -> Path:
    return mlc_home() / "models"


def user_config_path() -> Path:
    """User-level settings such as hooks: `$MLC_CONFIG`, else `~/.mlc/config.yaml`."""
    return Path(os.environ.get("MLC_CONFIG") or Path.home() / ".mlc" / "config.yaml").expanduser()


def package_data(name: str) -> Path:
    """A file shipped in `mlc/data`."""
    return Path(__file__).resolve().parent.parent / "data" / name
