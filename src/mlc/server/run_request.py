"""The steps every generating route shares: admission, running one or several Generations to the end or as a
stream, and what the audit log and response headers learn from them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import FinishReason
from mlc.errors import MlcError
from mlc.server.auth import current_key
from mlc.server.errors import ClientDisconnected, error_body
from mlc.server.generation import Generation
from mlc.server.input_policy import STRIPPED_HEADER
from mlc.server.observability.audit import AuditInfo, audit_info
from mlc.server.params import Limits, rename_field
from mlc.server.protocol.streaming import DONE, SSEResponse, sse, until_disconnect
from mlc.server.state import ServerState, loaded_engine

if TYPE_CHECKING:
    from mlc.engine.outputs import RequestOutput

CLIENT_CLOSED = 499


def get_state(request: Request) -> ServerState:
    return request.app.state.mlc


def headers_for(request_id: str, stripped: int) -> dict[str, str]:
    return {"x-request-id": request_id, STRIPPED_HEADER: str(stripped)}


def validate(state: ServerState, ids: list[int], params: SamplingParams, limits: Limits,
             rename: dict[str, str]) -> None:
    """The engine's checks (vocabulary, the request's context bound, KV capacity), once, as a 4xx before anything
    starts; the engine then takes the request as validated."""
    try:
        loaded_engine(state).validate(ids, params, limits.context, f"{limits.source} of {limits.context} tokens")
    except MlcError as e:
        raise rename_field(e, rename) from None


async def start(state: ServerState, request_id: str, jobs: list[tuple[list[int], SamplingParams]],
                adapter_id: int = 0) -> list[Generation]:
    """Admit and start one Generation per (prompt ids, params); all or none. A named API key's limits are checked
    and charged here (server/tenants.py), and its name orders the engine's queue round-robin across keys."""
    gens: list[Generation] = []
    key = current_key.get()
    try:
        for k, (ids, params) in enumerate(jobs):
            state.admit(params.n)
            ticket = None
            if key is not None and key.entry is not None:
                ticket = state.tenants.admit(key.entry, len(ids), params.max_new_tokens * params.n)
            try:
                gens.append(Generation(state, request_id if len(jobs) == 1 else f"{request_id}-{k}", ids, params,
                                       adapter_id, ticket))
            except BaseException:
                if ticket is not None:
                    ticket.release(0)
                raise
    except BaseException:
        for g in gens:
            await g.close()
        raise
    return gens


async def _collect(gen: Generation) -> RequestOutput:
    last = None
    while (out := await gen.next()) is not None:
        last = out
    if last is None:  # the engine's stream always ends with a finished output (or raises)
        raise RuntimeError(f"request {gen.request_id} ended without any output")
    return last


def note_outputs(info: AuditInfo, outs: list[RequestOutput], include_content: bool) -> None:
    info.completion_tokens = sum(o.num_generated_tokens for o in outs)
    reasons = [c.finish_reason for o in outs for c in o.outputs]
    info.finish_reason = reasons[0] if len(set(reasons)) == 1 else ",".join(str(r) for r in reasons)
    if include_content:
        texts = [c.text for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
        info.output = texts[0] if len(texts) == 1 else texts


async def run_to_end(request: Request, gens: list[Generation]) -> list[RequestOutput] | Response:
    """Every Generation's final output, or a 499 if the client left (its requests are aborted)."""
    state = get_state(request)
    info = audit_info(request.scope)
    try:
        outs = await until_disconnect(request, asyncio.gather(*(_collect(g) for g in gens)))
    except ClientDisconnected:
        info.disconnected, info.finish_reason = True, "disconnect"
        return Response(status_code=CLIENT_CLOSED)
    finally:
        for g in gens:
            await g.close()
    note_outputs(info, outs, state.config.audit_log_content)
    return outs


async def stream(request: Request, gen: Generation, render: Callable[[RequestOutput], list[dict]],
                 closing: Callable[[RequestOutput], list[dict]], headers: dict[str, str],
                 opening: list[dict] | None = None, frame: Callable[[dict], str] = sse, end: str = DONE,
                 failed: Callable[[MlcError], list[dict]] | None = None) -> Response:
    """SSE of `gen`: waits for the first output first, so errors before any token are plain 4xx/5xx answers.
    `frame` writes one event (`data:` lines; the Responses and Messages APIs add `event:`), `end` closes the
    stream (`[DONE]`, or nothing), `failed` says in-band that the engine failed mid-stream."""
    state = get_state(request)
    info = audit_info(request.scope)
    try:
        first = await until_disconnect(request, gen.next())
    except ClientDisconnected:
        info.disconnected, info.finish_reason = True, "disconnect"
        await gen.close()
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        await gen.close()
        raise
    if first is None:  # the engine's stream always yields a first output (or raises)
        await gen.close()
        raise RuntimeError(f"request {gen.request_id} ended without any output")

    async def events() -> AsyncIterator[str]:
        out: RequestOutput | None = first
        last = first
        finished = False
        try:
            for chunk in opening or []:
                yield frame(chunk)
            while out is not None:
                last = out
                for chunk in render(out):
                    yield frame(chunk)
                out = await gen.next()
            for chunk in closing(last):
                yield frame(chunk)
            finished = True
            yield end
        except MlcError as e:  # the engine failed mid-stream: say so in-band, as OpenAI does
            finished = True
            info.finish_reason = FinishReason.ERROR
            chunks = failed(e) if failed else [error_body(e.message, e.error_type, e.field, e.error_type)]
            for chunk in chunks:
                yield frame(chunk)
            yield end
        finally:
            if last is not None and info.finish_reason != FinishReason.ERROR:
                note_outputs(info, [last], state.config.audit_log_content)
            if not finished and not gen.done:
                info.disconnected, info.finish_reason = True, "disconnect"

    return SSEResponse(events(), cleanup=gen.close, headers=headers)


def json_response(model, headers: dict[str, str]) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"), headers=headers)

