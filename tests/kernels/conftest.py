"""The C kernel tests run against both builds of the kernels: the machine's native one (AVX-512
where the CPU has it) and the portable one (PAGODA_CPU_PORTABLE=1), so the code path of CPUs
without AVX-512 is tested on any x86 machine. Their modules use the `cpu_kernel_build` fixture."""

from __future__ import annotations

import platform

import pytest

BUILDS = ["native", "portable"] if platform.machine().lower() in ("x86_64", "amd64") else ["native"]


@pytest.fixture(params=BUILDS)
def cpu_kernel_build(request, monkeypatch):
    """The build of the C kernels this test calls."""
    monkeypatch.setenv("PAGODA_CPU_PORTABLE", "1" if request.param == "portable" else "0")
    return request.param
