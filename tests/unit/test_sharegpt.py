"""LLaMA-Factory's ShareGPT rows (`conversations: [{from, value}]`, optional system and tools), in JSONL or a JSON
array file: mapped to our messages, tokenized like chat rows, and bad rows named by row and field."""

from __future__ import annotations

import json

import pytest

from mlc.errors import DataError
from mlc.models.tokenizer import load_tokenizer
from mlc.train.formats import RecordError, record_tools, to_messages
from mlc.train.preprocess import IGNORE_INDEX, PreprocessOptions, tokenize_file, tokenize_messages
from tests.support.tiny_llama import build_tiny_llama

TOOL = {"name": "track_order", "description": "Where an order is", "parameters": {"type": "object", "properties": {
    "order_id": {"type": "string"}}}}
ROW = {
    "conversations": [
        {"from": "human", "value": "Where is my order 42?"},
        {"from": "function_call", "value": '{"name": "track_order", "arguments": {"order_id": "42"}}'},
        {"from": "observation", "value": '{"status": "shipped"}'},
        {"from": "gpt", "value": "Your order has shipped."},
    ],
    "system": "You are a support agent.",
    "tools": json.dumps([TOOL]),
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model"))


def test_sharegpt_roles_map_to_messages():
    fmt, msgs = to_messages(ROW)
    assert fmt == "sharegpt"
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[0]["content"] == "You are a support agent." and msgs[2]["content"].startswith('{"name": "track_order"')
    assert record_tools(ROW) == [{"type": "function", "function": TOOL}]
    # A leading system turn works like the row's system field.
    _, msgs = to_messages({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                             {"from": "gpt", "value": "A"}]}, "sharegpt")
    assert msgs == [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                    {"role": "assistant", "content": "A"}]


@pytest.mark.parametrize("row, says", [
    ({"conversations": []}, "'conversations' must be a non-empty list"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, "conversations[0].from is 'bot'"),
    ({"conversations": [{"from": "human", "value": 3}]}, "conversations[0].value must be a string"),
    ({"conversations": [{"from": "human", "value": "Q"}, {"from": "human", "value": "Q"}]},
     "conversations[1].from is 'human' where gpt or function_call was expected"),
    ({"conversations": [{"from": "human", "value": "Q"}]}, "last turn of 'conversations' must be from gpt"),
    ({"conversations": ["hi"]}, "conversations[0] must be an object"),
    ({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}], "tools": "{oops"},
     "'tools' is not valid JSON"),
])
def test_bad_rows_name_the_field(row, says):
    with pytest.raises(RecordError) as e:
        to_messages(row)
        record_tools(row)
    assert says in str(e.value)


def test_function_call_and_answer_are_trained_observation_is_not(tok):
    _, msgs = to_messages(ROW)
    ids, labels = tokenize_messages(tok, msgs, tools=record_tools(ROW))
    text = tok.decode(ids)
    assert "track_order" in text.split("<|im_start|>user")[0]  # tools land in the system prompt (template ignores them)
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
    assert '"order_id": "42"' in trained and "Your order has shipped." in trained
    assert "shipped\"}" not in trained and "Where is my order" not in trained


def test_jsonl_and_json_array_files_give_the_same_rows(tok, tmp_path):
    good = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    bad = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt"}]}
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in (ROW, good, bad)) + "\n")
    array = tmp_path / "d.json"
    array.write_text(json.dumps([ROW, good, bad], indent=2))
    seen = []
    rows_a, stats_a = tokenize_file(jsonl, tok, PreprocessOptions(), progress=lambda *a: seen.append(a))
    rows_b, stats_b = tokenize_file(array, tok, PreprocessOptions(format="sharegpt"))
    assert rows_a == rows_b and stats_a.formats == {"sharegpt": 2} and stats_b.layout == "json"
    assert stats_a.dropped == stats_b.dropped == [
        {"line": 3, "reason": "conversations[1].value must be a string, got NoneType"}]
    assert seen[-1][1] == seen[-1][2] == jsonl.stat().st_size  # progress reached the end of the file
    with pytest.raises(DataError, match=r"d\.json row 3: conversations\[1\]\.value"):
        tokenize_file(array, tok, PreprocessOptions(on_error="fail"))


def test_broken_json_array_file_is_a_clear_error(tok, tmp_path):
    path = tmp_path / "d.json"
    path.write_text('[{"conversations": [}]')
    with pytest.raises(DataError, match="invalid JSON .* a .json file must hold one array of rows"):
        tokenize_file(path, tok, PreprocessOptions())
