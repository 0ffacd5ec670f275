"""The reference tutorial's API: POST /generate {"prompt", "max_new_tokens", ...} -> {"text", "tokens", ...}."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request, Security

from mlc.server import run_request as rr
from mlc.server.bearer import bearer_scheme
from mlc.server.observability.audit import audit_info
from mlc.server.params import completion_budget, resolve_context, sampling_params, stop_list
from mlc.server.prompting import encode, off_loop
from mlc.server.protocol.responses_doc import ERROR_RESPONSES, sse_response_doc
from mlc.server.protocol.schemas import GenerateEvent, GenerateRequest, GenerateResponse, Usage
from mlc.server.state import loaded_engine

router = APIRouter(tags=["native"], dependencies=[Security(bearer_scheme)], responses=ERROR_RESPONSES)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


@router.post("/generate", response_model=GenerateResponse, responses=sse_response_doc(GenerateEvent),
             summary="Generate text for a prompt")
async def generate(body: GenerateRequest, request: Request):
    """Rules across fields: `context_length` or `context_profile`, not both; the prompt + `max_new_tokens` fits the
    context."""
    state = rr.get_state(request)
    info = audit_info(request.scope)
    state.require_engine()
    limits = resolve_context(state.config, loaded_engine(state).max_seq_len, body.context_length,
                             body.context_profile)
    prompt = await off_loop(encode, state, body.prompt, "prompt", True, limits.context)
    budget = completion_budget(len(prompt.ids), body.max_new_tokens, limits, state.config.default_max_tokens)
    params = sampling_params({}, max_new_tokens=budget, temperature=body.temperature, top_p=body.top_p,
                             top_k=body.top_k, repetition_penalty=body.repetition_penalty, seed=body.seed,
                             stop=stop_list(body.stop), full_kv=body.full_kv,
                             speculative=body.speculative)
    rr.validate(state, prompt.ids, params, limits, {})
    rid = state.new_request_id("gen")
    info.request_id, info.prompt_tokens, info.stripped_chars = rid, len(prompt.ids), prompt.stripped
    if state.config.audit_log_content:
        info.prompt = body.prompt
    (gen,) = await rr.start(state, rid, [(prompt.ids, params)])
    headers = rr.headers_for(rid, prompt.stripped)

    def usage(out) -> Usage:
        done = len(out.outputs[0].token_ids)
        return Usage(prompt_tokens=len(prompt.ids), completion_tokens=done, total_tokens=len(prompt.ids) + done)

    def ttft() -> float | None:
        return _ms(gen.first_output_time - gen.start_time) if gen.first_output_time else None

    if body.stream:
        def render(out) -> list[dict]:
            o = out.outputs[0]
            if not o.delta_text and not o.delta_token_ids and o.finish_reason is None:
                return []
            event = {"id": rid, "delta": o.delta_text, "tokens": list(o.delta_token_ids),
                     "finish_reason": o.finish_reason}
            if o.finish_reason is not None:
                event.update(text=o.text, usage=usage(out).model_dump(), ttft_ms=ttft(),
                             latency_ms=_ms(time.monotonic() - gen.start_time))
            return [event]

        return await rr.stream(request, gen, render, lambda last: [], headers)
    outs = await rr.run_to_end(request, [gen])
    if not isinstance(outs, list):
        return outs
    o = outs[0].outputs[0]
    resp = GenerateResponse(id=rid, text=o.text, tokens=list(o.token_ids), finish_reason=o.finish_reason,
                            usage=usage(outs[0]), latency_ms=_ms(time.monotonic() - gen.start_time),
                            ttft_ms=ttft(), stripped_chars=prompt.stripped)
    return rr.json_response(resp, headers)
