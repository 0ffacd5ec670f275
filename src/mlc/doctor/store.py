"""Doctor check of the model store: sha256 and size of every file of each pulled model against its manifest."""

from __future__ import annotations

from mlc.config.paths import models_dir
from mlc.doctor.check import Check
from mlc.errors import MlcError


def check_store(names: list[str] | None = None) -> list[Check]:
    """sha256 and size of every file of each pulled model (or of `names`) against its manifest."""
    from mlc.models.store.paths import pulled_names
    from mlc.models.store.verifying import verify

    names = names if names is not None else pulled_names()
    if not names:
        return [Check("store", "warn", f"no model in the store ({models_dir()})",
                      "mlc-cli models pull smollm2-135m-instruct")]
    checks = []
    for name in names:
        try:
            files = verify(name)
        except MlcError as e:
            checks.append(Check(f"store: {name}", "fail", e.message, f"mlc-cli models pull {name} --force"))
            continue
        size = sum(int(f.get("size", 0)) for f in files.values())
        checks.append(Check(f"store: {name}", "ok", f"{len(files)} files, {size / 2**20:,.1f} MiB, sha256 verified"))
    return checks
