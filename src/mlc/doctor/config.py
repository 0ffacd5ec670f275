"""Doctor check of a serve, lora or cluster YAML: it validates, then lints against a hardware profile."""

from __future__ import annotations

from pathlib import Path

from mlc.doctor.check import Check
from mlc.errors import MlcError


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
