"""Builds of the C++ CPU kernels in a child process (`layers/cpu_kernels.py`): every -march code path gives the
native build's bits, and a stale build lock left by a killed first build is removed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support import kernel_inputs
from tests.support.kernel_inputs import cross_arch_outputs
from tests.support.kernel_marks import CPU_KERNELS

pytestmark = CPU_KERNELS

CROSS_ARCH = """
import runpy, torch
cross_arch_outputs = runpy.run_path({helpers!r})["cross_arch_outputs"]
torch.save(cross_arch_outputs(), {out!r})
"""


@pytest.mark.slow
@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x86 code paths")
@pytest.mark.parametrize("arch", ["haswell", "x86-64"], ids=["avx2", "plain-cpp"])
def test_every_code_path_gives_the_native_results(arch, tmp_path):
    """The AVX-512 VNNI, AVX2 and plain C++ paths sum the same integers and fold them in the same order: a model
    gives the same tokens whichever CPU it runs on. Each arch is a separate build (about a minute)."""
    out = tmp_path / "outputs.pt"
    code = CROSS_ARCH.format(helpers=kernel_inputs.__file__, out=str(out))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "MLC_KERNEL_MARCH": arch})
    assert run.returncode == 0, run.stderr[-2000:]
    theirs, ours = torch.load(out), cross_arch_outputs()
    assert theirs.keys() == ours.keys()
    for name in ours:
        assert torch.equal(theirs[name], ours[name]), name


def test_a_stale_build_lock_is_removed(tmp_path):
    """A first build killed midway leaves torch's lock file behind, and torch would wait on it forever."""
    code = ("import os, time, mlc.layers.cpu_kernels as k\n"
            "build = k._build_dir()\n"
            "build.mkdir(parents=True); (build / 'lock').touch(); old = time.time() - 3600\n"
            "os.utime(build / 'lock', (old, old)); print(k.kernel_status())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MLC_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert (out.stdout.strip().startswith("C++ kernels (paged decode attention")
            and "removing the stale build lock" in out.stderr)
