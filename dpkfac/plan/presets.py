"""Hardware presets: the papers' cluster (estimates with sources) and this machine (measured).

``v100_ib100`` stands for the DP-KFAC/SPD-KFAC testbed: 64 GPUs, 16 nodes
of 4 V100-class GPUs, 100 Gb/s InfiniBand between nodes. Every number is an
*estimate* from public specifications and typical achieved fractions; none
was measured on that cluster:

* **Network bandwidth.** 100 Gb/s EDR InfiniBand is 12.5 GB/s of line rate
  per port (Mellanox/NVIDIA ConnectX-5 EDR product brief). NCCL reaches
  about 80-90% of it; nccl-tests report "bus bandwidth" (busbw), defined so
  that it is independent of the rank count: ``busbw = algbw·2(P-1)/P`` for
  all-reduce, ``= algbw`` for broadcast/reduce (NVIDIA nccl-tests,
  doc/PERFORMANCE.md). Our beta is seconds per *wire* byte, which is exactly
  ``1/busbw``; we take busbw = 10 GB/s (80% of line rate). With 4 GPUs per
  node behind one NIC, the ring crosses every NIC once in each direction,
  so the NIC, not NVLink/PCIe inside the node, bounds the bus bandwidth.
* **Network latency.** An IB verbs round trip is a few microseconds, but a
  NCCL collective's start-up is dominated by kernel launch and the
  algorithm's steps: a few tens of microseconds for small all-reduces at
  tens of GPUs (nccl-tests small-message times; NCCL's tree algorithm makes
  it grow about like log2 P). We take 15 us + 6 us·log2 P for all-reduce
  (51 us at P = 64) and 10 us + 6 us·log2 P for broadcast and reduce.
* **Matmul.** V100 SXM2: 15.7 TFLOP/s fp32 peak, V100 PCIe: 14 TFLOP/s
  (NVIDIA Tesla V100 datasheet). cuBLAS SGEMM on large matrices reaches
  about 85-90% of peak; K-FAC's factor products (``aᵀa`` with a tall ``a``)
  and the small preconditioning matmuls less, so we take 10 TFLOP/s with
  10 us per kernel (launch plus Python). Forward/backward of convolutions
  and attention through cuDNN/cuBLAS: 7 TFLOP/s (an estimate: mixed kernels,
  memory-bound normalisations and activations are not counted in the flops).
* **Memory-bound copies** of factor construction (im2col, reshapes,
  scaling; see :mod:`dpkfac.costmodel.timing`): V100 HBM2 is 900 GB/s
  peak (datasheet); strided copies reach less, so we take 500 GB/s.
* **Eigendecomposition.** cuSOLVER's ``syevd`` (behind ``torch.linalg.eigh``)
  is a small fraction of matmul speed: the tridiagonal reduction is
  memory-bound and part of it runs on the host. We take an effective
  1 TFLOP/s on ``9 d³`` flops plus 1 ms per call (a ``d = 4096`` factor
  then takes about 0.6 s, a ``d = 64`` one about 1 ms, of the order reported
  for eigh-based K-FAC on V100s by KAISA, Pauloski et al., SC'21).
* **Inverse.** Cholesky plus ``cholesky_inverse`` (``2 d³`` flops) at an
  effective 3 TFLOP/s plus 0.2 ms per call.

``cpu_gloo_local`` was fitted on this machine by
:func:`dpkfac.costmodel.calibration.calibrate_local` (two gloo ranks on
localhost, one thread each); regenerate it with
``python -m dpkfac.costmodel calibrate --out cpu.json``.
"""

from __future__ import annotations

from pathlib import Path

from dpkfac.plan.hardware import Engine, Hardware, Link

__all__ = ["PRESETS", "check_hardware_option", "device_preset", "hardware_option"]

_IB_BETA = 1.0 / 10e9  # s per wire byte: 10 GB/s bus bandwidth (80% of EDR's 12.5 GB/s)

