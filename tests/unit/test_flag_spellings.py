"""One spelling per idea: `--out` (file or dir written) and `--prompts-file` across generate, bench and plan, and
plan's sizing flags under the engine commands' names; the old spellings stay as aliases."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tests.support.tiny_llama import build_tiny_llama


@pytest.fixture(scope="module")
def app():
    from mlc.cli import main

    main._register_all()
    return main.app


def _help(app, *cmd: str) -> str:
    result = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("cmd, flags", [
    (("generate",), ["--out", "--output", "--prompts-file", "--prompt-file"]),
    (("bench", "kv"), ["--out", "--output"]),
    (("bench", "quant"), ["--json"]),
    (("bench", "offline"), ["--max-batch-size", "--batch", "--max-num-seqs"]),
    (("bench", "serve"), ["--plot", "--quiet"]),
    (("preprocess",), ["--max-seq-len", "--seq-len"]),
    (("eval",), ["--max-seq-len", "--seq-len"]),
    (("doctor",), ["--prompts-file", "--prompt-file"]),
    (("plan",), ["--seq-len", "--max-seq-len", "--max-model-len", "--batch", "--max-batch-size", "--max-num-seqs",
                 "--kv-dtype", "--kv-cache-dtype", "--page-size", "--block-size", "--json"]),
])
def test_help_lists_the_spelling_and_its_aliases(app, cmd, flags):
    text = _help(app, *cmd)
    assert all(flag in text for flag in flags), [f for f in flags if f not in text]


def test_plan_reads_the_engine_spellings_the_same(app):
    runner = CliRunner()
    ours = ["plan", "-m", "glm-4-9b", "--hardware", "nvidia-h200", "--json"]
    a = runner.invoke(app, [*ours, "--seq-len", "4096", "--batch", "2", "--kv-dtype", "int8", "--page-size", "32"])
    b = runner.invoke(app, [*ours, "--max-model-len", "4096", "--max-num-seqs", "2", "--kv-cache-dtype", "int8",
                            "--block-size", "32"])
    assert a.exit_code == b.exit_code == 0, a.output + b.output
    assert json.loads(a.output) == json.loads(b.output)
    assert "4096" in a.output and "int8" in a.output


def test_generate_old_and_new_spellings_write_the_same_file(app, tmp_path):
    model = build_tiny_llama(tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n" + json.dumps({"prompt": "Where"}) + "\n")
    runner = CliRunner()
    base = ["generate", "-m", str(model), "-n", "3"]
    a = runner.invoke(app, [*base, "--prompts-file", str(prompts), "--out", str(tmp_path / "a.jsonl")])
    b = runner.invoke(app, [*base, "--prompt-file", str(prompts), "--output", str(tmp_path / "b.jsonl")])
    assert a.exit_code == b.exit_code == 0, a.output + b.output
    rows = (tmp_path / "a.jsonl").read_text().splitlines()
    assert len(rows) == 2 and rows == (tmp_path / "b.jsonl").read_text().splitlines()
