"""`mlc-cli doctor`: checks of this host, the model store, a config, a prompt file and a training log; each
says what it found and how to fix it. A "fail" blocks (non-zero exit); a "warn" works but is worth fixing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlc.doctor.ascend import check_ascend
from mlc.doctor.check import Check
from mlc.doctor.config import check_config
from mlc.doctor.host import (
    check_cpu,
    check_cuda,
    check_disk,
    check_hf_offline,
    check_memory,
    check_packages,
    check_port,
    check_python,
)

# the prompt scan that callers of the doctor import from here
from mlc.doctor.prompt import (
    check_prompt_file,
    invisible_characters,  # noqa: F401 (re-exported)
)
from mlc.doctor.store import check_store
from mlc.doctor.train_log import check_train_log


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
              check_disk(), check_hf_offline(),
              check_port(opts.port or 8080, opts.host, required=opts.port is not None)]
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
