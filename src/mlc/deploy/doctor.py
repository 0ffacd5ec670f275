"""`mlc-cli doctor`: checks of this host, the model store, a config, a prompt file and a training log; each
says what it found and how to fix it. A "fail" blocks (non-zero exit); a "warn" works but is worth fixing."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import stat
import sys
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from mlc.errors import MlcError

MIN_PYTHON = (3, 10)
MIN_TORCH = (2, 4)
MIN_TRANSFORMERS = (5, 2)
GIB = 2**30
# Visible on screen as nothing (or a plain space) but changes tokenization: format characters (Cf: U+200B..U+200F,
# U+2060, U+FEFF, bidi controls), controls other than tab/newline, line/paragraph separators.
_ALLOWED_CONTROLS = {"\t", "\n", "\r"}
_EXTRA_INVISIBLE = {"\u2028", "\u2029", "\u3164", "\u115f", "\u1160", "\uffa0"}
_ASCEND_NODES = ("davinci_manager", "devmm_svm", "hisi_hdc")


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str = ""
    items: list[str] = field(default_factory=list)  # per-finding lines (positions, files)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


# -- environment ------------------------------------------------------------------------------------------------
def check_python() -> Check:
    v = sys.version_info
    if (v.major, v.minor) < MIN_PYTHON:
        return Check("python", "fail", f"Python {v.major}.{v.minor} is older than 3.10", "install Python 3.10 or newer")
    return Check("python", "ok", f"Python {v.major}.{v.minor}.{v.micro} ({sys.executable})")


def check_packages() -> Check:
    try:
        import torch
        import transformers
    except ImportError as e:
        return Check("packages", "fail", f"cannot import {e.name}", "pip install -e '.[dev]' (or `make setup`)")
    problems = []
    if _version_tuple(torch.__version__) < MIN_TORCH:
        problems.append(f"torch {torch.__version__} < 2.4")
    if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:
        problems.append(f"transformers {transformers.__version__} < 5.2")
    detail = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if problems:
        return Check("packages", "fail", f"{detail}: {'; '.join(problems)}", "pip install -U 'torch>=2.4' 'transformers>=5.2'")
    return Check("packages", "ok", detail)


def check_cpu() -> Check:
    from mlc.config.hardware import detect_cpu

    cpu = detect_cpu()
    flags = ", ".join(cpu.cpu_flags) or "no AVX flags"
    if not cpu.has_bf16_units:
        return Check("cpu", "warn", f"{cpu.description}; {flags}; no bf16 units",
                     "serve and train in fp32 on this CPU (the default: dtype auto); bf16 is emulated and slower")
    return Check("cpu", "ok", f"{cpu.description}; {flags}")


def check_cuda() -> Check:
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        detail = "torch has no CUDA build" if built is None else f"torch built for CUDA {built} but sees no GPU"
        return Check("cuda", "skip", f"{detail}; the engine runs on the CPU",
                     "" if built is None else "check `nvidia-smi` and CUDA_VISIBLE_DEVICES")
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return Check("cuda", "ok", f"{len(names)} GPU(s): {', '.join(names)} (CUDA {torch.version.cuda})")


def ascend_device_nodes(dev_dir: Path = Path("/dev")) -> list[Path]:
    return sorted(dev_dir.glob("davinci[0-9]*")) + [dev_dir / n for n in _ASCEND_NODES]


def check_ascend(dev_dir: Path = Path("/dev")) -> Check:
    """On an Ascend host (any /dev/davinci*): the device nodes exist and this user may read and write them,
    and torch_npu is importable."""
    import importlib.util

    cards = sorted(dev_dir.glob("davinci[0-9]*"))
    has_npu_lib = importlib.util.find_spec("torch_npu") is not None
    if not cards and not (dev_dir / "davinci_manager").exists():
        if has_npu_lib:
            return Check("ascend", "fail", "torch_npu is installed but there is no /dev/davinci* device node",
                         "pass the devices into the container: --device=/dev/davinci0 --device=/dev/davinci_manager "
                         "--device=/dev/devmm_svm --device=/dev/hisi_hdc")
        return Check("ascend", "skip", "not an Ascend host (no /dev/davinci*)")
    items, bad, owner_only = [], False, False
    for node in ascend_device_nodes(dev_dir):
        if not node.exists():
            items.append(f"{node}: missing")
            bad = True
            continue
        mode = node.stat().st_mode
        ok = os.access(node, os.R_OK | os.W_OK)
        group_rw = mode & 0o060 == 0o060  # crw-rw----: what a non-root container user in the group needs
        note = "" if ok else " (no read/write access for this user)"
        note += "" if group_rw or not ok else " (owner only: users other than root will see 'No device found')"
        items.append(f"{node}: {stat.filemode(mode)}{note}")
        bad |= not ok
        owner_only |= ok and not group_rw
    fix = ("sudo chmod 660 /dev/davinci* /dev/davinci_manager /dev/devmm_svm /dev/hisi_hdc && "
           "sudo usermod -a -G HwHiAiUser $USER (the nodes' group), then log in again and restart docker")
    if bad:
        return Check("ascend", "fail", f"{len(cards)} NPU node(s), but some device nodes are missing or not accessible",
                     fix, items)
    if owner_only:
        return Check("ascend", "warn", f"{len(cards)} NPU node(s) accessible here, but only to their owner", fix, items)
    if not has_npu_lib:
        return Check("ascend", "warn", f"{len(cards)} NPU node(s) accessible but torch_npu is not installed",
                     "pip install torch_npu matching your torch and CANN versions; source set_env.sh of CANN", items)
    return Check("ascend", "ok", f"{len(cards)} NPU node(s) accessible; torch_npu installed", items=items)


def check_memory(mem: dict[str, int] | None = None) -> Check:
    from mlc.config.hardware import meminfo

    mem = mem if mem is not None else meminfo()
    avail = mem.get("MemAvailable")
    if avail is None:
        return Check("memory", "skip", "cannot read /proc/meminfo")
    detail = f"{avail / GIB:.1f} GiB available of {mem.get('MemTotal', 0) / GIB:.1f} GiB"
    if avail < 1 * GIB:
        return Check("memory", "fail", detail, "free memory: the default model with its KV cache needs about 1 GiB")
    if avail < 4 * GIB:
        return Check("memory", "warn", detail, "lower --kv-cache-memory or --max-batch-size, or free memory")
    return Check("memory", "ok", detail)


def check_disk(path: Path | None = None) -> Check:
    from mlc.config.paths import mlc_home

    path = Path(path or mlc_home())
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    detail = f"{free / GIB:.1f} GiB free at {probe} (model store {path})"
    if free < 1 * GIB:
        return Check("disk", "fail", detail, "free disk space or set MLC_HOME to a larger volume")
    if free < 10 * GIB:
        return Check("disk", "warn", detail, "GLM checkpoints need 20-1500 GB; set MLC_HOME to a larger volume")
    return Check("disk", "ok", detail)


def check_hf_offline(env: dict[str, str] | None = None) -> Check:
    env = dict(os.environ) if env is None else env
    value = env.get("HF_HUB_OFFLINE", "")
    if value.lower() in ("1", "true", "yes", "on"):
        return Check("hf offline", "ok", f"HF_HUB_OFFLINE={value}")
    return Check("hf offline", "warn", "HF_HUB_OFFLINE is not set: transformers may try the network and stall on "
                 "air-gapped hosts", "export HF_HUB_OFFLINE=1 (mlc reads models from its store and never needs the hub)")


def check_port(port: int, host: str = "127.0.0.1", required: bool = False) -> Check:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            status = "fail" if required else "warn"
            return Check("port", status, f"{host}:{port} is in use ({e.strerror})",
                         f"stop the process on it (`ss -ltnp | grep :{port}`) or serve with --port {port + 1}")
    return Check("port", "ok", f"{host}:{port} is free")


# -- model store ----------------------------------------------------------------------------------------------------
def check_store(names: list[str] | None = None) -> list[Check]:
    """sha256 and size of every file of each pulled model (or of `names`) against its manifest."""
    from mlc.models import store

    names = names if names is not None else store.pulled_names()
    if not names:
        return [Check("store", "warn", f"no model in the store ({store.models_dir()})",
                      "mlc-cli models pull smollm2-135m-instruct")]
    checks = []
    for name in names:
        try:
            files = store.verify(name)
        except MlcError as e:
            checks.append(Check(f"store: {name}", "fail", e.message, f"mlc-cli models pull {name} --force"))
            continue
        size = sum(int(f.get("size", 0)) for f in files.values())
        checks.append(Check(f"store: {name}", "ok", f"{len(files)} files, {size / 2**20:,.1f} MiB, sha256 verified"))
    return checks


# -- config ---------------------------------------------------------------------------------------------------------
def check_config(path: Path, hardware: str | None = None) -> Check:
    from mlc.config.hardware import load_profile
    from mlc.config.lint import default_profile, lint
    from mlc.config.loader import load_any

    try:
        kind, config = load_any(path)
        profile = load_profile(hardware) if hardware else default_profile(config)
    except MlcError as e:
        return Check("config", "fail", e.message, "fix the keys named above (`mlc-cli config init` writes a template)")
    findings = lint(config, profile)
    items = [f"{f.severity} {f.rule}: {f.message} (fix: {f.fix})" for f in findings]
    errors = sum(f.severity == "error" for f in findings)
    warnings = sum(f.severity == "warning" for f in findings)
    detail = f"{path}: valid {kind} config; {errors} error(s), {warnings} warning(s) against {profile.name}"
    status = "fail" if errors else "warn" if warnings else "ok"
    return Check("config", status, detail, "apply the fixes listed" if findings else "", items)


# -- prompt file ------------------------------------------------------------------------------------------------------
def invisible_characters(text: str) -> list[tuple[int, int, str]]:
    """(line, column, character) of each invisible character, 1-based."""
    found = []
    for line_no, line in enumerate(text.split("\n"), 1):
        for col, ch in enumerate(line, 1):
            if ch in _ALLOWED_CONTROLS:
                continue
            cat = unicodedata.category(ch)
            if cat == "Cf" or cat == "Cc" or ch in _EXTRA_INVISIBLE:
                found.append((line_no, col, ch))
    return found


def describe_char(ch: str) -> str:
    return f"U+{ord(ch):04X} {unicodedata.name(ch, 'CONTROL CHARACTER')}"


def check_prompt_file(path: Path, limit: int = 20) -> Check:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return Check("prompt file", "fail", f"{path} does not exist", "check the path")
    except UnicodeDecodeError as e:
        return Check("prompt file", "fail", f"{path} is not UTF-8 (byte {e.start})", "re-save it as UTF-8")
    found = invisible_characters(text)
    if not found:
        return Check("prompt file", "ok", f"{path}: {len(text)} characters, no invisible characters")
    items = [f"line {ln} col {col}: {describe_char(ch)}" for ln, col, ch in found[:limit]]
    if len(found) > limit:
        items.append(f"... and {len(found) - limit} more")
    kinds = sorted({f"U+{ord(ch):04X}" for _, _, ch in found})
    return Check("prompt file", "fail", f"{path}: {len(found)} invisible character(s) ({', '.join(kinds)}); "
                 "tokenizers cut or split prompts at them and answers come back empty",
                 "delete them at the positions listed (the server strips them unless strict_input: true); "
                 f"`grep -nP '[\\x{{200B}}-\\x{{200F}}\\x{{2060}}\\x{{FEFF}}]' {path}` shows the lines", items)


# -- training log --------------------------------------------------------------------------------------------------------
LOSS_KEYS = ("loss", "grad_norm", "eval_loss", "train_loss")


def _number(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)  # "nan", "inf" and "-inf" strings included (how train_log.jsonl writes them)
    except (TypeError, ValueError):
        return None


def check_train_log(path: Path, limit: int = 10) -> Check:
    path = Path(path)
    if path.is_dir():
        path = path / "train_log.jsonl"
    if not path.is_file():
        return Check("train log", "fail", f"{path} does not exist", "pass a run's output dir or its train_log.jsonl")
    bad, unreadable, records = [], 0, 0
    for line_no, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            unreadable += 1
            continue
        if not isinstance(record, dict):
            unreadable += 1
            continue
        records += 1
        for key in LOSS_KEYS:
            value = _number(record.get(key))
            if value is not None and not math.isfinite(value):
                bad.append(f"line {line_no} (step {record.get('step', '?')}): {key} = {record.get(key)}")
    if bad:
        shown = bad[:limit] + ([f"... and {len(bad) - limit} more"] if len(bad) > limit else [])
        return Check("train log", "fail", f"{path}: {len(bad)} non-finite loss/grad_norm value(s) in {records} records",
                     "check in order: lora.r a multiple of 16 (64), optimizer.lr <= 3e-4 (2e-4), "
                     "gradient_accumulation_steps <= 4 with fp16, clip_norm 1.0, bf16 batch_size >= 8; "
                     "then resume from the last finite checkpoint", shown)
    if records == 0:
        return Check("train log", "warn", f"{path}: no JSON records", "is this a train_log.jsonl?")
    extra = f"; {unreadable} unreadable line(s) (a killed run cuts its last line)" if unreadable else ""
    return Check("train log", "warn" if unreadable > 1 else "ok", f"{path}: {records} records, all losses finite{extra}")


# -- all together ----------------------------------------------------------------------------------------------------
@dataclass
class DoctorOptions:
    prompt_file: Path | None = None
    train_log: Path | None = None
    config: Path | None = None
    hardware: str | None = None
    port: int | None = None
    host: str = "127.0.0.1"
    models: list[str] | None = None  # None: every pulled model
    verify_store: bool = True


def run_doctor(opts: DoctorOptions) -> list[Check]:
    checks = [check_python(), check_packages(), check_cpu(), check_cuda(), check_ascend(), check_memory(),
              check_disk(), check_hf_offline(), check_port(opts.port or 8080, opts.host, required=opts.port is not None)]
    if opts.verify_store:
        checks += check_store(opts.models)
    if opts.config is not None:
        checks.append(check_config(opts.config, opts.hardware))
    if opts.prompt_file is not None:
        checks.append(check_prompt_file(opts.prompt_file))
    if opts.train_log is not None:
        checks.append(check_train_log(opts.train_log))
    return checks


def blocking(checks: list[Check]) -> bool:
    return any(c.status == "fail" for c in checks)
