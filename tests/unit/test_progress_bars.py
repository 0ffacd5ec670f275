"""Progress callbacks behind the CLI's bars (preprocess, eval, export --merge, compile; bench quant's, which runs a
child process, in tests/integration/test_bench_quant_progress.py), and the bar itself: on stderr, off when stderr is
not a terminal or with quiet, so piped output and --json stay clean."""

from __future__ import annotations

import json

import pytest
import torch

from mlc.cli.progress import progress_bar
from tests.support.tiny_llama import build_tiny_llama


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def test_bar_is_off_when_not_a_terminal_or_quiet(capsys):
    with progress_bar() as bar:  # pytest captures stderr: not a terminal
        assert bar.disable
        bar.add_task("x", total=3)
    assert progress_bar(quiet=True).disable
    assert capsys.readouterr().err == ""


def test_compile_reports_each_packed_layer(base, tmp_path):
    from mlc.models.compile import compile_model

    steps = []
    res = compile_model(base, tmp_path / "c", "int8", progress=lambda *a: steps.append(a))
    packed = [what for _, _, what in steps if what.startswith("packing ")]
    assert steps[0][2] == "loading weights" and steps[-1] == (1, 1, "writing")
    assert len(packed) == res.quantized_layers and "packing model.layers.1.mlp.down_proj" in packed
    assert all(0 < done < total for done, total, what in steps if what.startswith("packing "))


def test_eval_reports_rows_scored(base, tmp_path):
    from mlc.train.evaluate import evaluate

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Q{i}", "output": "Hello"}) + "\n" for i in range(5)))
    seen = []
    result = evaluate(str(base), data, batch_size=2, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(2, 5), (4, 5), (5, 5)] and result.rows == 5


def test_export_merge_reports_its_steps(base, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mlc.train.export import export_adapter

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], lora_dropout=0.0))
    peft.save_pretrained(str(tmp_path / "adapter"))
    steps = []
    out = export_adapter(tmp_path / "adapter", tmp_path / "merged", merge=True, model=str(base),
                         progress=lambda *a: steps.append(a))
    assert [s[0] for s in steps] == [0, 1, 2, 3, 4] and steps[-1] == (4, 4, "done")
    assert (out / "config.json").is_file()


def test_eval_samples_read_a_json_array_file(base, tmp_path):
    from mlc.train.evaluate import evaluate

    data = tmp_path / "d.json"
    rows = [{"conversations": [{"from": "human", "value": f"Q{i}"}, {"from": "gpt", "value": "Hello"}]}
            for i in range(3)]
    data.write_text(json.dumps([{"conversations": []}, *rows], indent=2))
    result = evaluate(str(base), data, samples=2, max_new_tokens=2)
    assert result.rows == 3 and result.dropped == 1
    assert [s["prompt"] for s in result.samples] == ["Q0", "Q1"]


def test_preprocess_reports_bytes_read(base, tmp_path):
    from mlc.models.tokenizer import load_tokenizer
    from mlc.train.preprocess import PreprocessOptions, preprocess_file

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Q{i}", "output": "Hello"}) + "\n" for i in range(40)))
    seen = []
    stats = preprocess_file(data, tmp_path / "ds", load_tokenizer(base), PreprocessOptions(max_seq_len=64),
                            progress=lambda rows, done, total: seen.append((rows, done, total)))
    assert seen and seen[-1] == (40, data.stat().st_size, data.stat().st_size) and stats.rows == 40
    assert [done for _, done, _ in seen] == sorted(done for _, done, _ in seen)

