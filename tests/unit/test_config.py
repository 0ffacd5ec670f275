"""Config schemas, the YAML loader's error messages, aliases, overrides, templates and hardware profiles."""

from __future__ import annotations

import textwrap

import pytest

from mlc.config.cluster_config import ClusterConfig
from mlc.config.hardware import HardwareProfile, detect_cpu, load_profile, profile_names
from mlc.config.lint import lint
from mlc.config.loader import detect_kind, load_any, load_config, parse_set_options
from mlc.config.serve_config import ServeConfig
from mlc.errors import ConfigError
from tests.support.tutorial_text import GLM5_INFER_YAML

# The reference tutorial's config/glm5_infer.yaml keys, as it writes them (section 2.3 and 3.2), and a few more.
TUTORIAL_YAML = GLM5_INFER_YAML + "max_batch_size: 8\nmax_seq_len: 16384\nport: 8080\n"


def write(tmp_path, text: str, name: str = "c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(path, schema=ServeConfig, overrides=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, schema, overrides)
    return str(e.value)


def test_tutorial_glm5_infer_yaml_is_accepted(tmp_path):
    cfg = load_config(write(tmp_path, TUTORIAL_YAML), ServeConfig)
    assert cfg.engine.kv_cache_dtype == "fp16"
    assert cfg.engine.page_size == 16
    assert cfg.engine.sparse_kv is not None and cfg.engine.sparse_kv.ratio == 0.25
    assert cfg.engine.sparse_kv.window == 4096 and cfg.engine.sparse_kv.min_context == 8192  # tutorial 3.2
    assert cfg.engine.max_batch_size == 8 and cfg.engine.max_seq_len == 16384
    assert cfg.paged_attention is True and cfg.attn_implementation == "sdpa" and cfg.port == 8080


def test_tutorial_shape_also_accepted_directly():
    import yaml

    cfg = ServeConfig(**yaml.safe_load(TUTORIAL_YAML))
    assert cfg.engine.sparse_kv.ratio == 0.25 and cfg.engine.kv_cache_dtype == "fp16"


def test_alias_and_key_that_disagree_fail(tmp_path):
    path = write(tmp_path, "attn_config: {page_size: 32}\nengine: {page_size: 16}\n")
    msg = error_of(path)
    assert str(path) in msg and "attn_config.page_size" in msg and "engine.page_size" in msg


def test_bad_value_names_file_key_and_allowed_values(tmp_path):
    path = write(tmp_path, "engine:\n  kv_cache_dtype: fp8\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: engine.kv_cache_dtype:")
    assert "got 'fp8'" in msg
    assert "(allowed: auto, fp32, fp16, bf16, int8, int4)" in msg


def test_unknown_key_suggests_and_lists_allowed(tmp_path):
    path = write(tmp_path, "engine:\n  kv_cahce_dtype: fp16\nprot: 80\n")
    lines = error_of(path).splitlines()
    assert len(lines) == 2
    engine_line = next(line for line in lines if "kv_cahce_dtype" in line)
    assert "did you mean engine.kv_cache_dtype?" in engine_line
    assert "allowed: compile, device, dtype" in engine_line
    top = next(line for line in lines if "prot" in line)
    assert "did you mean port?" in top and "api_keys" in top


def test_numeric_bounds_are_the_allowed_values(tmp_path):
    msg = error_of(write(tmp_path, "engine: {page_size: 0}\nport: 70000\n"))
    assert "engine.page_size" in msg and "(allowed: >= 1 and <= 1024)" in msg
    assert "port" in msg and "(allowed: >= 1 and <= 65535)" in msg


def test_alias_errors_name_the_key_as_written(tmp_path):
    msg = error_of(write(tmp_path, "attn_config:\n  sparse_kv_ratio: 3\n"))
    assert "attn_config.sparse_kv_ratio (read as engine.sparse_kv.ratio)" in msg
    assert "(allowed: > 0.0 and <= 1.0)" in msg


def test_bool_and_literal(tmp_path):
    msg = error_of(write(tmp_path, "paged_attention: maybe\nattn_implementation: triton\n"))
    assert "paged_attention" in msg and "(allowed: true, false)" in msg
    assert "attn_implementation" in msg and "(allowed: sdpa, paged)" in msg


def test_overrides_apply_last_and_none_means_unset(tmp_path):
    path = write(tmp_path, "engine: {page_size: 16, max_batch_size: 4}\nport: 9000\n")
    cfg = load_config(path, ServeConfig, {"engine.page_size": 32, "port": None, "engine.kv_cache_dtype": "bf16"})
    assert cfg.engine.page_size == 32 and cfg.port == 9000 and cfg.engine.kv_cache_dtype == "bf16"
    assert cfg.engine.max_batch_size == 4


def test_override_errors_say_command_line(tmp_path):
    msg = error_of(write(tmp_path, "port: 9000\n"), overrides={"engine.max_batch_size": 0})
    assert "engine.max_batch_size (from the command line)" in msg


def test_defaults_without_file():
    cfg = load_config(None, ServeConfig, {"port": 9001})
    assert cfg.port == 9001 and cfg.engine.model == "smollm2-135m-instruct"


def test_set_options_parse_yaml_values():
    assert parse_set_options(["engine.page_size=32", "api_keys=[a, b]", "strict_input=true"]) == {
        "engine.page_size": 32, "api_keys": ["a", "b"], "strict_input": True}
    with pytest.raises(ConfigError, match="key=value"):
        parse_set_options(["page_size"])


def test_yaml_syntax_error_has_line(tmp_path):
    msg = error_of(write(tmp_path, "engine:\n  page_size: [16\nport: 1\n"))
    assert "line" in msg and "YAML syntax error" in msg


def test_missing_file_and_non_mapping(tmp_path):
    assert "config init" in error_of(tmp_path / "nope.yaml")
    assert "mapping" in error_of(write(tmp_path, "- a\n- b\n"))


def test_context_profiles_must_fit_max_seq_len():
    with pytest.raises(ValueError, match="exceed engine.max_seq_len"):
        ServeConfig(engine={"max_seq_len": 4096}, context_profiles={"legal": 16384, "short": 4096})
    assert ServeConfig(context_profiles={"short": 4096}).context_profiles == {"short": 4096}


# cluster
CLUSTER = {"model": "glm-4-9b", "nodes": ["a", "b"], "devices_per_node": 8, "tensor_parallel_size": 8,
           "data_parallel_size": 2, "image": "moloai/glm5-ascend:20240628"}


@pytest.mark.parametrize("image, ok", [
    ("moloai/glm5-ascend:20240628", True),
    ("registry.local:5000/glm5-ascend:20240628-cann8.0", True),
    ("moloai/glm5-ascend@sha256:" + "a" * 64, True),
    ("moloai/glm5-ascend:latest", False),
    ("moloai/glm5-ascend", False),
    ("registry.local:5000/glm5-ascend", False),
    ("moloai/glm5-ascend:v1.2", False),
])
def test_image_must_be_pinned_by_date_or_digest(image, ok):
    if ok:
        assert ClusterConfig(**{**CLUSTER, "image": image}).image == image
    else:
        with pytest.raises(ValueError, match="pin"):
            ClusterConfig(**{**CLUSTER, "image": image})


def test_cluster_env_values_become_strings_and_sizes_are_checked():
    cfg = ClusterConfig(**{**CLUSTER, "env": {"HCCL_WHITELIST_DISABLE": 1, "FLAG": True}})
    assert cfg.env == {"HCCL_WHITELIST_DISABLE": "1", "FLAG": "1"}
    assert cfg.world_size == 16 and cfg.total_devices == 16
    with pytest.raises(ValueError, match="nodes have 16"):
        ClusterConfig(**{**CLUSTER, "data_parallel_size": 4})
    with pytest.raises(ValueError, match="inside one node"):
        ClusterConfig(**{**CLUSTER, "tensor_parallel_size": 16, "data_parallel_size": 1})
    with pytest.raises(ValueError, match="listed twice"):
        ClusterConfig(**{**CLUSTER, "nodes": ["a", "a"]})


def test_cluster_file_errors(tmp_path):
    path = write(tmp_path, "model: m\nimage: x/y:latest\nnodes: [{host: a, gpus: 2}]\n")
    msg = error_of(path, ClusterConfig)
    assert "nodes.0.gpus: unknown key" in msg and "(allowed: devices, host, ssh_user)" in msg
    assert "image:" in msg and "latest" in msg


# templates and the config command
@pytest.mark.parametrize("kind", ["serve", "cluster", "lora"])
def test_templates_are_valid_and_lint_clean(kind):
    from mlc.cli.config_cmd import template_path

    path = template_path(kind)
    got_kind, cfg = load_any(path)
    assert got_kind == kind
    assert [f for f in lint(cfg) if f.severity == "error"] == []


def test_detect_kind():
    assert detect_kind({"nodes": []}) == "cluster"
    assert detect_kind({"lora": {}}) == "lora"
    assert detect_kind({"engine": {}}) == "serve"


def run_cli(args, capsys):
    from mlc.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code or 0, out.out + out.err


def test_config_init_and_check_cli(tmp_path, capsys):
    out = tmp_path / "serve.yaml"
    code, _ = run_cli(["config", "init", "serve", "--out", str(out)], capsys)
    assert code == 0 and out.read_text().startswith("# mlc serve config")
    code, text = run_cli(["config", "init", "serve", "--out", str(out)], capsys)
    assert code == 2 and "--force" in text
    code, text = run_cli(["config", "check", str(out), "--hardware", "cpu"], capsys)
    assert code == 0 and "valid serve config" in text
    code, text = run_cli(["config", "check", str(out), "--hardware", "ascend-310p",
                          "--set", "engine.kv_cache_dtype=bf16"], capsys)
    assert code == 1 and "kv-dtype-unsupported" in text
    bad = write(tmp_path, "engine: {kv_cache_dtype: fp8}\n", "bad.yaml")
    code, text = run_cli(["config", "check", str(bad)], capsys)
    assert code == 2 and "engine.kv_cache_dtype" in text and "allowed:" in text


# hardware profiles
@pytest.mark.parametrize("name", ["nvidia-h200", "nvidia-a100-80g", "ascend-910b", "ascend-310p"])
def test_builtin_profiles_load(name):
    p = load_profile(name)
    assert p.name == name and p.memory > 10e9 and p.memory_bandwidth_gbps > 100
    assert p.preferred_dtype in p.compute_dtypes and set(p.kv_cache_dtypes) <= {"fp32", "fp16", "bf16", "int8", "int4"}
    assert p.alignment == 16


def test_profile_facts():
    assert load_profile("nvidia-h200").memory == 141_000_000_000
    assert not load_profile("ascend-310p").has_bf16_units and "bf16" not in load_profile("ascend-310p").kv_cache_dtypes
    assert load_profile("ascend-910b").uncertain  # Huawei publishes few figures: marked as such
    assert set(profile_names()) >= {"cpu", "nvidia-h200", "nvidia-a100-80g", "ascend-910b", "ascend-310p"}
    with pytest.raises(ConfigError, match="allowed: .*ascend-910b"):
        load_profile("tpu-v5")


def test_cpu_detection_reads_flags(monkeypatch):
    import mlc.config.hardware as hw

    monkeypatch.setattr(hw, "_cpuinfo", lambda: {"model name": "Test CPU", "cpu MHz": "2000", "flags": "fma avx2"})
    cpu = detect_cpu()
    assert cpu.device == "cpu" and not cpu.has_bf16_units and cpu.cpu_flags == ["avx2", "fma"]
    assert cpu.memory > 0 and "memory_bandwidth_gbps" in cpu.uncertain
    monkeypatch.setattr(hw, "_cpuinfo", lambda: {"flags": "avx512f avx512_bf16 amx_bf16 amx_tile"})
    cpu = detect_cpu(measure=True)
    assert cpu.has_bf16_units and cpu.peak_dense_tflops["bf16"] > cpu.peak_dense_tflops["fp32"]
    assert cpu.measured["memory_bandwidth_gbps"] > 0.1


def test_custom_profile_file(tmp_path):
    path = write(tmp_path, """\
        name: my-card
        vendor: other
        device: cuda
        memory: 24GiB
        memory_bandwidth_gbps: 900
        peak_dense_tflops: {fp16: 100}
        compute_dtypes: [fp16]
        weight_dtypes: [fp16]
        kv_cache_dtypes: [fp16]
        preferred_dtype: fp16
        """, "my-card.yaml")
    p = load_profile(str(path))
    assert isinstance(p, HardwareProfile) and p.memory == 24 * 2**30
