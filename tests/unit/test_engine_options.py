"""The engine's options, defined once from EngineConfig (`mlc/cli/engine_options.py`): every command that runs the
engine takes all of them and `--config FILE`, under the spellings the other tests pin, and a flag given overrides
the file's `engine:` key while a flag not given leaves it."""

from __future__ import annotations

import types

import pytest
import typer
from typer.testing import CliRunner

from mlc.cli.engine_options import FLAGS, PANEL, EngineArgs, config_argv, flag_for, option_fields
from mlc.cli.main import _register_all, app
from mlc.config.engine_config import EngineConfig

# Command path -> fields it sets itself instead (bench tp sweeps the tensor-parallel size with --sizes, bench pp
# the stages and the batch-queue depth).
ENGINE_COMMANDS = {
    ("generate",): (),
    ("chat",): (),
    ("serve",): (),
    ("bench", "offline"): (),
    ("bench", "tp"): ("tensor_parallel_size",),
    ("bench", "pp"): ("pipeline_parallel_size", "pipeline_depth"),  # --stages, then depth 1 and depth = stages
    ("bench", "compare"): (),
    ("bench", "pd", "transfer"): (),
}
# Where a command's own option has the spelling, the engine's keeps its others (or --engine-NAME).
RESPELLED = {("generate",): {"seed": ["--engine-seed"]}, ("chat",): {"seed": ["--engine-seed"]},
             ("bench", "compare"): {"num_threads": ["--num-threads"]}}


class Stop(Exception):
    """Raised by a stand-in for the engine or server, carrying the config it was given."""

    def __init__(self, config):
        super().__init__("stopped")
        self.config = config


@pytest.fixture(scope="module")
def root():
    _register_all()
    return typer.main.get_command(app)


def _walk(cmd, path=()):
    if isinstance(getattr(cmd, "commands", None), dict):
        for name, sub in cmd.commands.items():
            yield from _walk(sub, (*path, name))
    else:
        yield path, cmd


def _command(root, path):
    cmd = root
    for name in path:
        cmd = cmd.commands[name]
    return cmd


def test_every_scalar_engine_field_is_an_option_with_a_help_row():
    scalar = [n for n in EngineConfig.model_fields if flag_for(n) is not None]
    assert sorted(option_fields()) == sorted(scalar)
    assert set(FLAGS) == set(scalar), "give each EngineConfig field a row in FLAGS (spellings, help)"
    assert set(EngineConfig.model_fields) - set(scalar) == {"sparse_kv", "lora_adapters"}  # config-file keys
    assert "speculative_config" in scalar  # nested, and a flag too: JSON text


def test_the_engine_commands_are_the_ones_listed(root):
    found = {path for path, cmd in _walk(root) if getattr(cmd.callback, "engine_option_names", None)}
    assert found == set(ENGINE_COMMANDS)


@pytest.mark.parametrize("path", list(ENGINE_COMMANDS), ids=" ".join)
def test_every_engine_command_takes_every_engine_option_and_config(root, path):
    cmd = _command(root, path)
    options = {p.name: p for p in cmd.params if p.param_type_name == "option"}
    names = cmd.callback.engine_option_names  # field -> parameter
    wanted = [f for f in option_fields() if f not in ENGINE_COMMANDS[path]]
    assert sorted(names) == sorted(wanted)
    for field in wanted:
        opt = options[names[field]]
        assert opt.default is None and opt.rich_help_panel == PANEL, field  # None: not given, the file decides
        spellings = {*opt.opts, *opt.secondary_opts}
        expected = RESPELLED.get(path, {}).get(field) or [s for d in FLAGS[field].decls for s in d.split("/")]
        assert set(expected) <= spellings, (field, spellings)
    assert options["config"].opts == ["--config"] and options["config"].rich_help_panel == PANEL
    text = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"}).output
    assert "Engine" in text and "--config" in text and "--kv-cache-fraction" in text


def test_the_engine_spellings_parse_the_same_everywhere(root):
    argv = ["-m", "x", "--batch", "3", "--seq-len", "64", "--block-size", "32", "--kv-dtype", "int8",
            "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--no-chunked-prefill",
            "--kv-cache-fraction", "0.3", "--compile", "--enable-expert-parallel", "--verify"]
    for path in ENGINE_COMMANDS:
        params = _command(root, path).make_context(path[-1], list(argv)).params
        assert (params["model"], params["max_batch_size"], params["max_seq_len"], params["page_size"]) == (
            "x", 3, 64, 32)
        assert params["kv_cache_dtype"] == "int8" and params["max_num_batched_tokens"] == 512
        assert params["enable_prefix_caching"] is False and params["enable_chunked_prefill"] is False
        assert params["kv_cache_fraction"] == 0.3 and params["compile"] and params["enable_expert_parallel"]
        assert params["verify"]