V100_IB100 = Hardware(
    name="v100_ib100",
    links={
        "allreduce": Link(alpha=15e-6, beta=_IB_BETA, alpha_log2p=6e-6),
        "broadcast": Link(alpha=10e-6, beta=_IB_BETA, alpha_log2p=6e-6),
        "reduce": Link(alpha=10e-6, beta=_IB_BETA, alpha_log2p=6e-6),
        # Ring reduce-scatter and all-gather: each half of a ring all-reduce, priced per wire
        # byte like the rooted kinds (estimates, as the other links).
        "reduce_scatter": Link(alpha=10e-6, beta=_IB_BETA, alpha_log2p=6e-6),
        "all_gather": Link(alpha=10e-6, beta=_IB_BETA, alpha_log2p=6e-6),
    },
    engines={
        "matmul": Engine(rate=10e12, latency=10e-6),
        "forward_backward": Engine(rate=7e12, latency=20e-6),
        "memory": Engine(rate=500e9),
        "eigh": Engine(rate=1e12, latency=1e-3),
        "inverse": Engine(rate=3e12, latency=0.2e-3),
    },
    sources=(
        "estimates: the rates and latencies above, order of magnitude for a V100 node",
        "NVIDIA Tesla V100 GPU datasheet: 15.7 TFLOP/s fp32 (SXM2), 14 TFLOP/s (PCIe)",
        "Mellanox ConnectX-5 EDR InfiniBand: 100 Gb/s = 12.5 GB/s per port",
        "NVIDIA nccl-tests doc/PERFORMANCE.md: bus bandwidth = algbw*2(n-1)/n for all-reduce",
    ),
)

# Fitted by calibrate_local(world_size=2, threads=1) (rounded to 3 digits); the
# fit's error per sample is within about 25% for compute kinds and up to about
# 60% for mid-sized gloo collectives, whose time is not linear in the size
# (gloo switches algorithms). Two runs on this 2-vCPU VM agreed within 30%.
CPU_GLOO_LOCAL = Hardware(
    name="cpu_gloo_local",
    links={
        "allreduce": Link(alpha=0.00028, beta=5.63e-10),
        "broadcast": Link(alpha=9.63e-05, beta=6.3e-10),
        "reduce": Link(alpha=0.000205, beta=1.03e-09),
        # measure_collectives(2) on this VM, 2026-12-06: the reduce-scatter and the
        # all-gather as the communicator runs them on gloo (alltoallv), each fitted
        # alone with the other links fixed, the median of 3 to 5 runs.
        "reduce_scatter": Link(alpha=0.000197, beta=5.93e-10),
        "all_gather": Link(alpha=0.000183, beta=5.81e-10),
    },
    engines={
        "eigh": Engine(rate=3.24e10, latency=0.000171),
        "factor": Engine(rate=7.23e10, latency=2.4e-05),
        "forward_backward": Engine(rate=5.69e10, latency=0.000162),
        "inverse": Engine(rate=3.01e10, latency=0.000117),
        "memory": Engine(rate=6.13e09, latency=0),
        # unpack_triangle (an index_select) timed by measure_compute at d = 65..1025.
        "unpack": Engine(rate=6.8e09, latency=3e-06),
        "precondition": Engine(rate=7.38e10, latency=2.54e-05),
        "matmul": Engine(rate=7.23e10, latency=2.4e-05),
    },
    sources=(
        "dpkfac.costmodel.calibrate_local(world_size=2, threads=1) on vm "
        "(2 CPUs, torch 2.14.1+cu130), 2026-11-29",
        "fitted by dpkfac.costmodel.calibrate (non-negative least squares, relative error)",
    ),
    # Micro-benchmarks cannot observe overlap: fitted (dpkfac.costmodel.fitting.
    # fit_overlap) to spd_kfac's factor wait in the scaling table's 2-rank rows.
    overlap=0.9,
    backend="gloo",
)

#: Hardware presets by name.
PRESETS: dict[str, Hardware] = {hw.name: hw for hw in (V100_IB100, CPU_GLOO_LOCAL)}


def device_preset(device_type: str) -> Hardware:
    """The preset whose engines stand for a device of ``device_type`` where nothing was
    measured: a datacenter GPU's for ``cuda``, this project's CPU machine's otherwise."""
    return V100_IB100 if device_type == "cuda" else CPU_GLOO_LOCAL


def check_hardware_option(value: object) -> None:
    """Validate a strategy's ``hardware=`` option: a preset name, a JSON file, a model or None.

    Raises:
        ValueError: a string that is neither a preset nor an existing file.
    """
    if isinstance(value, str) and value not in PRESETS and not Path(value).is_file():
        raise ValueError(
            f"unknown hardware {value!r}: neither a preset ({', '.join(PRESETS)}) "
            "nor an existing JSON file"
        )


def hardware_option(value: str | Hardware | None) -> Hardware | None:
    """The model a ``hardware=`` option names (None stays None: measured at start-up)."""
    if not isinstance(value, str):
        return value
    return PRESETS.get(value) or Hardware.from_json(value)
