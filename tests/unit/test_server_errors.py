"""One error mapping: typed errors and pydantic validation errors become OpenAI-style bodies naming the field."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mlc.errors import AuthError, ContextLengthError, InvalidRequestError, QueueFullError, ServiceUnavailableError
from mlc.server.errors import describe_validation_error, is_json, mlc_error_response, unreadable_body
from mlc.server.protocol.schemas import ChatCompletionRequest, CompletionRequest, GenerateRequest


def errors_of(schema, body: dict) -> list[dict]:
    with pytest.raises(ValidationError) as e:
        schema.model_validate(body)
    return [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]  # as FastAPI reports them


def describe(schema, body):
    return describe_validation_error(errors_of(schema, body), sorted(schema.model_fields))


def test_out_of_range_names_the_field_and_the_value():
    message, param, code = describe(GenerateRequest, {"prompt": "hi", "max_new_tokens": 0})
    assert param == "max_new_tokens" and code == "greater_than_equal"
    assert "greater than or equal to 1" in message and "got 0" in message


def test_unknown_field_suggests_the_close_one():
    message, param, code = describe(GenerateRequest, {"prompt": "hi", "max_new_token": 3})
    assert param == "max_new_token" and code == "unknown_field" and "did you mean 'max_new_tokens'" in message


def test_wrong_type_is_not_coerced():
    _, param, code = describe(GenerateRequest, {"prompt": "hi", "temperature": "0.5"})
    assert (param, code) == ("temperature", "float_type")
    _, param, _ = describe(CompletionRequest, {"prompt": "hi", "n": True})
    assert param == "n"


def test_union_members_are_folded_into_one_field():
    message, param, _ = describe(GenerateRequest, {"prompt": "hi", "stop": 5})
    assert param == "stop" and message == "stop must be a string or a list of strings (got 5)"


@pytest.mark.parametrize("prompt,param,problem", [
    ([-1], "prompt[0]", "greater than or equal to 0"),
    ([[1, -1]], "prompt[0][1]", "greater than or equal to 0"),
    (["a", 1], "prompt[1]", "(got 1)"),
    (5, "prompt", "(got 5)"),
    ([], "prompt", "at least 1 item"),
    ("x" * 1_000_001, "prompt", "at most 1000000 characters"),
])
def test_union_errors_name_a_clean_path_and_what_is_accepted(prompt, param, problem):
    errors = errors_of(CompletionRequest, {"prompt": prompt})
    message, got_param, _ = describe_validation_error(errors, vocab_size=49152)
    assert got_param == param and problem in message
    assert "constrained" not in message and "list[" not in message and "valid string" not in message
    assert "a string, a list of strings, a list of token ids or a list of lists of token ids" in message
    assert "from 0 to 49151" in message and len(message) < 400  # a megabyte prompt is not echoed back


def test_union_members_are_described_in_words():
    from mlc.server.errors import _member

    assert [_member(t) for t in ("str", "list[constrained-str]", "list[list[constrained-int]]", "ContentPart")] == \
        ["a string", "a list of strings", "a list of lists of integers", "an object"]


def test_content_union_errors_read_like_paths():
    message, param, _ = describe(ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]})
    assert param == "messages[0].content" and "a string or a list of content parts" in message
    message, param, _ = describe(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"text": "a"}]}]})
    assert param == "messages[0].content[0].type" and "Field required" in message


def test_nested_locations_read_like_paths():
    _, param, _ = describe(ChatCompletionRequest, {"messages": [{"role": "user", "content": "a"},
                                                                {"role": "robot", "content": "b"}]})
    assert param == "messages[1].role"


def test_unreadable_bodies_say_why():
    assert unreadable_body(RecursionError())[2] == "json_too_deep"
    assert "nested too deeply" in unreadable_body(RecursionError())[0]
    assert unreadable_body(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"))[2] == "invalid_encoding"
    assert is_json("application/json; charset=utf-8") and is_json("application/merge-patch+json")
    assert not is_json("text/plain") and not is_json(None)


def test_body_level_errors():
    assert describe_validation_error([{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error",
                                       "ctx": {"error": "Expecting value"}}])[1:] == ("body", "invalid_json")
    assert describe_validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required"}])[1] == "body"


def body_of(response) -> dict:
    return json.loads(response.body)


def test_typed_errors_keep_their_status_and_field():
    r = mlc_error_response(InvalidRequestError("prompt is empty", field="prompt"))
    assert r.status_code == 400
    assert body_of(r) == {"error": {"message": "prompt is empty", "type": "invalid_request_error", "param": "prompt",
                                    "code": "invalid_request_error"}}


def test_rename_maps_engine_names_to_the_api():
    err = ContextLengthError("max_new_tokens (900) is too many", field="max_new_tokens")
    body = body_of(mlc_error_response(err, {"max_new_tokens": "max_tokens"}))["error"]
    assert body["param"] == "max_tokens" and body["message"] == "max_tokens (900) is too many"
    assert body["type"] == "context_length_exceeded"


def test_retry_after_and_auth_headers():
    r = mlc_error_response(QueueFullError("queue full", retry_after=3))
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    r = mlc_error_response(ServiceUnavailableError("loading", retry_after=2))
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    r = mlc_error_response(AuthError("no key"))
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert body_of(r)["error"]["code"] == "invalid_api_key"
