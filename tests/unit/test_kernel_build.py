"""Building the C++ CPU kernels (`layers/cpu_kernels.py`): a failed build is remembered on the machine, so that
the next process, and every tensor-parallel worker, falls back at once instead of running the compiler again; a
change to what the build depends on (the sources, the flags, the compiler) tries again. `MLC_CPU_KERNELS=0` (or the
older `MLC_DECODE_KERNEL=0`) skips the build."""

from __future__ import annotations

import logging

import pytest
import torch

from mlc.layers import cpu_kernels as k


@pytest.fixture
def failing_build(tmp_path, monkeypatch):
    """A fresh $MLC_HOME where every build attempt fails with a compiler error; returns the attempts' arguments."""
    import torch.utils.cpp_extension as cpp

    attempts = []

    def load(**kwargs):
        attempts.append(kwargs)
        raise RuntimeError("ninja: build stopped\nint4_linear.cpp:12:3: error: 'v' was not declared in this scope")

    monkeypatch.setenv("MLC_HOME", str(tmp_path))
    monkeypatch.delenv("MLC_KERNEL_MARCH", raising=False)
    monkeypatch.setattr(cpp, "load", load)
    return attempts


def test_a_failed_build_is_remembered_and_not_retried(failing_build, caplog, tmp_path):
    with caplog.at_level(logging.WARNING, "mlc.layers"):
        assert k._build() is False
        assert k.build_failure() == "int4_linear.cpp:12:3: error: 'v' was not declared in this scope"
        assert k._build() is False and k._build() is False
    assert len(failing_build) == 1  # one compiler run on this machine, whatever the number of processes
    (attempt,) = failing_build
    build = k._build_dir()
    assert build.parent == tmp_path / "kernels" and build.name.startswith(f"cpu_kernels-torch{torch.__version__}-")
    assert attempt["name"] == "mlc_cpu_kernels" and attempt["build_directory"] == str(build)
    assert (build / k.FAILED).is_file()
    assert "failed to build on this machine earlier" in caplog.text and k.FAILED in caplog.text


def test_a_new_compiler_or_changed_sources_try_again(failing_build, monkeypatch):
    assert k._build() is False
    monkeypatch.setattr(k, "compiler", lambda: "/opt/newer/bin/g++")
    assert k.build_failure() is None
    assert k._build() is False and len(failing_build) == 2
    monkeypatch.setattr(k, "FLAGS", [*k.FLAGS, "-DNEW"])
    assert k.build_failure() is None


@pytest.mark.parametrize("name", ["MLC_CPU_KERNELS", "MLC_DECODE_KERNEL"])  # the second: the older name, still read
@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_the_environment_turns_the_kernels_off(name, value, monkeypatch):
    for var in ("MLC_CPU_KERNELS", "MLC_DECODE_KERNEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(name, value)
    monkeypatch.setattr(k, "_BUILT", [])  # this process's kernels forgotten: load() reads the environment again
    monkeypatch.setattr(k, "_LOADED", {})
    monkeypatch.setattr(k, "_build", lambda: pytest.fail("built although turned off"))
    assert k.kernels_off() and k.load() is False and k.cpu_op("decode_attention") is None
    assert k.kernel_status().startswith("torch ops (SDPA decode attention")


def test_the_new_name_wins_over_the_old_and_other_values_leave_the_kernels_on(monkeypatch):
    monkeypatch.setenv("MLC_DECODE_KERNEL", "0")
    monkeypatch.setenv("MLC_CPU_KERNELS", "1")
    assert not k.kernels_off()
    monkeypatch.delenv("MLC_DECODE_KERNEL")
    for value in ("1", "on", "yes", ""):
        monkeypatch.setenv("MLC_CPU_KERNELS", value)
        assert not k.kernels_off()
    monkeypatch.delenv("MLC_CPU_KERNELS")
    assert not k.kernels_off()
