"""Shared fixtures: offline hub, and the default model pulled once into the real store."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEFAULT_MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def default_model_dir():
    """The default model's checkpoint dir in the real store (`mlc.config.paths.models_dir()`), pulled if absent."""
    from mlc.models.store import pull

    return pull(DEFAULT_MODEL).path


@pytest.fixture(scope="module")
def cpu_kernels():
    """The C++ CPU kernels, which must build wherever a C++ compiler is (a broken kernel fails, never skips): modules
    take it through `tests.support.kernel_marks.CPU_KERNELS`, which skips them on machines without a compiler."""
    from mlc.layers.cpu_kernels import build_failure, load

    assert load(), f"the C++ CPU kernels failed to build: {build_failure()}"

