"""POST /tokenize (a prompt or chat messages -> token ids) and POST /detokenize (ids -> text).

Prompts go through the same input policy and chat template as generation, so the ids are what the model would see.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Security

from mlc.errors import InvalidRequestError
from mlc.server import run_request as rr
from mlc.server.bearer import bearer_scheme
from mlc.server.chat.messages import render
from mlc.server.input_policy import STRIPPED_HEADER
from mlc.server.observability.audit import audit_info
from mlc.server.prompting import encode, from_ids, off_loop
from mlc.server.protocol.responses_doc import ERROR_RESPONSES
from mlc.server.protocol.schemas_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from mlc.server.state import loaded_engine, loaded_token_text

router = APIRouter(tags=["tokenizer"], dependencies=[Security(bearer_scheme)], responses=ERROR_RESPONSES)


@router.post("/tokenize", response_model=TokenizeResponse, summary="Token ids of a prompt or a conversation")
async def tokenize(body: TokenizeRequest, request: Request):
    """Give exactly one of `prompt` or `messages`."""
    state = rr.get_state(request)
    state.require_engine()
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt or messages", field="prompt")
    if body.prompt is not None:
        prompt = await off_loop(encode, state, body.prompt, "prompt", body.add_special_tokens)
    else:
        prompt = await off_loop(render, state, body.messages, body.add_generation_prompt)
    info = audit_info(request.scope)
    info.prompt_tokens, info.stripped_chars = len(prompt.ids), prompt.stripped
    strs = [loaded_token_text(state).text(t) for t in prompt.ids] if body.return_token_strs else None
    resp = TokenizeResponse(tokens=prompt.ids, count=len(prompt.ids), max_model_len=loaded_engine(state).max_seq_len,
                            token_strs=strs, stripped_chars=prompt.stripped)
    return rr.json_response(resp, {STRIPPED_HEADER: str(prompt.stripped)})


@router.post("/detokenize", response_model=DetokenizeResponse, summary="Text of token ids")
async def detokenize(body: DetokenizeRequest, request: Request):
    state = rr.get_state(request)
    state.require_engine()
    state.check_model(body.model)
    ids = from_ids(state, body.tokens, "tokens").ids
    text = loaded_engine(state).decode(ids, skip_special_tokens=False)
    audit_info(request.scope).prompt_tokens = len(ids)
    return DetokenizeResponse(prompt=text)
