"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (streaming with SSE and [DONE])."""

from __future__ import annotations

from fastapi import APIRouter, Request, Security

from mlc.engine.grammar import GrammarSpec
from mlc.errors import InvalidRequestError, ModelNotFoundError, UnsupportedFeatureError
from mlc.server import run_request as rr
from mlc.server.bearer import bearer_scheme
from mlc.server.chat.assistant_output import finish_reason
from mlc.server.chat.request import plan_chat
from mlc.server.chat.structured import compile_grammar, requested_spec
from mlc.server.lenient import LenientRoute
from mlc.server.observability.audit import AuditInfo, audit_info
from mlc.server.params import Limits, completion_budget, resolve_context, sampling_params, stop_list
from mlc.server.prompting import Prompt, encode, from_ids, off_loop
from mlc.server.protocol.responses_doc import ERROR_RESPONSES, sse_response_doc
from mlc.server.protocol.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIRequest,
)
from mlc.server.protocol.schemas_openai import unsupported_capability
from mlc.server.routes.openai_format import (
    ChatStream,
    CompletionStream,
    chat_logprobs,
    completion_logprobs,
    sorted_outputs,
    usage_of,
)
from mlc.server.state import ServerState, loaded_engine

router = APIRouter(tags=["OpenAI-compatible"], dependencies=[Security(bearer_scheme)], responses=ERROR_RESPONSES,
                   route_class=LenientRoute)


def _model_cards(request: Request) -> list[ModelCard]:
    state = rr.get_state(request)
    state.require_engine()
    engine = loaded_engine(state)
    base = ModelCard(id=state.model_id, created=state.created, max_model_len=engine.max_seq_len,
                     weights=engine.weights)
    return [base, *(ModelCard(id=a["name"], created=a["created"], max_model_len=engine.max_seq_len,
                              weights=engine.weights, parent=state.model_id, root=a["path"])
                    for a in engine.adapters())]  # the base model, then its LoRA adapters


@router.get("/v1/models", response_model=ModelList, summary="The served model")
async def list_models(request: Request):
    return ModelList(data=_model_cards(request))


@router.get("/v1/models/{model:path}", response_model=ModelCard, summary="One served model or LoRA adapter")
async def retrieve_model(model: str, request: Request):
    """404 for an id that is neither the served model nor one of its adapters; an id may hold slashes
    (`org/model`)."""
    cards = _model_cards(request)
    for card in cards:
        if card.id == model:
            return card
    raise ModelNotFoundError(f"model {model!r} is not served here; served: {', '.join(c.id for c in cards)}",
                        field="model")


async def _begin(body: OpenAIRequest, request: Request):
    """(state, audit info, adapter id, model name) for a generating request; 503 while the model loads. An
    adapter known but not loaded (evicted, or in --lora-dir) loads first."""
    state = rr.get_state(request)
    info = audit_info(request.scope)
    info.user = body.user
    state.require_engine()
    return state, info, await state.resolve_model(body.model), body.model or state.model_id


def _limits(state: ServerState, body: OpenAIRequest) -> Limits:
    return resolve_context(state.config, loaded_engine(state).max_seq_len, body.context_length, body.context_profile)


