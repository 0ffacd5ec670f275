"""Where an engine's extra processes run: its tensor-parallel ranks and pipeline stages.

By default they are child processes of the driver, on this machine (`LocalLauncher`), and every address they dial
is loopback. A launcher that places them elsewhere (the cluster layer's, which starts each in its own bundle of a
Ray placement group, on whatever node holds it) is installed with `use_launcher` before the engine is built: it says
the address the driver listens on for them, which device index a rank takes on its own node, and whether its
processes may span nodes (then the driver does not count this machine's cores or devices for them).

A started process is a `Launched`: what `subprocess.Popen` offers the engine (poll, wait, kill, returncode).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Protocol

LOOPBACK = "127.0.0.1"


class Launched(Protocol):
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...  # raises subprocess.TimeoutExpired

    def kill(self) -> None: ...


class Launcher(Protocol):
    host: str  # the address the driver listens on, and its workers dial
    spans_nodes: bool  # workers may run on other machines

    def device_index(self, rank: int) -> int: ...  # rank's accelerator index as its own process sees them

    def start(self, rank: int, args: list[str], env: dict[str, str]) -> Launched: ...
    # `python *args` for rank, with `env` over the environment of wherever it runs

    def close(self) -> None: ...  # after the group's processes are gone


class LocalLauncher:
    """Child processes on this machine; rank r takes accelerator r."""

    host = LOOPBACK
    spans_nodes = False

    def device_index(self, rank: int) -> int:
        return rank

    def start(self, rank: int, args: list[str], env: dict[str, str]) -> Launched:
        return subprocess.Popen([sys.executable, *args], env={**os.environ, **env})

    def close(self) -> None:
        pass


_current: Launcher = LocalLauncher()


def use_launcher(launcher: Launcher | None) -> None:
    """Engines built from now on in this process start their workers with `launcher` (None: on this machine)."""
    global _current
    _current = launcher if launcher is not None else LocalLauncher()


def current_launcher() -> Launcher:
    return _current
