"""Marks for the tests of the C++ CPU kernels: skipped only where no C++ compiler is (or the kernels are turned off);
where a compiler is, a failed build fails them (the `cpu_kernels` fixture in conftest.py)."""

from __future__ import annotations

import pytest

from mlc.layers.cpu_kernels import compiler, kernels_off

CPU_KERNELS = [pytest.mark.skipif(compiler() is None or kernels_off(),
                                  reason="no C++ compiler (or MLC_CPU_KERNELS=0): torch's ops serve"),
               pytest.mark.usefixtures("cpu_kernels")]


def needs_cpu_kernels(test):
    """`CPU_KERNELS` on one test of a module whose other tests run without the kernels."""
    for mark in reversed(CPU_KERNELS):
        test = mark(test)
    return test
