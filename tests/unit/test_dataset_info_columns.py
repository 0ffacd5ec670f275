"""LLaMA-Factory's dataset_info.json `columns` and `tags`: a file whose keys and ShareGPT roles are renamed reads
to the same tokens as the same rows spelled our way, through `mlc-cli preprocess`, the training config's
`dataset: NAME` and a training run; a wrong entry is an error naming the key to fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlc.config.dataset_info import schema_for_file
from mlc.errors import ConfigError, DataError
from mlc.models.tokenizer import load_tokenizer
from mlc.train.data import load_rows
from mlc.train.formats import RecordError, to_messages
from mlc.train.preprocess import PreprocessOptions, tokenize_file
from tests.support.tiny_llama import build_tiny_llama

# the same conversations spelled our way (ShareGPT defaults) and the OpenAI way, which dataset_info renames
SHAREGPT = [
    {"conversations": [{"from": "human", "value": "Where is my order?"}, {"from": "gpt", "value": "It has shipped."}],
     "system": "You are a support agent."},
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                       {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Refund?"},
                       {"from": "gpt", "value": "Done."}]},
]
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
RENAMED_SHAREGPT = [
    {"dialog": [{"role": ROLES[t["from"]], "content": t["value"]} for t in row["conversations"]],
     **({"sys": row["system"]} if "system" in row else {})} for row in SHAREGPT
]
SHAREGPT_ENTRY = {"file_name": "chat.json", "formatting": "sharegpt",
                  "columns": {"messages": "dialog", "system": "sys"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant", "system_tag": "system"}}
ALPACA = [
    {"instruction": "Reset my password", "input": "account 7", "output": "A reset link is on its way."},
    {"instruction": "Change my address", "output": "Updated.", "system": "Be polite."},
]
ALPACA_ENTRY = {"file_name": "qa.json", "columns": {"prompt": "question", "query": "context", "response": "answer",
                                                     "system": "persona"}}
RENAME = {"instruction": "question", "input": "context", "output": "answer", "system": "persona"}


def renamed_alpaca() -> list[dict]:
    return [{RENAME[k]: v for k, v in row.items()} for row in ALPACA]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(tiny)


def write_dataset(root: Path, entries: dict, files: dict[str, list[dict]]) -> Path:
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "dataset_info.json").write_text(json.dumps(entries), encoding="utf-8")
    for name, rows in files.items():
        (data / name).write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    return data


def test_renamed_sharegpt_reads_like_ours(tok, tmp_path):
    data = write_dataset(tmp_path, {"chat": SHAREGPT_ENTRY}, {"chat.json": RENAMED_SHAREGPT, "ours.json": SHAREGPT})
    got, stats = tokenize_file(data / "chat.json", tok, PreprocessOptions())
    want, _ = tokenize_file(data / "ours.json", tok, PreprocessOptions())
    assert got == want and stats.rows == 2 and stats.dropped == [] and stats.formats == {"sharegpt": 2}
    assert stats.dataset_info == f"{data / 'dataset_info.json'} entry 'chat'"


def test_renamed_alpaca_reads_like_ours(tok, tmp_path):
    data = write_dataset(tmp_path, {"qa": ALPACA_ENTRY}, {"qa.json": renamed_alpaca(), "ours.json": ALPACA})
    got, stats = tokenize_file(data / "qa.json", tok, PreprocessOptions())
    want, ours = tokenize_file(data / "ours.json", tok, PreprocessOptions())
    assert got == want and stats.rows == 2 and stats.formats == {"alpaca": 2}
    assert ours.dataset_info == ""  # no entry names ours.json: read with our own names


def test_alpaca_history_column_adds_the_earlier_turns(tmp_path):
    schema = schema_for_file(write_dataset(tmp_path, {"qa": {"file_name": "qa.json", "columns": {
        "prompt": "q", "response": "a", "history": "past"}}}, {"qa.json": []}) / "qa.json")
    _, msgs = to_messages({"q": "And now?", "a": "Now B.", "past": [["First?", "A."]]}, "auto", schema)
    assert msgs == [{"role": "user", "content": "First?"}, {"role": "assistant", "content": "A."},
                    {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "Now B."}]
    with pytest.raises(RecordError, match=r"past\[0\] must be a \[prompt, response\] pair"):
        to_messages({"q": "x", "a": "y", "past": [["only one"]]}, "auto", schema)


def test_renamed_roles_name_the_rows_keys_in_errors(tmp_path):
    data = write_dataset(tmp_path, {"chat": SHAREGPT_ENTRY}, {"chat.json": []})
    schema = schema_for_file(data / "chat.json")
    bad = {"dialog": [{"role": "user", "content": "Q"}, {"role": "user", "content": "Q2"}]}
    with pytest.raises(RecordError, match=r"dialog\[1\]\.role is 'user' where assistant or function_call was expected"):
        to_messages(bad, "auto", schema)


def test_llama_factory_training_config_trains_on_a_renamed_dataset(tiny, tok, tmp_path, monkeypatch):
    """`dataset: NAME` and `eval_dataset: NAME` resolve through dataset_info.json, and the trainer's data path
    (load_rows) and a one-step run read the renamed rows."""
    from mlc.config.loader import load_train_config
    from mlc.train.run import RunOptions, train

    monkeypatch.chdir(tmp_path)
    write_dataset(tmp_path, {"chat": SHAREGPT_ENTRY, "qa": ALPACA_ENTRY},
                  {"chat.json": RENAMED_SHAREGPT * 2, "qa.json": renamed_alpaca(), "ours.json": SHAREGPT * 2})
    (tmp_path / "lf.yaml").write_text(
        f"model_name_or_path: {tiny}\nstage: sft\nfinetuning_type: lora\nlora_rank: 4\ndataset: chat\n"
        "eval_dataset: qa\ndataset_dir: data\ncutoff_len: 64\nper_device_train_batch_size: 2\nmax_steps: 1\n"
        "output_dir: run\nlogging_steps: 1\n")
    cfg = load_train_config(tmp_path / "lf.yaml")
    assert (cfg.data.train, cfg.data.eval) == ("data/chat.json", "data/qa.json")
    opts = PreprocessOptions(max_seq_len=cfg.max_seq_len, format=cfg.data.format)
    assert load_rows(cfg.data.train, tok, opts)[0] == load_rows("data/ours.json", tok, opts)[0]
    result = train(cfg, RunOptions(progress=False))
    stats = json.loads((tmp_path / "run/data_stats.json").read_text())
    assert result.steps == 1 and stats["rows"] == 4 and stats["dropped"] == [] and result.eval_loss_after is not None


@pytest.mark.parametrize("entry,says", [
    ({"file_name": "d.json", "formatting": "openai"},
     "formatting 'openai' is not one mlc reads; use alpaca or sharegpt"),
    ({"file_name": "d.json", "columns": {"prompt_col": "q"}}, "columns.prompt_col is not a LLaMA-Factory columns key"),
    ({"file_name": "d.json", "formatting": "sharegpt", "tags": {"speaker": "who"}},
     "tags.speaker is not a LLaMA-Factory tags key"),
    ({"file_name": "d.json", "columns": {"images": "pics"}}, "columns.images is for images"),
    ({"file_name": "d.json", "ranking": True}, "preference data"),
    ({"file_name": "d.json", "columns": {"prompt": ""}}, "columns.prompt must name a key of the rows"),
])
def test_bad_entries_name_the_key(tok, tmp_path, entry, says):
    data = write_dataset(tmp_path, {"d": entry}, {"d.json": ALPACA})
    with pytest.raises(DataError, match="entry 'd'") as e:
        tokenize_file(data / "d.json", tok, PreprocessOptions())
    assert says in str(e.value)


def test_bad_entry_is_reported_when_the_config_loads(tmp_path, monkeypatch):
    from mlc.config.loader import load_train_config

    monkeypatch.chdir(tmp_path)
    write_dataset(tmp_path, {"d": {"file_name": "d.json", "formatting": "csv"}}, {"d.json": ALPACA})
    (tmp_path / "lf.yaml").write_text("dataset: d\n")
    with pytest.raises(ConfigError, match="lf.yaml: .*entry 'd': formatting 'csv' is not one mlc reads"):
        load_train_config(tmp_path / "lf.yaml")


def test_a_named_column_missing_from_the_data_says_what_to_do(tok, tmp_path):
    # the prompt column: the first row already shows it is wrong, whatever --on-error says
    data = write_dataset(tmp_path, {"qa": {"file_name": "qa.json", "columns": {"prompt": "ask", "response": "answer"}}},
                         {"qa.json": renamed_alpaca()})
    with pytest.raises(DataError, match=r"entry 'qa' reads prompt from 'ask' \(columns\.prompt\), but the first row "
                                        r"has no 'ask' \(its keys: question, context, answer\); set columns\.prompt"):
        tokenize_file(data / "qa.json", tok, PreprocessOptions())
    # an optional column that no row has
    entry = {"file_name": "qa.json", "columns": {**ALPACA_ENTRY["columns"], "history": "earlier"}}
    write_dataset(tmp_path, {"qa": entry}, {})
    with pytest.raises(DataError, match=r"names columns\.history: 'earlier', but no row has an? 'earlier' key; "
                                        r"remove columns\.history or set it"):
        tokenize_file(data / "qa.json", tok, PreprocessOptions())
    # a tag the turns do not use
    entry = {**SHAREGPT_ENTRY, "file_name": "chat.json", "tags": {**SHAREGPT_ENTRY["tags"], "role_tag": "speaker"}}
    write_dataset(tmp_path, {"chat": entry}, {"chat.json": RENAMED_SHAREGPT})
    with pytest.raises(DataError, match=r"from 'speaker' \(tags\.role_tag\), but the first turn has no such key"):
        tokenize_file(data / "chat.json", tok, PreprocessOptions())


def test_format_that_contradicts_the_entry_is_refused(tok, tmp_path):
    data = write_dataset(tmp_path, {"chat": SHAREGPT_ENTRY}, {"chat.json": RENAMED_SHAREGPT})
    with pytest.raises(DataError, match="format alpaca was asked for .* says formatting: sharegpt"):
        tokenize_file(data / "chat.json", tok, PreprocessOptions(format="alpaca"))
    rows, _ = tokenize_file(data / "chat.json", tok, PreprocessOptions(format="sharegpt"))  # agreeing is fine
    assert len(rows) == 2


def test_preprocess_command_reads_the_entry(tiny, tmp_path):
    from typer.testing import CliRunner

    from mlc.cli import main

    main._register_all()
    data = write_dataset(tmp_path, {"chat": SHAREGPT_ENTRY}, {"chat.json": RENAMED_SHAREGPT})
    out = CliRunner().invoke(main.app, ["preprocess", str(data / "chat.json"), "--out", str(tmp_path / "tok"),
                                   "--model", str(tiny)])
    assert out.exit_code == 0, out.output
    assert "2 rows" in out.output and "entry 'chat' names them" in out.output
    assert json.loads((tmp_path / "tok/stats.json").read_text())["dropped"] == []
