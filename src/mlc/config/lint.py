"""Config lint: the reference tutorial's hardware rules (and a few of our own) as data, each with its reason.

A rule's severity depends on the hardware profile: looked up by profile name, then vendor, then "*"; None
turns the rule off there. `lint(config, profile)` returns the findings of every rule that applies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlc.config.hardware import HardwareProfile, load_profile

SEVERITIES = ("error", "warning", "info")
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
_DTYPE_NAMES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class Finding:
    rule: str
    severity: str
    key: str
    message: str
    fix: str
    reason: str


@dataclass(frozen=True)
class Rule:
    id: str
    kind: str  # "train" | "serve" | "cluster"
    key: str  # the config key the rule reads
    severity: dict[str, str | None]  # profile name | vendor | "*" -> severity (None: off)
    reason: str
    fix: str
    check: Callable[[Any, HardwareProfile], str | None]  # a message when the rule fires


def _dtype(name: str | None) -> str | None:
    return _DTYPE_NAMES.get(name, name) if name else None


def train_precision(cfg, profile: HardwareProfile) -> str:
    """The precision a run uses: auto is fp32 on CPU and bf16 on CUDA/NPU (train_config's documented rule)."""
    if cfg.precision != "auto":
        return cfg.precision
    return "fp32" if profile.device == "cpu" else "bf16"


def serve_dtypes(cfg) -> dict[str, str]:
    """The explicitly chosen dtypes of a serve config, by key ("auto" is the engine's choice and never wrong)."""
    e = cfg.engine
    named = {"engine.dtype": _dtype(e.dtype), "engine.weight_dtype": e.weight_dtype,
             "engine.kv_cache_dtype": e.kv_cache_dtype}
    return {k: v for k, v in named.items() if v and v != "auto"}


def _next_multiple(n: int, m: int) -> int:
    return max(m, -(-n // m) * m)


# checks: return a message when the rule fires
def _lora_r(cfg, p):
    r = cfg.lora.r
    return f"lora.r = {r} is not a multiple of 16 (use {_next_multiple(r, 16)})" if r % 16 else None


def _lora_alpha(cfg, p):
    return f"lora.alpha = {cfg.lora.alpha:g} is below lora.r = {cfg.lora.r}" if cfg.lora.alpha < cfg.lora.r else None


def _lora_dtype(cfg, p):
    return f"lora.dtype = {cfg.lora.dtype}; adapter weights should be float32" if cfg.lora.dtype != "float32" else None


def _lora_lr(cfg, p):
    lr = cfg.optimizer.lr
    return f"optimizer.lr = {lr:g} is above 3e-4 for LoRA" if lr > 3e-4 else None


def _fp16_accum(cfg, p):
    steps = cfg.gradient_accumulation_steps
    if train_precision(cfg, p) == "fp16" and steps > 4:
        return f"gradient_accumulation_steps = {steps} with fp16 precision (at most 4)"
    return None


def _bf16_small_batch(cfg, p):
    if train_precision(cfg, p) != "bf16":
        return None
    if cfg.batch_size < 8 or cfg.max_seq_len > 2048:
        return (f"bf16 with batch_size = {cfg.batch_size}, max_seq_len = {cfg.max_seq_len} "
                "(stable: batch >= 8, len <= 2048)")
    return None


def _clip_norm(cfg, p):
    c = cfg.clip_norm
    if c is None:
        return "clip_norm is off; fp16/bf16 SwiGLU activations can overflow into inf gradients"
    return f"clip_norm = {c:g} is outside 0.8-1.2" if not 0.8 <= c <= 1.2 else None


def _train_pad(cfg, p):
    m = cfg.data.pad_to_multiple_of
    return f"data.pad_to_multiple_of = {m} is not a multiple of {p.alignment}" if m % p.alignment else None


def _train_bf16_units(cfg, p):
    if train_precision(cfg, p) == "bf16" and "bf16" in p.compute_dtypes and not p.has_bf16_units:
        return f"precision bf16 on {p.description}, which has no bf16 units"
    return None


def _train_dtype_unsupported(cfg, p):
    prec = train_precision(cfg, p)
    if prec in p.compute_dtypes:
        return None
    return f"precision {prec} is not supported by {p.name} (supported: {', '.join(p.compute_dtypes)})"


def _sparse_ratio(cfg, p):
    s = cfg.engine.sparse_kv
    if s is not None and s.ratio < 0.2:
        return f"engine.sparse_kv.ratio = {s.ratio:g} keeps under 20% of the older tokens"
    return None


def _kv_unsupported(cfg, p):
    kv = serve_dtypes(cfg).get("engine.kv_cache_dtype")
    if kv and kv not in p.kv_cache_dtypes:
        return f"kv_cache_dtype {kv} is not supported on {p.name} (supported: {', '.join(p.kv_cache_dtypes)})"
    return None


def _weight_unsupported(cfg, p):
    w = serve_dtypes(cfg).get("engine.weight_dtype")
    if w and w not in p.weight_dtypes:
        return f"weight_dtype {w} is not supported on {p.name} (supported: {', '.join(p.weight_dtypes)})"
    return None


def _compute_unsupported(cfg, p):
    d = serve_dtypes(cfg).get("engine.dtype")
    if d and d not in p.compute_dtypes:
        return f"dtype {d} is not supported on {p.name} (supported: {', '.join(p.compute_dtypes)})"
    return None


def _serve_bf16_units(cfg, p):
    keys = [k for k, v in serve_dtypes(cfg).items() if v == "bf16"]
    if keys and "bf16" in p.compute_dtypes and not p.has_bf16_units:
        return f"{', '.join(keys)} = bf16 on {p.description}, which has no bf16 units"
    return None


def _kv_bf16_ascend(cfg, p):
    return "kv_cache_dtype bf16 on Ascend 910B" if serve_dtypes(cfg).get("engine.kv_cache_dtype") == "bf16" else None


def _page_alignment(cfg, p):
    ps = cfg.engine.page_size
    return f"engine.page_size = {ps} is not a multiple of {p.alignment}" if ps % p.alignment else None


def _open_without_auth(cfg, p):
    if cfg.host in _LOOPBACK or cfg.api_keys:
        return None
    return f"host {cfg.host} is reachable from the network and api_keys is empty"


def _short_timeout(cfg, p):
    t = cfg.request_timeout_s
    return f"request_timeout_s = {t:g} is under 30 s" if t < 30 else None


def _audit_content_without_log(cfg, p):
    return "audit_log_content is true but audit_log is not set" if cfg.audit_log_content and not cfg.audit_log else None


def _device_mismatch(cfg, p):
    kind = cfg.engine.device.split(":")[0]
    if kind not in ("auto", p.device):
        return f"engine.device = {cfg.engine.device} but the profile {p.name} is a {p.device} device"
    return None


def _hccl_whitelist(cfg, p):
    if cfg.world_size > 1 and cfg.env.get("HCCL_WHITELIST_DISABLE") != "1":
        return f"{cfg.world_size} devices communicate over HCCL but env.HCCL_WHITELIST_DISABLE is not 1"
    return None


def _rank_size(cfg, p):
    rank_size = cfg.env.get("RANK_SIZE")
    if rank_size is not None and rank_size != str(cfg.world_size):
        return f"env.RANK_SIZE = {rank_size} but tensor x data x pipeline parallel = {cfg.world_size}"
    return None


ASCEND_ONLY = {"ascend": "error", "*": None}
RULES: list[Rule] = [
    # training (the tutorial's LoRA and mixed-precision rules)
    Rule("lora-r-multiple-16", "train", "lora.r", ASCEND_ONLY,
         "the Ascend AI Core vector unit is 16 wide; other ranks pad and waste it (tutorial 3.4)",
         "set lora.r to a multiple of 16, e.g. 64", _lora_r),
    Rule("lora-alpha-ge-r", "train", "lora.alpha", {"ascend": "error", "*": "warning"},
         "alpha / r scales the adapter's update; below 1 it is too small in fp16 and gradients vanish (tutorial 3.4)",
         "set lora.alpha >= lora.r (the tutorial uses alpha = r = 64)", _lora_alpha),
    Rule("lora-dtype-float32", "train", "lora.dtype", {"ascend": "error", "*": "warning"},
         "fp16 adapter init draws values clustered near zero on Ascend and training stalls (tutorial 3.4); "
         "fp32 adapters are the stable default everywhere",
         "set lora.dtype: float32", _lora_dtype),
    Rule("lora-lr-max", "train", "optimizer.lr", {"*": "warning"},
         "LoRA learning rates above 3e-4 produce inf losses (tutorial 5.3)",
         "lower optimizer.lr to 2e-4", _lora_lr),
    Rule("fp16-grad-accum-max", "train", "gradient_accumulation_steps", ASCEND_ONLY,
         "fp16 gradient accumulation overflows past 4 steps on Ascend (tutorial 5.3)",
         "set gradient_accumulation_steps to 4 or less (the tutorial uses 2), or train in bf16", _fp16_accum),
    Rule("bf16-small-batch-ascend", "train", "precision", {"ascend": "warning", "*": None},
         "bf16 on 910B is reported stable only with batch_size >= 8 and seq_len <= 2048; smaller batches overflow "
         "the normalization statistics (tutorial 3.3, a field note)",
         "raise batch_size to 8 and keep max_seq_len <= 2048, or train in fp32", _bf16_small_batch),
    Rule("clip-norm-range", "train", "clip_norm", {"*": "warning"},
         "the tutorial found gradients vanish below clip_norm 0.8 and NaN often above 1.2 (tutorial 2.2)",
         "set clip_norm: 1.0", _clip_norm),
    Rule("pad-to-alignment", "train", "data.pad_to_multiple_of", {"ascend": "warning", "*": None},
         "Ascend AI Core kernels want tensor dims in multiples of 16 (tutorial 4.3)",
         "set data.pad_to_multiple_of: 16", _train_pad),
    Rule("train-bf16-no-units", "train", "precision", {"cpu": "warning", "*": None},
         "without AVX512-BF16 or AMX, bf16 matmuls are emulated and slower than fp32",
         "set precision: fp32 on this CPU", _train_bf16_units),
    Rule("train-dtype-unsupported", "train", "precision", {"*": "error"},
         "the device has no units for this precision; its operators reject such tensors",
         "pick a precision from the profile's compute_dtypes (fp16 on Ascend 310P)", _train_dtype_unsupported),
    # serving
    Rule("sparse-kv-ratio-min", "serve", "engine.sparse_kv.ratio", {"*": "warning"},
         "below 0.2 recall on long-document questions collapses (tutorial 3.2: F1 drops off a cliff)",
         "set engine.sparse_kv.ratio to 0.25", _sparse_ratio),
    Rule("kv-dtype-unsupported", "serve", "engine.kv_cache_dtype", {"*": "error"},
         "the device cannot store or compute with this cache dtype",
         "pick engine.kv_cache_dtype from the profile's kv_cache_dtypes (or auto)", _kv_unsupported),
    Rule("weight-dtype-unsupported", "serve", "engine.weight_dtype", {"*": "error"},
         "the device has no kernels for weights in this dtype",
         "pick engine.weight_dtype from the profile's weight_dtypes (or auto)", _weight_unsupported),
    Rule("dtype-unsupported", "serve", "engine.dtype", {"*": "error"},
         "the device has no units for this compute dtype (the 310P has no bf16)",
         "set engine.dtype to one of the profile's compute_dtypes (fp16 on Ascend 310P)", _compute_unsupported),
    Rule("bf16-no-units", "serve", "engine.dtype", {"cpu": "warning", "*": None},
         "without AVX512-BF16 or AMX, bf16 matmuls and conversions are emulated and slower than fp32",
         "use fp32 (engine.dtype: auto) on this CPU", _serve_bf16_units),
    Rule("kv-bf16-ascend", "serve", "engine.kv_cache_dtype", {"ascend-910b": "info", "*": None},
         "the tutorial measured bf16 KV 18% slower than fp16 on 910B (conversion cost; a field note)",
         "set engine.kv_cache_dtype: fp16", _kv_bf16_ascend),
    Rule("page-size-alignment", "serve", "engine.page_size", {"ascend": "warning", "nvidia": "warning", "*": None},
         "pages that are not a multiple of the device's tile size waste cache bandwidth (the tutorial uses 16)",
         "set engine.page_size: 16", _page_alignment),
    Rule("open-without-auth", "serve", "host", {"*": "warning"},
         "a server on a public interface without API keys answers anyone",
         "set api_keys (or MLC_API_KEY, comma-separated, in the server's environment), or bind host: 127.0.0.1",
         _open_without_auth),
    Rule("request-timeout-short", "serve", "request_timeout_s", {"*": "warning"},
         "long-context generations (16K context, 512 new tokens) take about 45 s; short timeouts return empty "
         "answers with status 200 (tutorial 5.4)",
         "set request_timeout_s to 120 or more", _short_timeout),
    Rule("audit-content-without-log", "serve", "audit_log_content", {"*": "warning"},
         "audit_log_content only adds prompts and completions to the audit log; without audit_log nothing is logged",
         "set audit_log to a JSONL path, or drop audit_log_content", _audit_content_without_log),
    Rule("device-profile-mismatch", "serve", "engine.device", {"*": "info"},
         "the checks assume the profile's device; the engine will run on the configured one",
         "set engine.device to the profile's device kind, or lint against the matching --hardware", _device_mismatch),
    # cluster
    Rule("hccl-whitelist", "cluster", "env.HCCL_WHITELIST_DISABLE", {"ascend": "warning", "*": None},
         "without HCCL_WHITELIST_DISABLE=1 multi-card AllReduce is slow or refused (tutorial 2.1, 5.5)",
         "add HCCL_WHITELIST_DISABLE: 1 to env", _hccl_whitelist),
    Rule("rank-size-mismatch", "cluster", "env.RANK_SIZE", {"*": "error"},
         "RANK_SIZE must equal the number of devices that train or serve together (tutorial 5.5)",
         "set env.RANK_SIZE to tensor x data x pipeline parallel, or drop it (deploy sets it)", _rank_size),
]


def severity_for(rule: Rule, profile: HardwareProfile) -> str | None:
    for key in (profile.name, profile.vendor, "*"):
        if key in rule.severity:
            return rule.severity[key]
    return None


def config_kind(config) -> str:
    from mlc.config.cluster_config import ClusterConfig
    from mlc.config.serve_config import ServeConfig

    if isinstance(config, ServeConfig):
        return "serve"
    if isinstance(config, ClusterConfig):
        return "cluster"
    return "train"


def default_profile(config) -> HardwareProfile:
    """The profile a config targets when none is named: the cluster's `hardware`, else by the device kind."""
    kind = config_kind(config)
    if kind == "cluster":
        return load_profile(config.hardware)
    device = (config.engine.device if kind == "serve" else getattr(config, "device", "cpu")).split(":")[0]
    return load_profile({"cuda": "nvidia-h200", "npu": "ascend-910b"}.get(device, "cpu"))


def lint(config, profile: HardwareProfile | None = None) -> list[Finding]:
    profile = profile or default_profile(config)
    kind = config_kind(config)
    findings = []
    for rule in RULES:
        severity = severity_for(rule, profile)
        if rule.kind != kind or severity is None:
            continue
        message = rule.check(config, profile)
        if message:
            findings.append(Finding(rule.id, severity, rule.key, message, rule.fix, rule.reason))
    return sorted(findings, key=lambda f: SEVERITIES.index(f.severity))


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