def _serve_yaml(tmp_path, model: str = "file-model"):
    path = tmp_path / "serve.yaml"
    path.write_text(f"engine:\n  model: {model}\n  page_size: 32\n  max_seq_len: 256\n  kv_cache_memory: 64MiB\n"
                    "  seed: 7\nport: 9001\n")
    return path


def _fake_llm(monkeypatch):
    import mlc.engine.llm

    def fake(*args, config=None, **kwargs):
        raise Stop(config)

    monkeypatch.setattr(mlc.engine.llm, "LLM", fake)


@pytest.mark.parametrize("path", [("generate", "-p", "hi"), ("chat",), ("bench", "offline"), ("bench", "tp")],
                         ids=["generate", "chat", "bench offline", "bench tp"])
def test_a_flag_overrides_the_files_engine_key_and_the_rest_stays(root, tmp_path, monkeypatch, path):
    _fake_llm(monkeypatch)  # each of them builds LLM(config=...) first
    monkeypatch.delenv("ASCEND_MAX_MEM", raising=False)
    result = CliRunner().invoke(app, [*path, "--config", str(_serve_yaml(tmp_path)), "--page-size", "64",
                                      "--kv-cache-fraction", "0.25"])
    assert isinstance(result.exception, Stop), result.output
    cfg = result.exception.config
    assert (cfg.page_size, cfg.kv_cache_fraction) == (64, 0.25)  # the flags
    assert (cfg.model, cfg.max_seq_len, cfg.kv_cache_memory, cfg.seed) == ("file-model", 256, 64 * 2**20, 7)
    assert cfg.device == EngineConfig().device  # neither: EngineConfig's default


def test_serve_flag_overrides_the_files_engine_key(tmp_path, monkeypatch):
    import sys

    monkeypatch.setenv("MLC_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.delenv("MLC_API_KEY", raising=False)
    monkeypatch.delenv("ASCEND_MAX_MEM", raising=False)
    monkeypatch.setattr("mlc.cli.serve.check_model", lambda *a: None)

    def build_server(config, *a, **k):
        raise Stop(config)

    monkeypatch.setitem(sys.modules, "mlc.server.run", types.SimpleNamespace(build_server=build_server))
    result = CliRunner().invoke(app, ["serve", "--config", str(_serve_yaml(tmp_path)), "--seq-len", "128",
                                      "--no-prefix-caching", "--threads", "2"])
    assert isinstance(result.exception, Stop), result.output
    cfg = result.exception.config
    assert (cfg.engine.max_seq_len, cfg.engine.enable_prefix_caching, cfg.engine.num_threads) == (128, False, 2)
    assert (cfg.engine.model, cfg.engine.page_size, cfg.engine.seed, cfg.port) == ("file-model", 32, 7, 9001)


def test_bench_compare_hands_the_engine_settings_to_our_server(tmp_path, monkeypatch):
    import sys

    def run_compare(cfg, progress=None):
        raise Stop(cfg)

    monkeypatch.setitem(sys.modules, "mlc.bench.compare_run", types.SimpleNamespace(run_compare=run_compare))
    result = CliRunner().invoke(app, ["bench", "compare", "--config", str(_serve_yaml(tmp_path)), "--page-size",
                                      "64", "--threads", "3", "--num-threads", "2", "--no-offline",
                                      "--ours-arg=--max-queue", "--ours-arg=8"])
    assert isinstance(result.exception, Stop), result.output
    cfg = result.exception.config
    assert cfg.model == "file-model" and cfg.threads == 3  # --threads stays llama-server's
    assert cfg.ours_args == ["--kv-cache-memory", str(64 * 2**20), "--page-size", "64", "--max-seq-len", "256",
                             "--seed", "7", "--threads", "2", "--max-queue", "8"]  # then --ours-arg


def test_config_argv_reads_back_as_the_same_config(root):
    cfg = EngineConfig(model="m", device="cuda:1", weight_dtype="int8", kv_cache_memory="1GiB", max_batch_size=4,
                       enable_prefix_caching=False, compile=True, verify=True, tensor_parallel_size=2,
                       lora_adapters={"a": "runs/a"})
    argv = config_argv(cfg, skip=())
    params = root.commands["serve"].make_context("serve", argv).params
    assert params["lora"] == ["a=runs/a"]
    flags = {field: params[field] for field in option_fields()}
    back = EngineArgs(flags=flags).load()
    assert back == cfg.model_copy(update={"lora_adapters": {}})
