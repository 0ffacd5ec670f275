"""Per-command translations of other tools' flags (used by `compat.py`).

serve: MindIE (`--device_id`, `--enable_paged_attention`, `--kv_cache_compression_ratio`; its other underscore
flags are generic) and vLLM (`--gpu-memory-utilization`, `--lora-modules`, `--tensor_parallel_size`; its plain
renames are click aliases of our options). preprocess: the tutorial's `preprocess.py`. train: MindFormers'
`run_mindformer.py`. A rule returns the tokens that replace the flag and what to print after `->`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from mlc.errors import ConfigError

TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


@dataclass(frozen=True)
class Rule:
    arity: str  # "one": takes a value; "bool": an optional true/false; "many": one or more values
    apply: Callable[[str | None], tuple[list[str], str]]


def parse_bool(flag: str, value: str) -> bool:
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise ConfigError(f"{flag}={value}: write true or false")


def _given(value: str | None) -> str:
    """The value of a "one" rule's flag: compat.py takes it (or refuses the flag) before applying the rule."""
    if value is None:
        raise ConfigError("the flag needs a value")
    return value


def _number(flag: str, value: str, kind=float):
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{flag} {value!r} is not a number") from None


# serve
def _device_id(value: str | None) -> tuple[list[str], str]:
    index = _number("--device_id", value or "", int)
    kind, why = _accelerator()
    device = "cpu" if kind is None else f"{kind}:{index}"
    return ["--device", device], f"--device {device}{why}"


def _accelerator() -> tuple[str | None, str]:
    from mlc.config.device import npu_available

    if npu_available():
        return "npu", ""
    import torch

    if torch.cuda.is_available():
        return "cuda", " (no Ascend NPU here; the CUDA GPU with that index)"
    return None, " (no NPU or CUDA device here, so the CPU)"


def _paged(value: str | None) -> tuple[list[str], str]:
    if value is not None and not parse_bool("--enable_paged_attention", value):
        raise ConfigError("paged attention cannot be turned off: mlc's KV cache is always paged (--page-size sets "
                          "the tokens per page); drop the flag")
    return [], "nothing to change: the KV cache is always paged (--page-size 16 tokens a page)"


def _memory_share(value: str | None) -> tuple[list[str], str]:
    share = _number("--gpu-memory-utilization", value or "")
    return ["--kv-cache-fraction", str(share)], (
        f"--kv-cache-fraction {share} (the share of the memory free after the weights load that the KV cache takes)")


def _loras(value: str | None) -> tuple[list[str], str]:
    tokens: list[str] = []
    for item in (value or "").split("\0"):
        if item.startswith("{"):
            try:
                spec = json.loads(item)
                item = f"{spec['name']}={spec['path']}"
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ConfigError(
                    f"--lora-modules {item!r}: write NAME=DIR or {{\"name\": ..., \"path\": ...}}") from None
        tokens += ["--lora", item]
    return tokens, " ".join(tokens)


def _tensor_parallel(value: str | None) -> tuple[list[str], str]:
    size = _number("--tensor_parallel_size", value or "", int)
    return ["--tensor-parallel-size", str(size)], f"--tensor-parallel-size {size}"


KV_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "auto": 16, "int8": 8, "int4": 4}
KV_SPELLINGS = ("--kv-cache-dtype", "--kv_cache_dtype", "--kv-dtype")
RATIO_SPELLINGS = ("--kv_cache_compression_ratio", "--kv-cache-compression-ratio")


def serve_prepass(rest: list[str], notes: list[str]) -> list[str]:
    """MindIE's `--kv_cache_compression_ratio R` with (or without) `--kv_cache_dtype D`: the KV dtype whose size is
    R of D's (fp16 when not given): 0.5 -> int8, 0.25 -> int4."""
    ratio, rest = _take(rest, RATIO_SPELLINGS)
    if ratio is None:
        return rest
    base, rest = _take(rest, KV_SPELLINGS)
    base_name = (base or "fp16").lower()
    if base_name not in KV_BITS:
        return rest + ["--kv-cache-dtype", base_name]  # click names the allowed dtypes
    bits = KV_BITS[base_name] * _number("--kv_cache_compression_ratio", ratio)
    target: str | None
    if math.isclose(bits, KV_BITS[base_name]):
        target = base_name
    else:
        target = next((n for n in ("fp16", "int8", "int4") if math.isclose(bits, KV_BITS[n])), None)
    if target is None:
        raise ConfigError(f"--kv_cache_compression_ratio {ratio}: the KV cache comes in fp16 (1.0), int8 (0.5) and "
                          f"int4 (0.25) of {base_name}'s size; use one of those ratios, or --kv-cache-dtype int8|int4")
    shown = f" (of {base_name})" if base else " (of fp16)"
    sizes = {"int8": " (8-bit KV, half of fp16's size)", "int4": " (4-bit KV, a quarter of fp16's size)"}
    notes.append(f"--kv_cache_compression_ratio {ratio}{shown} -> --kv-cache-dtype {target}{sizes.get(target, '')}")
    return rest + ["--kv-cache-dtype", target]


