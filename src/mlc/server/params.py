"""From a request body to what the engine takes: the context bound, max tokens, and SamplingParams.

Each check raises a typed error naming the field as the API spells it, before any stream starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlc.config.serve_config import ServeConfig
from mlc.engine.sampling_params import SamplingParams
from mlc.errors import InvalidRequestError, MlcError


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


def completion_budget(prompt_len: int, max_tokens: int | None, limits: Limits, default: int) -> int:
    """max_new_tokens for a prompt: the asked number, else the server's default cut to what the context leaves (at
    least 1, so that a prompt that fills the context meets the engine's context rule, not a max_tokens error)."""
    if max_tokens is not None:
        return max_tokens
    return max(1, min(default, limits.context - prompt_len))


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
