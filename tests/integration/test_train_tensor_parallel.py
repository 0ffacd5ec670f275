"""LoRA training with the model split over two gloo ranks (`parallel_config: {model_parallel: 2, data_parallel: 1}`,
as the tutorial writes it) follows one process's run step by step, and saves a whole adapter that serves."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from mlc.engine.llm import LLM
from tests.integration import test_train
from tests.integration.test_train import ENV, adapter_tensors, config, finish, losses, run_inproc

work = test_train.work  # test_train's module fixture (its tiny model and data), found here by pytest under this name

LORA = {"lora.target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "lora.dropout": 0.0}  # dropout masks are drawn per rank's slice, so parity is checked without dropout


def test_model_parallel_2_matches_one_process(work):
    path = work / "tp2.yaml"
    raw = config(work, "tp2", **LORA, max_steps=6, save_every=3)
    raw["parallel_config"] = {"model_parallel": 2, "data_parallel": 1}
    path.write_text(yaml.safe_dump(raw))
    two = subprocess.Popen([sys.executable, "-m", "mlc.cli.main", "train", str(path), "--quiet"], env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_inproc(work, "tp1", **LORA, max_steps=6, save_every=3)
    out = finish(two)
    assert "parallel_config.model_parallel -> tensor_parallel" in out
    one, split = losses(work / "tp1"), losses(work / "tp2")
    assert sorted(split) == list(range(1, 7))
    for step in one:
        assert abs(one[step] - split[step]) < 1e-5, (step, one[step], split[step])
    whole, ref = adapter_tensors(work / "tp2" / "adapter"), adapter_tensors(work / "tp1" / "adapter")
    assert whole.keys() == ref.keys()
    for key in ref:
        assert whole[key].shape == ref[key].shape
        assert torch.allclose(whole[key], ref[key], atol=1e-5), key
    assert (work / "tp2" / "checkpoints" / "step-000006" / "optimizer-tp1.pt").is_file()
    llm = LLM(str(work / "model"), kv_cache_memory="4MiB", lora_adapters={"tp": str(work / "tp2" / "adapter")})
    assert llm.engine.adapter_id("tp") == 1

    # resumed from step 3 at the same tensor-parallel size, steps 4-6 repeat the uninterrupted run's losses
    shutil.copytree(work / "tp2", work / "tp2r")
    shutil.rmtree(work / "tp2r" / "checkpoints" / "step-000006")
    raw["output_dir"] = str(work / "tp2r")
    path.write_text(yaml.safe_dump(raw))
    finish(subprocess.Popen([sys.executable, "-m", "mlc.cli.main", "train", str(path), "--quiet", "--resume"],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    resumed = losses(work / "tp2r")
    for step in (4, 5, 6):
        assert abs(resumed[step] - split[step]) < 1e-6, (step, resumed[step], split[step])


def test_model_parallel_refuses_what_it_cannot_split(work, tmp_path, capsys):
    from mlc.cli.main import main
    from mlc.config.loader import validate_train_config
    from mlc.errors import ConfigError
    from mlc.train.run import RunOptions, train

    path = tmp_path / "tp3.yaml"  # 4 heads: refused before any process starts
    path.write_text(yaml.safe_dump({**config(work, "tp3"), "parallel_config": {"model_parallel": 3}}))
    with pytest.raises(SystemExit) as e:
        main(["train", str(path)])
    assert e.value.code == 2
    assert "model_parallel 3 does not divide the model's attention heads (4)" in capsys.readouterr().err

    with pytest.raises(ConfigError, match="one process per rank"):
        train(validate_train_config(config(work, "tp-inproc", tensor_parallel=2)), RunOptions(fresh=True,
                                                                                               progress=False))


@pytest.mark.slow
def test_two_copies_each_split_in_two_match_two_whole_copies(work):
    """data_parallel 2 x model_parallel 2 (four processes, DDP inside each data-parallel group) follows data_parallel
    2 alone step by step."""
    runs = {}
    for name, par in (("dp2", {"data_parallel": 2, "model_parallel": 1}),
                      ("dp2tp2", {"data_parallel": 2, "model_parallel": 2})):
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**config(work, name, **LORA, max_steps=4, save_every=4),
                                        "parallel_config": par}))
        finish(subprocess.Popen([sys.executable, "-m", "mlc.cli.main", "train", str(path), "--quiet"], env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        runs[name] = losses(work / name)
    assert sorted(runs["dp2tp2"]) == [1, 2, 3, 4]
    for step, loss in runs["dp2"].items():
        assert abs(runs["dp2tp2"][step] - loss) < 1e-5, (step, loss, runs["dp2tp2"][step])
