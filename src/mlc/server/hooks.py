"""Post-inference hooks from the user config (`$MLC_CONFIG`, else ~/.mlc/config.yaml):

    hooks:
      post_inference: ["/usr/local/bin/record-call", "--tag", "mlc"]   # argv: a program and its arguments
      timeout_s: 10                                                    # optional, per run

Each hook runs after every inference request with the audit record as JSON on stdin. Hooks run as an argv list,
never through a shell (a shell line such as the reference tutorial's `echo ... >> file` is refused at startup:
put it in a script), in one background thread, with a timeout. A failing hook is logged and never fails a request;
when hooks fall behind, records past the queue bound are dropped (and logged) instead of piling up in memory.
"""

from __future__ import annotations

import json
import logging
import queue
import shlex
import subprocess
import threading
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlc.config.loader import read_yaml
from mlc.config.paths import user_config_path
from mlc.errors import ConfigError

log = logging.getLogger("mlc.server.hooks")

SHELL_SYNTAX = ("|", "&", ";", ">", "<", "$(", "`", "&&", "||")
QUEUE_BOUND = 1024


class HooksConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    post_inference: list[list[str]] = []
    timeout_s: float = Field(10.0, gt=0, le=3600)

    @field_validator("post_inference", mode="before")
    @classmethod
    def _argv(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            return [_split_command_line(v)]
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            v = [v]  # one hook: [command, args...]
        if not isinstance(v, list) or not all(isinstance(h, list) and h and all(isinstance(x, str) and x for x in h)
                                              for h in v):
            raise ValueError("write a hook as a list of strings [command, args...] (or a list of such lists)")
        for argv in v:
            if any(c.isspace() for c in argv[0]) or any(tok in argv[0] for tok in SHELL_SYNTAX):
                raise ValueError(f"{argv[0]!r} is not a program path; {NO_SHELL}")
        return v


NO_SHELL = (
    "hooks never run through a shell. Write the command as an argv list, e.g. "
    '["/usr/local/bin/audit-hook", "--tag", "mlc"], and put redirections or pipes in a script '
    "(the audit record arrives on its stdin)"
)


def _split_command_line(line: str) -> list[str]:
    if any(tok in line for tok in SHELL_SYNTAX):
        raise ValueError(f"{line!r} is a shell command line; {NO_SHELL}")
    argv = shlex.split(line)
    if not argv:
        raise ValueError("the hook command is empty")
    return argv


def load_hooks(path: Path | None = None) -> HooksConfig:
    """The `hooks:` section of the user config; no file or no section means no hooks."""
    path = path or user_config_path()
    if not path.is_file():
        return HooksConfig()
    data = read_yaml(path)
    try:
        return HooksConfig(**(data.get("hooks") or {}))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{path}: hooks.{where}: {first['msg'].removeprefix('Value error, ')}") from None
    except TypeError:
        raise ConfigError(f"{path}: hooks must be a mapping, e.g. hooks: {{post_inference: [cmd, arg]}}") from None


class HookRunner:
    def __init__(self, config: HooksConfig):
        self.config = config
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_BOUND)
        self._thread: threading.Thread | None = None
        self.runs = self.failures = self.dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self.config.post_inference)

    def start(self) -> None:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._work, name="mlc-hooks", daemon=True)
            self._thread.start()

    def submit(self, record: dict) -> None:
        """Queue a record for the hooks; returns at once."""
        if not self.enabled:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            log.warning("post_inference hooks are behind (%d queued); dropped the record of %s",
                        QUEUE_BOUND, record.get("request_id"))

    def stop(self, timeout: float = 10.0) -> None:
        """Let queued records run for up to `timeout` seconds, then leave the rest."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    def _work(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                return
            payload = json.dumps(record, ensure_ascii=False).encode("utf-8")
            for argv in self.config.post_inference:
                self.run_one(argv, payload)

    def run_one(self, argv: list[str], payload: bytes) -> bool:
        self.runs += 1
        start = time.monotonic()
        try:
            proc = subprocess.run(argv, input=payload, capture_output=True, timeout=self.config.timeout_s,
                                  shell=False, check=False)
        except subprocess.TimeoutExpired:
            self.failures += 1
            log.warning("hook %s timed out after %.1fs", argv[0], self.config.timeout_s)
            return False
        except OSError as e:
            self.failures += 1
            log.warning("hook %s could not start: %s", argv[0], e)
            return False
        if proc.returncode != 0:
            self.failures += 1
            tail = proc.stderr.decode("utf-8", "replace").strip()[-500:]
            log.warning("hook %s exited with %d after %.2fs: %s", argv[0], proc.returncode,
                        time.monotonic() - start, tail or "(no stderr)")
            return False
        return True
