"""Every lint rule fires on the config it is about, stays quiet on the fixed one, and only where its profile says."""

from __future__ import annotations

import pytest

from mlc.config.cluster_config import ClusterConfig
from mlc.config.hardware import detect_cpu, load_profile
from mlc.config.lint import RULES, has_errors, lint, severity_for
from mlc.config.serve_config import ServeConfig
from mlc.config.train_config import TrainConfig

ASCEND = load_profile("ascend-910b")
P310 = load_profile("ascend-310p")
H200 = load_profile("nvidia-h200")
CPU_BF16 = detect_cpu().model_copy(update={"bf16_native": True})
CPU_NO_BF16 = detect_cpu().model_copy(update={"bf16_native": False, "description": "old CPU"})


def train(**kw) -> TrainConfig:
    base = {"data": {"train": "data.jsonl"}, "batch_size": 8}
    for key, value in kw.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return TrainConfig(**base)


def serve(engine=None, **kw) -> ServeConfig:
    return ServeConfig(engine=engine or {}, **kw)


def cluster(env) -> ClusterConfig:
    return ClusterConfig(model="glm-4-9b", nodes=["a", "b"], tensor_parallel_size=8, data_parallel_size=2,
                         image="moloai/glm5-ascend:20240628", env=env)


# rule id, profile, expected severity, config that breaks the rule, the same config fixed
CASES = [
    ("lora-r-multiple-16", ASCEND, "error", train(lora={"r": 8, "alpha": 16}), train(lora={"r": 16, "alpha": 16})),
    ("lora-alpha-ge-r", ASCEND, "error", train(lora={"r": 64, "alpha": 32}), train(lora={"r": 64, "alpha": 64})),
    ("lora-alpha-ge-r", H200, "warning", train(lora={"r": 64, "alpha": 32}), train(lora={"r": 64, "alpha": 128})),
    ("lora-dtype-float32", ASCEND, "error", train(lora={"dtype": "float16"}), train(lora={"dtype": "float32"})),
    ("lora-dtype-float32", H200, "warning", train(lora={"dtype": "bfloat16"}), train()),
    ("lora-lr-max", H200, "warning", train(optimizer={"lr": 5e-4}), train(optimizer={"lr": 2e-4})),
    ("fp16-grad-accum-max", ASCEND, "error", train(precision="fp16", gradient_accumulation_steps=8),
     train(precision="fp16", gradient_accumulation_steps=4)),
    ("bf16-small-batch-ascend", ASCEND, "warning", train(precision="bf16", batch_size=4), train(precision="bf16")),
    ("bf16-small-batch-ascend", ASCEND, "warning", train(max_seq_len=4096), train(max_seq_len=2048)),
    ("clip-norm-range", H200, "warning", train(clip_norm=2.0), train(clip_norm=1.0)),
    ("clip-norm-range", H200, "warning", train(clip_norm=None), train(clip_norm=0.8)),
    ("pad-to-alignment", ASCEND, "warning", train(data={"pad_to_multiple_of": 8}),
     train(data={"pad_to_multiple_of": 32})),
    ("train-bf16-no-units", CPU_NO_BF16, "warning", train(precision="bf16"), train(precision="fp32")),
    ("train-dtype-unsupported", P310, "error", train(precision="bf16"), train(precision="fp16")),
    ("sparse-kv-ratio-min", CPU_BF16, "warning", serve({"sparse_kv": {"ratio": 0.1}}),
     serve({"sparse_kv": {"ratio": 0.25}})),
    ("kv-dtype-unsupported", P310, "error", serve({"kv_cache_dtype": "bf16"}), serve({"kv_cache_dtype": "fp16"})),
    ("weight-dtype-unsupported", P310, "error", serve({"weight_dtype": "int4"}), serve({"weight_dtype": "int8"})),
    ("dtype-unsupported", P310, "error", serve({"dtype": "bfloat16"}), serve({"dtype": "fp16"})),
    ("bf16-no-units", CPU_NO_BF16, "warning", serve({"dtype": "bf16"}), serve({"dtype": "auto"})),
    ("bf16-no-units", CPU_NO_BF16, "warning", serve({"kv_cache_dtype": "bf16"}), serve({"kv_cache_dtype": "fp32"})),
    ("kv-bf16-ascend", ASCEND, "info", serve({"kv_cache_dtype": "bf16"}), serve({"kv_cache_dtype": "fp16"})),
    ("page-size-alignment", ASCEND, "warning", serve({"page_size": 8}), serve({"page_size": 16})),
    ("open-without-auth", CPU_BF16, "warning", serve(host="0.0.0.0"), serve(host="0.0.0.0", api_keys=["k"])),
    ("request-timeout-short", CPU_BF16, "warning", serve(request_timeout_s=10), serve(request_timeout_s=120)),
    ("audit-content-without-log", CPU_BF16, "warning", serve(audit_log_content=True),
     serve(audit_log_content=True, audit_log="audit.jsonl")),
    ("device-profile-mismatch", ASCEND, "info", serve({"device": "cpu"}), serve({"device": "npu:0"})),
    ("hccl-whitelist", ASCEND, "warning", cluster({}), cluster({"HCCL_WHITELIST_DISABLE": 1})),
    ("rank-size-mismatch", ASCEND, "error", cluster({"RANK_SIZE": 4}), cluster({"RANK_SIZE": 16})),
]


