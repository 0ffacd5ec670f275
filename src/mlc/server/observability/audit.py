"""The audit log: one JSON line per API request (time, request id, client, route, status, token counts, latency),
with prompt and output text only under --audit-log-content. The same record goes to the post_inference hooks.

An ASGI middleware times each request and writes the record once the response is sent (streams included); route
handlers fill in what only they know (request id, token counts, finish reason) on the `AuditInfo` in the scope.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlc.errors import ConfigError
from mlc.server.observability.hooks import HookRunner

log = logging.getLogger("mlc.server.observability.audit")

SCOPE_KEY = "mlc.audit"
AUDITED_PREFIXES = ("/v1/", "/generate", "/tokenize", "/detokenize")
INFERENCE_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses",
                             "/v1/messages"})
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection before the answer"


@dataclass
class AuditInfo:
    request_id: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    stripped_chars: int = 0
    prompt: str | list | None = None
    output: str | list | None = None
    disconnected: bool = False
    user: str | None = None  # OpenAI's tenant fields, as the request gave them (per-tenant accounting)
    safety_identifier: str | None = None
    service_tier: str | None = None
    key_name: str | None = None  # the API key's name from --api-key-file (never the key)


def audit_info(scope: Scope) -> AuditInfo:
    """The request's AuditInfo (a throwaway one when auditing is off)."""
    info = scope.get(SCOPE_KEY)
    if info is None:
        info = scope[SCOPE_KEY] = AuditInfo()
    return info


class AuditLog:
    """Appends JSON lines; safe to call from any thread."""

    def __init__(self, path: str | Path, include_content: bool = False):
        self.path = Path(path).expanduser()
        self.include_content = include_content
        self._lock = threading.Lock()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"--audit-log {self.path}: cannot open it for appending ({e.strerror})") from None

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def build_record(scope: Scope, status: int, latency_s: float, info: AuditInfo, model: str,
                 include_content: bool) -> dict:
    client = scope.get("client") or (None, None)
    record = {
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "request_id": info.request_id,
        "client": client[0],
        "method": scope.get("method"),
        "route": scope.get("path"),
        "status": status,
        "model": model,
        "prompt_tokens": info.prompt_tokens,
        "completion_tokens": info.completion_tokens,
        "finish_reason": info.finish_reason,
        "latency_ms": round(latency_s * 1000, 2),
        "stripped_chars": info.stripped_chars,
    }
    tenant = (("user", info.user), ("safety_identifier", info.safety_identifier),
              ("service_tier", info.service_tier), ("key_name", info.key_name))
    record.update({k: v for k, v in tenant if v is not None})
    if include_content:
        record["prompt"] = info.prompt
        record["output"] = info.output
    return record


class AuditMiddleware:
    def __init__(self, app: ASGIApp, audit_log: AuditLog | None, hooks: HookRunner, model: str):
        self.app = app
        self.audit_log = audit_log
        self.hooks = hooks
        self.model = model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(AUDITED_PREFIXES):
            await self.app(scope, receive, send)
            return
        info = scope[SCOPE_KEY] = AuditInfo()
        status = 500
        start = time.monotonic()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if info.disconnected and status in (500, CLIENT_CLOSED):
                status = CLIENT_CLOSED
            self._emit(scope, status, time.monotonic() - start, info)

    def _emit(self, scope: Scope, status: int, latency: float, info: AuditInfo) -> None:
        content = self.audit_log.include_content if self.audit_log else False
        record = build_record(scope, status, latency, info, self.model, content)
        if self.audit_log is not None:
            try:
                self.audit_log.write(record)
            except OSError as e:  # a full disk must not fail requests
                log.error("cannot write the audit log %s: %s", self.audit_log.path, e)
        if scope["path"] in INFERENCE_PATHS:
            self.hooks.submit(record)