def _params(state: ServerState, body: OpenAIRequest, prompt: Prompt, limits: Limits, max_tokens: int | None,
            logprobs: int | None, rename: dict[str, str], grammar: GrammarSpec | None = None,
            prompt_logprobs: bool = False, prediction: list[int] | None = None):
    budget = completion_budget(len(prompt.ids), max_tokens, limits, state.config.default_max_tokens)
    bias = {int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None
    temperature = 0.0 if body.top_p == 0.0 else body.temperature  # top_p 0 keeps the most likely token only
    params = sampling_params(
        rename, max_new_tokens=budget, temperature=temperature, top_p=body.top_p or 1.0, top_k=body.top_k,
        min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, seed=body.seed, stop=stop_list(body.stop),
        stop_token_ids=list(body.stop_token_ids), ignore_eos=body.ignore_eos, min_new_tokens=body.min_tokens,
        logprobs=logprobs, n=body.n, include_stop_str_in_output=body.include_stop_str_in_output,
        full_kv=body.full_kv, grammar=grammar, prompt_logprobs=prompt_logprobs, logit_bias=bias,
        prediction=prediction, speculative=body.speculative,
    )
    rr.validate(state, prompt.ids, params, limits, rename)
    return params


def _completion_prompts(state: ServerState, prompt, limit: int) -> list[Prompt]:
    if isinstance(prompt, str):
        return [encode(state, prompt, "prompt", True, limit)]
    if prompt and isinstance(prompt[0], int):
        return [from_ids(state, prompt, "prompt")]
    if prompt and isinstance(prompt[0], str):
        return [encode(state, p, f"prompt[{k}]", True, limit) for k, p in enumerate(prompt)]
    return [from_ids(state, p, f"prompt[{k}]") for k, p in enumerate(prompt)]


@router.post("/v1/completions", response_model=CompletionResponse, responses=sse_response_doc(CompletionResponse),
             summary="Complete a prompt (or several)")
async def completions(body: CompletionRequest, request: Request):
    """Rules across fields: `best_of` equals `n`; a streamed request has one prompt; `suffix` is null and
    at most one of response_format, structured_outputs and guided_*; `context_length` or
    `context_profile`, not both; each prompt + `max_tokens` fits the context. `echo` with `logprobs` returns the
    prompt tokens' logprobs first (lm-eval's local-completions scores this way)."""
    state, info, adapter_id, model_name = await _begin(body, request)
    if body.suffix is not None:
        raise UnsupportedFeatureError("suffix (insertion) is not supported; omit it", field="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise UnsupportedFeatureError("best_of other than n is not supported", field="best_of")
    limits = _limits(state, body)
    prompts = await off_loop(_completion_prompts, state, body.prompt, limits.context)
    grammar = await off_loop(compile_grammar, state, requested_spec(body))
    scored = body.echo and body.logprobs is not None
    if body.stream and len(prompts) > 1:
        raise UnsupportedFeatureError("stream with several prompts is not supported; send one prompt per request",
                                      field="prompt")
    rename = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
    jobs = [(p.ids, _params(state, body, p, limits, body.max_tokens, body.logprobs, rename, grammar, scored))
            for p in prompts]
    rid = state.new_request_id("cmpl")
    stripped = sum(p.stripped for p in prompts)
    info.request_id, info.prompt_tokens, info.stripped_chars = rid, sum(len(p.ids) for p in prompts), stripped
    if state.config.audit_log_content:
        info.prompt = body.prompt if isinstance(body.prompt, str) else [p.text for p in prompts]
    gens = await rr.start(state, rid, jobs, adapter_id)
    headers = rr.headers_for(rid, stripped)
    tt = state.token_text
    echoes = [(p.text if p.text is not None else state.engine.decode(p.ids, skip_special_tokens=False))
              if body.echo else None for p in prompts]
    if body.stream:
        fmt = CompletionStream(rid, state.created_now(), model_name, tt, body.logprobs, body.n,
                               bool(body.stream_options and body.stream_options.include_usage), echoes[0])
        return await rr.stream(request, gens[0], fmt.chunks, fmt.final, headers)
    outs = await rr.run_to_end(request, gens)
    if not isinstance(outs, list):
        return outs
    choices = []
    for k, out in enumerate(outs):
        for o in sorted_outputs(out):
            echo = echoes[k] or ""
            lp = None
            if body.logprobs is not None:
                prompt = (out.prompt_token_ids, out.prompt_logprobs or []) if scored else None
                lp = completion_logprobs(o.logprobs or [], tt, body.logprobs > 0, 0 if scored else len(echo), prompt)
            choices.append(CompletionChoice(index=k * body.n + o.index, text=echo + o.text, logprobs=lp,
                                            finish_reason=o.finish_reason))
    resp = CompletionResponse(id=rid, created=state.created_now(), model=model_name, choices=choices,
                              usage=usage_of(outs), stripped_chars=stripped)
    return rr.json_response(resp, headers)


def _chat_checks(body: ChatCompletionRequest, info: AuditInfo) -> tuple[int | None, str]:
    refused = unsupported_capability(body)
    if refused is not None:
        raise UnsupportedFeatureError(f"{refused[0]}: {refused[1]}", field=refused[0])
    info.safety_identifier, info.service_tier = body.safety_identifier, body.service_tier
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", field="top_logprobs")
    if body.max_tokens is not None and body.max_completion_tokens is not None \
            and body.max_tokens != body.max_completion_tokens:
        raise InvalidRequestError("max_tokens and max_completion_tokens disagree; send one of them",
                                  field="max_completion_tokens")
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
             responses=sse_response_doc(ChatCompletionChunk), summary="Chat, with the model's chat template")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Rules across fields: `max_tokens` and `max_completion_tokens` agree when both are given; `top_logprobs` needs
    `logprobs: true`; tool_choice other than none/auto needs tools, and a named function is one of them; at most one
    of response_format, structured_outputs, guided_* and a forced tool call; tools or the legacy functions, not
    both; no audio output, web search or moderation (400: not available here); some message has text and the last
    user message is not empty; `context_length` or `context_profile`, not both; the prompt + completion fits the
    context. Tool calls come back in message.tool_calls (finish_reason tool_calls; with the legacy functions, in
    message.function_call with finish_reason function_call), GLM-4.5+ reasoning in message.reasoning_content."""
    state, info, adapter_id, model_name = await _begin(body, request)
    max_tokens, max_field = _chat_checks(body, info)
    limits = _limits(state, body)
    plan = await off_loop(plan_chat, state, body, limits.context)
    prompt = plan.prompt
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    rename = {"max_new_tokens": max_field, "min_new_tokens": "min_tokens", "logprobs": "top_logprobs"}
    params = _params(state, body, prompt, limits, max_tokens, logprobs, rename, plan.grammar,
                     prediction=plan.prediction)
    rid = state.new_request_id("chatcmpl")
    info.request_id, info.prompt_tokens, info.stripped_chars = rid, len(prompt.ids), prompt.stripped
    if state.config.audit_log_content:
        info.prompt = [m.model_dump(exclude_none=True) for m in body.messages]
    (gen,) = await rr.start(state, rid, [(prompt.ids, params)], adapter_id)
    headers = rr.headers_for(rid, prompt.stripped)
    tt = state.token_text
    if body.stream:
        fmt = ChatStream(rid, state.created_now(), model_name, tt, body.logprobs, body.n,
                         bool(body.stream_options and body.stream_options.include_usage), plan.output)
        return await rr.stream(request, gen, fmt.chunks, fmt.final, headers, opening=fmt.start())
    outs = await rr.run_to_end(request, [gen])
    if not isinstance(outs, list):
        return outs
    (out,) = outs
    choices = []
    for o in sorted_outputs(out):
        reply = plan.output().reply(o.text)
        message = AssistantMessage(content=reply.content, reasoning_content=reply.reasoning,
                                   tool_calls=reply.calls or None, function_call=reply.function_call)
        choice_logprobs = chat_logprobs(o.logprobs or [], tt) if body.logprobs else None
        called = bool(reply.calls) or reply.function_call is not None
        choices.append(ChatChoice(index=o.index, message=message, logprobs=choice_logprobs,
                                  finish_reason=finish_reason(o.finish_reason, called, plan.legacy)))
    resp = ChatCompletionResponse(id=rid, created=state.created_now(), model=model_name, choices=choices,
                                  usage=usage_of(outs), stripped_chars=prompt.stripped)
    return rr.json_response(resp, headers)
