"""From a request body to what the engine takes: the context bound, max tokens, and SamplingParams.

Each check raises a typed error naming the field as the API spells it, before any stream starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlc.config.serve_config import ServeConfig
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import ContextLengthError, InvalidRequestError, MlcError


@dataclass
class Limits:
    context: int  # tokens of prompt + completion this request may use
    source: str  # where the bound came from, for messages


def resolve_context(config: ServeConfig, engine_max: int, context_length: int | None,
                    context_profile: str | None) -> Limits:
    """The request's context bound: its context_length, a named profile, the `default` profile, or the model's."""
    profiles = config.context_profiles
    if context_length is not None and context_profile is not None:
        raise InvalidRequestError("give context_length or context_profile, not both", field="context_profile")
    if context_profile is not None:
        if context_profile not in profiles:
            known = ", ".join(sorted(profiles)) or "none are configured (--context-profile NAME=TOKENS)"
            raise InvalidRequestError(f"unknown context_profile {context_profile!r}; known: {known}",
                                      field="context_profile")
        limit, source = profiles[context_profile], f"context profile {context_profile!r}"
    elif context_length is not None:
        limit, source = context_length, "context_length"
    elif "default" in profiles:
        limit, source = profiles["default"], "the default context profile"
    else:
        return Limits(engine_max, "the model's context limit")
    if limit > engine_max:
        field = "context_profile" if context_profile is not None else "context_length"
        raise InvalidRequestError(f"{source} ({limit} tokens) exceeds the server's context limit of {engine_max} "
                                  "tokens; ask for less", field=field)
    return Limits(limit, source)


def completion_budget(prompt_len: int, max_tokens: int | None, limits: Limits, default: int,
                      max_field: str) -> int:
    """max_new_tokens for a prompt: the asked number if it fits the context, else a 400 that says how much fits."""
    room = limits.context - prompt_len
    if room < 1:
        raise ContextLengthError(
            f"the prompt has {prompt_len} tokens but {limits.source} allows {limits.context} tokens in all; "
            "shorten the prompt or ask for a larger context", field="prompt")
    if max_tokens is None:
        return min(default, room)
    if max_tokens > room:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) + {max_field} ({max_tokens}) exceeds {limits.source} of {limits.context} "
            f"tokens; lower {max_field} to at most {room}", field=max_field)
    return max_tokens


def sampling_params(rename: dict[str, str], **kwargs) -> SamplingParams:
    """SamplingParams(**kwargs), with a bad value reported under the API's field name."""
    try:
        return SamplingParams(**kwargs)
    except MlcError as e:
        raise rename_field(e, rename) from None


def rename_field(err: MlcError, rename: dict[str, str]) -> MlcError:
    if err.field in rename:
        old = err.field
        err.field = rename[old]
        err.message = err.message.replace(old, err.field)
        err.args = (err.message,)
    return err


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