def ids(findings, rule):
    return [f for f in findings if f.rule == rule]


@pytest.mark.parametrize("rule, profile, severity, bad, good", CASES,
                         ids=[f"{c[0]}@{c[1].name}-{i}" for i, c in enumerate(CASES)])
def test_rule_fires_and_stays_quiet(rule, profile, severity, bad, good):
    fired = ids(lint(bad, profile), rule)
    assert len(fired) == 1, f"{rule} did not fire"
    f = fired[0]
    assert f.severity == severity and f.message and f.fix and f.reason
    assert ids(lint(good, profile), rule) == []


def test_every_rule_is_tested():
    assert {r.id for r in RULES} == {c[0] for c in CASES}
    assert len({r.id for r in RULES}) == len(RULES)


@pytest.mark.parametrize("rule", ["lora-r-multiple-16", "fp16-grad-accum-max", "bf16-small-batch-ascend",
                                  "pad-to-alignment", "kv-bf16-ascend", "hccl-whitelist"])
def test_ascend_rules_are_off_on_nvidia(rule):
    case = next(c for c in CASES if c[0] == rule)
    assert ids(lint(case[3], H200), rule) == []
    assert severity_for(next(r for r in RULES if r.id == rule), H200) is None


def test_bf16_is_fine_on_a_cpu_with_bf16_units():
    assert ids(lint(serve({"dtype": "bf16"}), CPU_BF16), "bf16-no-units") == []
    assert ids(lint(train(precision="bf16"), CPU_BF16), "train-bf16-no-units") == []


def test_tutorial_lora_values_are_clean_on_ascend():
    # lora_r 64, lora_alpha 64, float32, lr 2e-4, batch 8, len 2048, grad accumulation 2 (tutorial 3.4, 4.3, 5.3)
    cfg = train(lora={"r": 64, "alpha": 64, "dtype": "float32"}, optimizer={"lr": 2e-4}, max_seq_len=2048,
                gradient_accumulation_steps=2)
    assert lint(cfg, ASCEND) == []


def test_findings_sorted_errors_first():
    cfg = train(lora={"r": 8, "alpha": 4}, optimizer={"lr": 1e-3})
    found = lint(cfg, ASCEND)
    assert [f.severity for f in found] == sorted((f.severity for f in found), key=["error", "warning", "info"].index)
    assert has_errors(found) and not has_errors(lint(train(optimizer={"lr": 1e-3}), H200))
