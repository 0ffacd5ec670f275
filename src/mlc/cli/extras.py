"""Which optional extra (`pip install 'mlc[serve]'`) provides a module a command could not import."""

from __future__ import annotations

# top-level module -> the pyproject extra that installs it
EXTRA_OF = {
    "fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "prometheus_client": "serve", "httpx": "serve",
    "llguidance": "serve", "jsonschema": "serve", "lm_eval": "eval", "ray": "cluster",
    "peft": "train", "datasets": "train", "matplotlib": "train", "accelerate": "train", "modelscope": "modelscope",
    "modelscope_hub": "modelscope",
}


def missing_extra_message(error: ModuleNotFoundError) -> str | None:
    """"install `mlc[serve]`" for a module an extra provides; None for anything else (a bug: keep the traceback)."""
    module = (error.name or "").split(".")[0]
    extra = EXTRA_OF.get(module)
    if extra is None:
        return None
    return (f"this command needs the Python package {module!r}, part of the optional extra mlc[{extra}]: "
            f"install `mlc[{extra}]` (pip install 'mlc[{extra}]', or pip install -e '.[{extra}]' in a checkout)")