def _take(rest: list[str], spellings: tuple[str, ...]) -> tuple[str | None, list[str]]:
    """Remove every `--flag V` / `--flag=V` of `spellings`; the last value wins, as with click."""
    value, out, i = None, [], 0
    while i < len(rest):
        flag, eq, v = rest[i].partition("=")
        if flag in spellings:
            if not eq:
                if i + 1 >= len(rest):
                    raise ConfigError(f"{flag} needs a value")
                v, i = rest[i + 1], i + 1
            value = v
        else:
            out.append(rest[i])
        i += 1
    return value, out


SERVE: dict[str, Rule] = {
    **{f: Rule("one", _device_id) for f in ("--device_id", "--device-id")},
    **{f: Rule("bool", _paged) for f in ("--enable_paged_attention", "--enable-paged-attention", "--paged-attn",
                                         "--paged_attn", "--use_paged_attn", "--paged-attention")},
    "--gpu-memory-utilization": Rule("one", _memory_share),
    "--lora-modules": Rule("many", _loras),
    "--tensor_parallel_size": Rule("one", _tensor_parallel),
}


# preprocess (the tutorial's preprocess.py)
PREPROCESS: dict[str, Rule] = {
    "--input_file": Rule("one", lambda v: ([_given(v)], f"{v} (the input file is the first argument)")),
    "--output_file": Rule("one", lambda v: (["--out", _given(v)],
                                            f"--out {v} (a directory: the Arrow dataset + stats.json)")),
    "--tokenizer_path": Rule("one", lambda v: (["--model", _given(v)],
                                               f"--model {v} (a tokenizer-only directory is enough)")),
}


# train (MindFormers' run_mindformer.py)
def _assign(key: str, what: str = "") -> Callable[[str | None], tuple[list[str], str]]:
    def apply(value: str | None) -> tuple[list[str], str]:
        token = f"{key}={json.dumps(value)}"  # JSON is YAML: the value stays a string
        return [token], f"{key}={value}{what}"

    return apply


def _run_mode(value: str | None) -> tuple[list[str], str]:
    mode = (value or "").lower()
    if mode in ("train", "finetune"):
        return [], "nothing to change: mlc-cli train trains"
    others = {"eval": "mlc-cli eval --model MODEL --adapter RUN/adapter --data FILE",
              "predict": "mlc-cli generate --model MODEL --prompt TEXT (or serve it: mlc-cli serve MODEL --lora "
                         "name=RUN/adapter)"}
    raise ConfigError(f"--run_mode {value}: mlc-cli train only trains; " + (
        f"for {mode} use `{others[mode]}`" if mode in others else "use train or finetune"))


def _device_target(value: str | None) -> tuple[list[str], str]:
    kinds = {"ascend": "npu", "gpu": "cuda", "cpu": "cpu"}
    kind = kinds.get((value or "").lower())
    if kind is None:
        raise ConfigError(f"--device_target {value}: use Ascend, GPU or CPU (or device=npu|cuda|cpu)")
    return [f"device={kind}"], f"device={kind}"


def _parallel_flag(value: str | None) -> tuple[list[str], str]:
    return [], "nothing to change: the process count comes from parallel_config.data_parallel or --nproc"


TRAIN: dict[str, Rule] = {
    "--run_mode": Rule("one", _run_mode),
    "--device_target": Rule("one", _device_target),
    "--distribute": Rule("bool", _parallel_flag),
    "--use_parallel": Rule("bool", _parallel_flag),
    "--data_url": Rule("one", _assign("data.train", " (a JSONL file or a `mlc-cli preprocess` output dir)")),
    "--ckpt_url": Rule("one", _assign("model")),
    "--output_dir": Rule("one", _assign("output_dir")),
}

ENGINE = {flag: rule for flag, rule in SERVE.items() if rule.apply in (_device_id, _paged)}  # generate, chat
COMMAND_RULES: dict[str, dict[str, Rule]] = {"serve": SERVE, "generate": ENGINE, "chat": ENGINE,
                                             "preprocess": PREPROCESS, "train": TRAIN}
PREPASSES = {"serve": serve_prepass, "generate": serve_prepass, "chat": serve_prepass}
