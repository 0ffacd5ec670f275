"""Building the C++ CPU kernels (`layers/decode_kernel.py`): a failed build is remembered on the machine, so that
the next process, and every tensor-parallel worker, falls back at once instead of running the compiler again; a
change to what the build depends on (the sources, the flags, the compiler) tries again."""

from __future__ import annotations

import logging

import pytest

from mlc.layers import decode_kernel as k


@pytest.fixture
def failing_build(tmp_path, monkeypatch):
    """A fresh $MLC_HOME where every build attempt fails with a compiler error; returns the attempt count."""
    import torch.utils.cpp_extension as cpp

    attempts = []

    def load(**kwargs):
        attempts.append(kwargs["build_directory"])
        raise RuntimeError("ninja: build stopped\nint4_linear.cpp:12:3: error: 'v' was not declared in this scope")

    monkeypatch.setenv("MLC_HOME", str(tmp_path))
    monkeypatch.setattr(cpp, "load", load)
    return attempts


def test_a_failed_build_is_remembered_and_not_retried(failing_build, caplog):
    with caplog.at_level(logging.WARNING, "mlc.layers"):
        assert k._build() is None
        assert k.build_failure() == "int4_linear.cpp:12:3: error: 'v' was not declared in this scope"
        assert k._build() is None and k._build() is None
    assert len(failing_build) == 1  # one compiler run on this machine, whatever the number of processes
    assert "failed to build on this machine earlier" in caplog.text and k.FAILED in caplog.text


def test_a_new_compiler_or_changed_sources_try_again(failing_build, monkeypatch):
    assert k._build() is None
    monkeypatch.setattr(k, "compiler", lambda: "/opt/newer/bin/g++")
    assert k.build_failure() is None
    assert k._build() is None and len(failing_build) == 2
    monkeypatch.setattr(k, "FLAGS", [*k.FLAGS, "-DNEW"])
    assert k.build_failure() is None
