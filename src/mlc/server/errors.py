"""One mapping from errors to HTTP answers: OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`.

`mlc.errors` types carry their own status; request-validation errors (pydantic) become 400s that name the field;
anything else is a 500 whose traceback goes to the log, never to the client.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mlc.errors import CapacityError, InvalidRequestError, MlcError

log = logging.getLogger("mlc.server")

# Pydantic's tags for the members of a union (`stop: str | list[str]` fails as loc ("stop", "str")).
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}


class ServiceUnavailableError(MlcError):
    """The server cannot take requests right now: the model is loading, or the server is shutting down."""

    http_status = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class QueueFullError(CapacityError):
    error_type = "queue_full"

    def __init__(self, message: str, *, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(MlcError):
    """The request ran past --request-timeout before producing any token."""

    http_status = 504
    error_type = "timeout"


class UnsupportedFeatureError(InvalidRequestError):
    error_type = "unsupported_feature"


class ClientDisconnected(Exception):
    """The client went away; nobody reads the answer (status 499 in the audit log)."""


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def mlc_error_response(err: MlcError, rename: dict[str, str] | None = None) -> JSONResponse:
    """The answer for a typed error; `rename` maps engine field names to the API's (max_new_tokens -> max_tokens)."""
    param = (rename or {}).get(err.field or "", err.field)
    message = err.message
    if rename and err.field in rename:
        message = message.replace(err.field, rename[err.field])
    headers = {}
    retry_after = getattr(err, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    if err.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    code = err.error_type if err.http_status != 401 else "invalid_api_key"
    return JSONResponse(error_body(message, err.error_type, param, code), err.http_status, headers=headers)


def _field_path(loc: tuple) -> str | None:
    parts = [p for p in loc[1:] if not (isinstance(p, str) and (p in _UNION_TAGS or p.startswith(("list[", "dict["))))]
    if not parts:
        return None
    path = ""
    for p in parts:
        path += f"[{p}]" if isinstance(p, int) else (f".{p}" if path else str(p))
    return path


def _allowed_fields(request: Request) -> list[str]:
    route = request.scope.get("route")
    body = getattr(getattr(route, "body_field", None), "type_", None)
    return sorted(getattr(body, "model_fields", {}) or {})


def describe_validation_error(errors: list[dict], allowed: list[str] | None = None) -> tuple[str, str | None, str]:
    """(message, param, code) for pydantic's error list: the first failing field, all its problems."""
    if not errors:
        return "the request is invalid", None, "invalid_request"
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "malformed")
        pos = first["loc"][1] if len(first["loc"]) > 1 else "?"
        return f"the request body is not valid JSON ({reason} at character {pos})", "body", "invalid_json"
    param = _field_path(tuple(first["loc"]))
    if kind == "extra_forbidden":
        name = str(first["loc"][-1])
        hint = difflib.get_close_matches(name, allowed or [], n=1)
        extra = f"; did you mean {hint[0]!r}?" if hint else ""
        return f"unknown field {param!r}{extra} (this API does not accept it)", param, "unknown_field"
    if kind == "missing" and param is None:
        return "the request needs a JSON object body", "body", "missing_body"
    if param is None:
        return f"the request body must be a JSON object ({first.get('msg', 'invalid')})", "body", "invalid_body"
    same = [e for e in errors if _field_path(tuple(e["loc"])) == param]
    problems = "; or ".join(dict.fromkeys(e.get("msg", "invalid").removeprefix("Value error, ") for e in same))
    got = first.get("input")
    shown = "" if kind == "missing" or isinstance(got, (dict, list)) else f" (got {got!r})"
    return f"{param}: {problems}{shown}", param, kind or "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MlcError)
    async def _mlc(request: Request, exc: MlcError):
        return mlc_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param, code = describe_validation_error(list(exc.errors()), _allowed_fields(request))
        return JSONResponse(error_body(message, "invalid_request_error", param, code), 400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        message, param, code = str(exc.detail), None, None
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message = "the request body could not be read as JSON; send UTF-8 encoded JSON"
            param, code = "body", "invalid_encoding"
        elif exc.status_code == 404:
            message = f"no route {request.url.path}; see /openapi.json for the API"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return JSONResponse(error_body(message, kind, param, code), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal server error ({type(exc).__name__}); see the server log",
                                       "internal_error"), 500)
