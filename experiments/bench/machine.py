"""Which machine a row was measured on: the columns that tell two machines apart.

Its own module, importing nothing of the project, so that every writer of rows (the
benchmark's timing loop, the fidelity and scale-simulation tasks, convergence_scale)
can name its machine without importing the timing loop and what that imports.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any

import torch


def _cpuinfo(key: str) -> str:
    """The first ``key : value`` of ``/proc/cpuinfo`` ("" where it has none, or off Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return ""


def _lscpu_model() -> str:
    """lscpu's ``Model name`` (ARM kernels leave it out of ``/proc/cpuinfo``); "" without lscpu."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return next(
        (
            line.split(":", 1)[1].strip()
            for line in out.splitlines()
            if line.startswith("Model name")
        ),
        "",
    )


def cpu_model() -> str:
    """The CPU's model name: ``/proc/cpuinfo``, else lscpu, else what :mod:`platform` knows.

    :mod:`platform` often knows only the architecture (``x86_64``), which tells two
    machines apart no better than the host name of a VM; rows written before the
    model name was recorded say exactly that (:func:`experiments.bench.pages.machine_label`).
    """
    return _cpuinfo("model name") or _lscpu_model() or platform.processor() or platform.machine()


#: The CPU's vector extensions, widest first, by the ``/proc/cpuinfo`` flag that names them.
VECTOR_ISAS = (
    ("avx512f", "AVX-512"),
    ("avx2", "AVX2"),
    ("avx", "AVX"),
    ("sse4_2", "SSE4.2"),
    ("asimd", "NEON"),
    ("sve", "SVE"),
)


def cpu_isa() -> str:
    """The widest vector ISA the CPU offers (``AVX-512``), from its flags; "" where unknown.

    torch's CPU capability (``cpu_capability``) is what torch chose, which
    ``ATEN_CPU_CAPABILITY`` can lower below what the CPU offers; a row keeps both.
    """
    flags = set((_cpuinfo("flags") or _cpuinfo("Features")).split())
    return next((name for flag, name in VECTOR_ISAS if flag in flags), "")


def machine() -> dict[str, Any]:
    """Where a row was measured: the columns that tell two machines apart.

    A bitwise comparison holds on one machine only. The same code, data and seed
    trained the MNIST-1D MLP (P=4, SGD) to 0.6109, 0.6120 and 0.6124 test accuracy
    after one epoch with torch's AVX-512, AVX2 and scalar CPU kernels
    (``ATEN_CPU_CAPABILITY``), so a row names the CPU, its vector ISA and the kernels
    torch chose, not only the core count (the host name of a VM says nothing); and
    timings from two machines never share a table
    (:func:`experiments.bench.pages.one_machine`).
    """
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "cpu_isa": cpu_isa(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "host": socket.gethostname(),
    }
