"""Post-inference hooks from the user config (`$MLC_CONFIG`, else ~/.mlc/config.yaml):

    hooks:
      post_inference: "echo \"$MLC_TIME $MLC_CLIENT $MLC_REQUEST_ID\" >> /var/log/mlc/inference_audit.log"
      timeout_s: 10          # optional, per run; the hook's process group is killed past it
      max_concurrent: 1      # optional, hook runs at once; records queue behind them (bounded)

A string is a shell command line, run by /bin/sh exactly as its owner wrote it, like a cron line (the reference
tutorial's `echo 'Inference done at $(date)' >> .../inference_audit.log` works as written). A list of strings is an
argv (`["/usr/local/bin/record-call", "--tag", "mlc"]`), run without a shell. A list holding lists runs each item
as its own hook (its strings are shell lines, its lists argvs).

Request data never becomes part of a command. Each run gets the audit record as JSON on stdin (prompt and output
only under `audit_log_content`) and the metadata in `HOOK_ENV` (request id, time, client address, model, route,
status, finish reason, token counts, latency: never request text). So a prompt containing `$(...)` or `;` runs
nothing. A failing or slow hook is logged and never fails a request; records past the queue bound are dropped (and
logged) instead of piling up in memory.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlc.config.loader import read_yaml
from mlc.config.paths import user_config_path
from mlc.errors import ConfigError

log = logging.getLogger("mlc.server.observability.hooks")

SHELL = "/bin/sh"
SHELL_SYNTAX = ("|", "&", ";", ">", "<", "$(", "`")
QUEUE_BOUND = 1024
# environment variable -> audit record field; values are server-side metadata, never text from the request
HOOK_ENV = {
    "MLC_REQUEST_ID": "request_id", "MLC_TIME": "time", "MLC_CLIENT": "client", "MLC_MODEL": "model",
    "MLC_ROUTE": "route", "MLC_STATUS": "status", "MLC_FINISH_REASON": "finish_reason",
    "MLC_PROMPT_TOKENS": "prompt_tokens", "MLC_COMPLETION_TOKENS": "completion_tokens",
    "MLC_LATENCY_MS": "latency_ms",
}
Hook = Union[str, list[str]]  # a shell line, or an argv


class HooksConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    post_inference: list[Hook] = []
    timeout_s: float = Field(10.0, gt=0, le=3600)
    max_concurrent: int = Field(1, ge=1, le=64)

    @field_validator("post_inference", mode="before")
    @classmethod
    def _hooks(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        elif isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            v = [v]  # one argv: [command, args...]
        if not isinstance(v, list) or not all(_is_hook(h) for h in v):
            raise ValueError('write a hook as a shell line ("cmd >> file"), an argv list [command, args...], or a '
                             "list of such hooks")
        for hook in v:
            _check(hook)
        return v


def _is_hook(h) -> bool:
    return isinstance(h, str) or (isinstance(h, list) and bool(h) and all(isinstance(x, str) and x for x in h))


def _check(hook: Hook) -> None:
    if isinstance(hook, str):
        if not hook.strip():
            raise ValueError("the hook command line is empty")
        proc = subprocess.run([SHELL, "-n", "-c", hook], capture_output=True, text=True, timeout=10, check=False)
        if proc.returncode != 0:
            why = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "syntax error"
            raise ValueError(f"{hook!r} is not a valid {SHELL} command line: {why}")
        return
    if any(c.isspace() for c in hook[0]) or any(tok in hook[0] for tok in SHELL_SYNTAX):
        raise ValueError(f"{hook[0]!r} is not a program path: in the list form the first item is the program. "
                         "Write a shell command line as one string instead, e.g. post_inference: \"echo done >> "
                         "/var/log/mlc/audit.log\"")


def describe(hook: Hook) -> str:
    """A short name for logs: the argv's program, or the start of the shell line."""
    if isinstance(hook, list):
        return hook[0]
    return repr(hook if len(hook) <= 60 else hook[:57] + "...")


def hook_env(record: dict, base: dict[str, str] | None = None) -> dict[str, str]:
    """The hook's environment: the server's, plus the record's metadata as MLC_* variables (printable, bounded)."""
    env = dict(os.environ if base is None else base)
    for name, key in HOOK_ENV.items():
        value = record.get(key)
        text = "" if value is None else str(value)
        env[name] = "".join(c for c in text if c.isprintable())[:256]
    return env


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
        where = ".".join(str(p) for p in first["loc"][:1])
        raise ConfigError(f"{path}: hooks.{where}: {first['msg'].removeprefix('Value error, ')}") from None
    except TypeError:
        raise ConfigError(f"{path}: hooks must be a mapping, e.g. hooks: {{post_inference: [cmd, arg]}} or "
                          'hooks: {post_inference: "cmd >> file"}') from None


class HookRunner:
    def __init__(self, config: HooksConfig):
        self.config = config
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_BOUND)
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.runs = self.failures = self.dropped = 0

    @property
    def enabled(self) -> bool:
        return bool(self.config.post_inference)

    def start(self) -> None:
        if self.enabled and not self._threads:
            for i in range(self.config.max_concurrent):
                thread = threading.Thread(target=self._work, name=f"mlc-hooks-{i}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def submit(self, record: dict) -> None:
        """Queue a record for the hooks; returns at once."""
        if not self.enabled:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            with self._lock:
                self.dropped += 1
            log.warning("post_inference hooks are behind (%d queued); dropped the record of %s",
                        QUEUE_BOUND, record.get("request_id"))

    def stop(self, timeout: float = 10.0) -> None:
        """Let queued records run for up to `timeout` seconds, then leave the rest."""
        if not self._threads:
            return
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = []

    def _work(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                return
            payload = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")  # `cat >> f` keeps JSONL
            env = hook_env(record)
            for hook in self.config.post_inference:
                self.run_one(hook, payload, env)

    def run_one(self, hook: Hook, payload: bytes, env: dict[str, str] | None = None) -> bool:
        """Run one hook with `payload` on stdin; False (and a log line) when it fails, times out or cannot start."""
        argv = [SHELL, "-c", hook] if isinstance(hook, str) else hook
        name = describe(hook)
        self._count("runs")
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    env=env, start_new_session=True)
        except OSError as e:
            self._count("failures")
            log.warning("hook %s could not start: %s", name, e)
            return False
        try:
            _, stderr = proc.communicate(payload, timeout=self.config.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            self._count("failures")
            log.warning("hook %s timed out after %.1fs and was killed", name, self.config.timeout_s)
            return False
        if proc.returncode != 0:
            self._count("failures")
            tail = stderr.decode("utf-8", "replace").strip()[-500:]
            log.warning("hook %s exited with %d after %.2fs: %s", name, proc.returncode,
                        time.monotonic() - start, tail or "(no stderr)")
            return False
        return True

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)


def _kill_group(proc: subprocess.Popen) -> None:
    """The hook and whatever it started (a shell line's children) share a session; end them all."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.communicate()
