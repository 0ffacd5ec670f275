"""Preprocessing: record formats, prompt masking, truncation, padding, packing, malformed files, the Arrow output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mlc.errors import DataError
from mlc.models.tokenizer import load_tokenizer
from mlc.train.data import collate, model_inputs
from mlc.train.formats import RecordError, to_messages
from mlc.train.preprocess import (
    IGNORE_INDEX,
    PreprocessOptions,
    load_dataset_rows,
    pad_token_id,
    preprocess_file,
    tokenize_file,
    tokenize_messages,
)
from tests.support.tiny_llama import build_tiny_llama

ANSWER = "Hello, thank you for contacting us. Your order has shipped."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return load_tokenizer(tiny_dir)


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)) + "\n" for x in lines))
    return path


def trained_text(tok, ids, labels) -> str:
    return tok.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX])


def test_formats_become_messages():
    assert to_messages({"instruction": "Q", "output": "A"}) == (
        "instruction", [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}])
    fmt, msgs = to_messages({"instruction": "Q", "input": "ctx", "output": "A", "system": "S"})
    assert fmt == "alpaca" and msgs[0] == {"role": "system", "content": "S"} and msgs[1]["content"] == "Q\n\nctx"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    assert to_messages(chat) == ("chat", chat["messages"])
    with pytest.raises(RecordError, match="keys: answer, question"):
        to_messages({"question": "Q", "answer": "A"})
    with pytest.raises(RecordError, match="last message must be the assistant"):
        to_messages({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(RecordError, match="'output' must be a string"):
        to_messages({"instruction": "Q", "output": 3})
    with pytest.raises(RecordError, match="needs a 'messages' list"):
        to_messages({"instruction": "Q", "output": "A"}, "chat")


def test_prompt_tokens_are_masked_exactly(tok):
    msgs = [{"role": "user", "content": "Where is my order?"}, {"role": "assistant", "content": ANSWER}]
    ids, labels = tokenize_messages(tok, msgs)
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(ids) == full  # the whole conversation, rendered by the model's own template
    assert trained_text(tok, ids, labels) == ANSWER + "<|im_end|>\n"
    prompt_len = len(tok(tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"])
    assert labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert labels[prompt_len:] == ids[prompt_len:]


def test_train_on_prompt_keeps_everything_but_the_first_token(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, labels = tokenize_messages(tok, msgs, train_on_prompt=True)
    assert labels[0] == IGNORE_INDEX and labels[1:] == ids[1:]


def test_multi_turn_chat_trains_every_assistant_turn(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Refund?"}, {"role": "assistant", "content": "Yes"},
    ]
    ids, labels = tokenize_messages(tok, msgs)
    assert trained_text(tok, ids, labels) == "Hello<|im_end|>\nYes<|im_end|>\n"


def test_eos_is_appended_when_the_template_has_no_end_of_turn(tok):
    tok2 = type(tok).from_pretrained(tok.name_or_path)
    tok2.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}" \
                         "{% if add_generation_prompt %}<|im_start|>{% endif %}"
    ids, labels = tokenize_messages(tok2, [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}])
    assert ids[-1] == tok2.eos_token_id and labels[-1] == tok2.eos_token_id


def test_padding_to_multiple_of_16(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Q" * n, "output": "A" * n} for n in (1, 5, 20)])
    rows, stats = tokenize_file(path, tok, PreprocessOptions(max_seq_len=128))
    pad = pad_token_id(tok)
    for r in rows:
        n = sum(r["attention_mask"])
        assert len(r["input_ids"]) % 16 == 0 and len(r["input_ids"]) - n < 16
        assert r["input_ids"][n:] == [pad] * (len(r["input_ids"]) - n)
        assert r["labels"][n:] == [IGNORE_INDEX] * (len(r["input_ids"]) - n)
        assert r["attention_mask"] == [1] * n + [0] * (len(r["input_ids"]) - n)
    assert stats.padded_tokens == sum(len(r["input_ids"]) for r in rows) and stats.tokens < stats.padded_tokens
    batch = collate(rows, pad)
    assert batch["input_ids"].shape[1] % 16 == 0
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()


def test_truncation_is_counted_and_prompt_only_rows_dropped(tok, tmp_path):
    long_answer = "thank you " * 40
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"instruction": "Q", "output": long_answer},
        {"instruction": "order " * 80, "output": "A"},
        {"instruction": "Q", "output": "A"},
    ])
    rows, stats = tokenize_file(path, tok, PreprocessOptions(max_seq_len=32))
    assert stats.truncated == 1 and stats.rows == 2
    assert len(rows[0]["input_ids"]) == 32 and sum(rows[0]["attention_mask"]) == 32
    assert stats.dropped == [{"line": 2, "reason": "the prompt alone fills max_seq_len=32"}]


def test_malformed_file_reports_line_numbers_and_skips(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        {"instruction": "Q1", "output": "A1"},
        '{"instruction": "Q2", "output": ',  # cut-off JSON
        "",  # blank lines are counted, not errors
        '["not", "an", "object"]',
        {"instruction": "Q5"},
        {"instruction": "Q6", "output": ""},
        {"instruction": "Q7", "output": "A7"},
    ])
    path.write_bytes(path.read_bytes() + b'{"instruction": "\xff\xfe", "output": "x"}\n')
    rows, stats = tokenize_file(path, tok, PreprocessOptions())
    assert stats.rows == 2 and len(rows) == 2 and stats.blank_lines == 1 and stats.rows_read == 7
    lines = {d["line"]: d["reason"] for d in stats.dropped}
    assert sorted(lines) == [2, 4, 5, 6, 8]
    assert lines[2].startswith("invalid JSON") and "JSON object" in lines[4]
    assert "unrecognised record" in lines[5] and "'output' is empty" in lines[6] and lines[8] == "not UTF-8 text"


def test_malformed_file_fails_with_on_error_fail(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "Q", "output": "A"}, "{oops"])
    with pytest.raises(DataError, match=rf"{path}:2: invalid JSON.*--on-error skip"):
        tokenize_file(path, tok, PreprocessOptions(on_error="fail"))


def test_nothing_usable_is_an_error(tok, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", ["{oops", {"q": 1}])
    with pytest.raises(DataError, match="no usable rows.*line 1"):
        tokenize_file(path, tok, PreprocessOptions())
    with pytest.raises(DataError, match="not found"):
        tokenize_file(tmp_path / "missing.jsonl", tok, PreprocessOptions())
    with pytest.raises(DataError, match="unknown data format"):
        PreprocessOptions(format="xml")


def test_packing_restarts_positions_and_keeps_every_token(tok, tmp_path):
    recs = [{"instruction": f"Question {i}", "output": "Answer " * (i + 1)} for i in range(6)]
    path = write_jsonl(tmp_path / "d.jsonl", recs)
    plain, _ = tokenize_file(path, tok, PreprocessOptions(max_seq_len=64))
    packed, stats = tokenize_file(path, tok, PreprocessOptions(max_seq_len=64, packing=True))
    assert stats.sequences == len(packed) < len(plain) == stats.rows == 6

    def real(rows, key):
        return [x for r in rows for x, m in zip(r[key], r["attention_mask"]) if m]

    assert real(packed, "input_ids") == real(plain, "input_ids")
    assert real(packed, "labels") == real(plain, "labels")
    for r in packed:
        assert len(r["input_ids"]) <= 64 and len(r["input_ids"]) % 16 == 0
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0]
        assert all(r["labels"][i] == IGNORE_INDEX for i in starts)  # no token predicts across rows


def test_packed_rows_score_like_separate_rows(tok, tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).eval()
    path = write_jsonl(tmp_path / "d.jsonl",
                       [{"instruction": "Q", "output": "A"}, {"instruction": "Hi", "output": "Hello"}])
    plain, _ = tokenize_file(path, tok, PreprocessOptions(max_seq_len=64))
    packed, _ = tokenize_file(path, tok, PreprocessOptions(max_seq_len=64, packing=True))
    assert len(packed) == 1
    with torch.no_grad():
        whole = model(**model_inputs(collate(packed, pad_token_id(tok)), torch.device("cpu"))).logits[0]
        offset = 0
        for row in plain:
            n = sum(row["attention_mask"])
            alone = model(input_ids=torch.tensor([row["input_ids"][:n]])).logits[0]
            torch.testing.assert_close(whole[offset : offset + n], alone, atol=1e-5, rtol=1e-5)
            offset += n


def test_arrow_output_and_stats(tok, tiny_dir, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Q", "output": "A"}, "{bad", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}])
    out = tmp_path / "ds"
    stats = preprocess_file(path, out, tok, PreprocessOptions(), model=str(tiny_dir))
    rows, saved = load_dataset_rows(out)
    assert rows == tokenize_file(path, tok, PreprocessOptions())[0]
    assert saved["rows"] == 2 and saved["formats"] == {"instruction": 1, "chat": 1}
    assert saved["dropped"][0]["line"] == 2 and saved["options"]["pad_to_multiple_of"] == 16
    assert saved["tokens"] == stats.tokens and saved["model"] == str(tiny_dir)
    preprocess_file(path, out, tok, PreprocessOptions())  # rewriting an earlier output is allowed
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("keep me")
    with pytest.raises(DataError, match="not a preprocess output"):
        preprocess_file(path, tmp_path / "other", tok, PreprocessOptions())


def test_step_plan_is_a_function_of_seed_and_step_and_shards_like_accumulation():
    from mlc.train.data import StepPlan

    one = StepPlan(num_rows=50, batch_size=2, accum=4, seed=3)
    assert one.steps_per_epoch == 6 and one.micro_batches(7) == StepPlan(50, 2, 4, 3).micro_batches(7)
    assert one.micro_batches(0) != one.micro_batches(6)  # a new epoch is a new order
    ranks = [StepPlan(50, 2, 2, 3, world_size=2, rank=r) for r in (0, 1)]
    for step in range(12):
        single = sorted(i for mb in one.micro_batches(step) for i in mb)
        sharded = sorted(i for plan in ranks for mb in plan.micro_batches(step) for i in mb)
        assert single == sharded  # 2 ranks x accum 2 see the rows 1 rank x accum 4 sees
    epoch0 = [i for s in range(6) for mb in one.micro_batches(s) for i in mb]
    assert len(set(epoch0)) == len(epoch0) == 48


def test_step_plan_too_little_data_is_a_clear_error():
    from mlc.train.data import StepPlan

    with pytest.raises(DataError, match="has 5 rows but one step needs 8"):
        StepPlan(num_rows=5, batch_size=4, accum=2, seed=0)


def test_a_preprocessed_dir_must_match_the_runs_settings(tok, tmp_path):
    from mlc.train.data import load_rows

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Q", "output": "A"}])
    preprocess_file(path, tmp_path / "ds", tok, PreprocessOptions(max_seq_len=64))
    rows, _ = load_rows(tmp_path / "ds", tok, PreprocessOptions(max_seq_len=64))
    assert rows == tokenize_file(path, tok, PreprocessOptions(max_seq_len=64))[0]
    with pytest.raises(DataError, match=r"max_seq_len=64 \(run: 128\)"):
        load_rows(tmp_path / "ds", tok, PreprocessOptions(max_seq_len=128))


def test_glm4_template_masks_up_to_the_assistant_tag(tok):
    from mlc.models.tokenizer import GLM4_CHAT_TEMPLATE
    from mlc.train.preprocess import _segments

    glm = type(tok).from_pretrained(tok.name_or_path)
    glm.chat_template = GLM4_CHAT_TEMPLATE
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    assert _segments(glm, msgs) == [
        ("[gMASK]<sop><|system|>\nS", False), ("<|user|>\nQ", False), ("<|assistant|>", False), ("\nA", True),
    ]
    ids, labels = tokenize_messages(glm, msgs)
    assert trained_text(glm, ids, labels) == "\nA<|im_end|>"  # EOS appended: the template has no end-of-turn
