"""One mapping from errors to HTTP answers: OpenAI-style bodies `{"error": {"message", "type", "param", "code"}}`.

`mlc.errors` types carry their own status; request-validation errors (pydantic) become 400s that name the field;
anything else is a 500 whose traceback goes to the log, never to the client.
"""

from __future__ import annotations

import difflib
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mlc.errors import MlcError

log = logging.getLogger("mlc.server")

# Pydantic's tags in error locations: union members (`str`, `list[constrained-int]`, `function-after[...]`) and
# model classes (`ContentPart`); never a field name of this API (snake_case).
_TAG = re.compile(r"^(?:str|int|float|bool|list|dict|none|[a-z]+(?:-[a-z]+)+|[A-Z]\w*)(?:\[.*\])?$")
_TYPE_ERRORS = ("_type", "_parsing")
_MEMBER_NAMES = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
                 "none": "null", "dict": "an object"}
# What a union field accepts, where the generic description (from the member tags) says it less well.
_FIELD_ACCEPTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "content": 'a string or a list of content parts like {"type": "text", "text": "..."}',
}
SHOWN_CHARS = 80  # a rejected value is echoed up to this many characters: enough to recognise, never the megabyte


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


def _is_tag(part) -> bool:
    return isinstance(part, str) and bool(_TAG.match(part))


def _field_path(loc: tuple) -> str | None:
    path = ""
    for p in loc[1:]:
        if not _is_tag(p):
            path += f"[{p}]" if isinstance(p, int) else (f".{p}" if path else str(p))
    return path or None


def _allowed_fields(request: Request) -> list[str]:
    route = request.scope.get("route")
    body = getattr(getattr(getattr(route, "body_field", None), "field_info", None), "annotation", None)
    return sorted(getattr(body, "model_fields", {}) or {})


def _shown(err: dict) -> str:
    got = err.get("input")
    if err.get("type") == "missing" or isinstance(got, (dict, list)):
        return ""
    text = repr(got)
    return f" (got {text[:SHOWN_CHARS]}...)" if len(text) > SHOWN_CHARS else f" (got {text})"


def _member(tag: str) -> str:
    """`list[constrained-int]` -> "a list of integers"."""
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _member(tag[5:-1])
        if inner.startswith("a list of "):
            return "a list of lists of " + inner.removeprefix("a list of ")
        return "a list of " + (inner.split(" ", 1)[1] + "s" if inner.startswith(("a ", "an ")) else inner)
    return _MEMBER_NAMES.get(tag.removeprefix("constrained-"), "an object")


def _accepted(field: str, tags: list[str], vocab_size: int | None) -> str:
    name = re.sub(r"\[\d+\]$", "", field).rsplit(".", 1)[-1]
    if name in _FIELD_ACCEPTS:
        text = _FIELD_ACCEPTS[name]
        if "token ids" in text:
            top = f"{vocab_size - 1}" if vocab_size else "the vocabulary size - 1"
            text += f" (token ids are integers from 0 to {top})"
        return text
    names = list(dict.fromkeys(_member(t) for t in tags))
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _describe_union(errors: list[dict], tag_at: int, vocab_size: int | None) -> tuple[str, str, str]:
    """One message for a field of several accepted shapes: what it accepts, and the member that got furthest."""
    first = errors[0]
    prefix = tuple(first["loc"][:tag_at])
    members = [e for e in errors if tuple(e["loc"][:tag_at]) == prefix and len(e["loc"]) > tag_at
               and _is_tag(e["loc"][tag_at])]
    field = _field_path(prefix) or "body"
    accepted = _accepted(field, [e["loc"][tag_at] for e in members], vocab_size)

    def progress(e: dict):
        rest = tuple(e["loc"][tag_at + 1:])
        return (not e.get("type", "").endswith(_TYPE_ERRORS), len(rest), [p for p in rest if isinstance(p, int)])

    best = max(members, key=progress)
    code = best.get("type") or "invalid_value"
    if not progress(best)[0] and not progress(best)[1]:  # no shape matched at all
        return f"{field} must be {accepted}{_shown(first)}", field, code
    where = _field_path(tuple(best["loc"])) or field
    problems = {e.get("msg", "invalid").removeprefix("Value error, ") for e in members if progress(e) == progress(best)}
    if len(problems) > 1:  # as far in several shapes, each with its own complaint: pydantic's words would mislead
        return f"{where}{_shown(best)} is not accepted: {field} must be {accepted}", where, code
    (problem,) = problems
    return f"{where}: {problem}{_shown(best)}; {field} must be {accepted}", where, code


def describe_validation_error(errors: list[dict], allowed: list[str] | None = None,
                              vocab_size: int | None = None) -> tuple[str, str | None, str]:
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
    tag_at = next((i for i, p in enumerate(first["loc"]) if i > 0 and _is_tag(p)), None)
    if tag_at is not None:
        return _describe_union(errors, tag_at, vocab_size)
    same = [e for e in errors if _field_path(tuple(e["loc"])) == param]
    problems = "; or ".join(dict.fromkeys(e.get("msg", "invalid").removeprefix("Value error, ") for e in same))
    return f"{param}: {problems}{_shown(first)}", param, kind or "invalid_value"


def is_json(content_type: str | None) -> bool:
    """FastAPI's rule for parsing a body as JSON: application/json or application/*+json."""
    if not content_type:
        return False
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def unreadable_body(cause: BaseException | None) -> tuple[str, str, str]:
    """(message, param, code) for a body the JSON parser gave up on, by why it did."""
    if isinstance(cause, RecursionError):
        return ("the JSON body is nested too deeply to parse; a request body here is a flat object of fields, "
                "see /openapi.json", "body", "json_too_deep")
    if isinstance(cause, UnicodeDecodeError):
        return "the request body is not UTF-8; send UTF-8 encoded JSON", "body", "invalid_encoding"
    why = f" ({type(cause).__name__})" if cause is not None else ""
    return f"the request body could not be parsed as JSON{why}; send a JSON object", "body", "invalid_json"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MlcError)
    async def _mlc(request: Request, exc: MlcError):
        return mlc_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        has_body = getattr(request.scope.get("route"), "body_field", None) is not None
        if has_body and not is_json(request.headers.get("content-type")):  # the body model got raw bytes
            got = request.headers.get("content-type") or "no Content-Type"
            message = f"the request body must be JSON sent with Content-Type: application/json (got {got})"
            return JSONResponse(error_body(message, "invalid_request_error", "body", "invalid_content_type"), 400)
        engine = request.app.state.mlc.engine
        vocab = engine.vocab_size if engine is not None else None
        message, param, code = describe_validation_error(list(exc.errors()), _allowed_fields(request), vocab)
        return JSONResponse(error_body(message, "invalid_request_error", param, code), 400)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        message, param, code = str(exc.detail), None, None
        if exc.status_code == 400 and message == "There was an error parsing the body":
            message, param, code = unreadable_body(exc.__cause__)
        elif exc.status_code == 413:
            param, code = "body", "body_too_large"
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
