"""The GPU report: what only a real GPU can show, in one command (``make gpu-report``).

The fake-CUDA harness of ``make test`` proves devices, dtypes and the path of
every step without a GPU; numbers, kernels, host syncs and memory need one.
On one GPU, in a few minutes, this module

1. reads the result of the ``gpu`` tests (``make gpu-report`` runs
   ``pytest -m gpu`` first and hands over its JUnit XML);
2. trains every strategy config at P=1 on the harness model
   (:class:`experiments.models.harness.ResNetLike`), with
   ``torch.cuda.set_sync_debug_mode("error")`` around forward and backward
   (a host sync in a hook raises), and compares the parameters with the
   same run on the CPU (float64);
3. counts the preconditioner's host reads on the factor steps (one each);
4. runs ResNet-32 (CIFAR shapes) side by side, the strategies taking turns
   step by step in this process: per strategy the median iteration and
   ``pre.step()`` time from CUDA events, and the peak memory of a run of it
   alone (``torch.cuda.max_memory_allocated``);

and writes ``results/gpu.md`` and ``results/gpu.csv``. ``--device cpu`` runs
the same code on the CPU (events become wall-clock times, no peak memory);
that is how the tests check the report itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dpkfac.plan.configs import kfac_configs
from experiments.bench import smoke

#: Strategy configs (dpkfac/plan/configs.py, conf/strategy/NAME.yaml) of the P=1 checks: all.
CHECKED = tuple(kfac_configs())
#: Strategy configs measured side by side on ResNet-32.
SIDE_BY_SIDE = ("none", "dp_kfac", "d_kfac", "kaisa_comm_opt", "grouped_auto")
#: The practical setting: factors every 10 steps, decompositions every 100.
FACTOR_EVERY, INV_EVERY = 10, 100


@dataclass
class Row:
    """One line of results/gpu.csv."""

    section: str
    name: str
    status: str
    detail: str = ""
    iteration_ms: float | None = None
    step_ms: float | None = None
    peak_mib: float | None = None
    max_rel_err: float | None = None


# ------------------------------------------------------------------ helpers
def preconditioner_kwargs_of(name: str, hardware: str) -> dict[str, Any] | None:
    """The preconditioner arguments of ``conf/strategy/<name>.yaml`` (None: first order).

    A strategy that would measure its hardware model at start-up gets the preset
    ``hardware`` instead: at P=1 nothing is received, so there is nothing to probe.
    """
    from experiments.config import compose_config
    from experiments.preconditioning import preconditioner_kwargs, with_schedules

    cfg = compose_config("benchmark", [f"strategy={name}"])
    kwargs = preconditioner_kwargs(cfg.strategy)
    if kwargs is None:
        return None
    if kwargs.get("hardware", "x") is None:
        kwargs["hardware"] = hardware
    return with_schedules(kwargs)


class Timer:
    """Elapsed milliseconds of a block: CUDA events on a GPU, the wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[Any, Any]] = []
        self.ms: list[float] = []

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.pending.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        self.ms.append((time.perf_counter() - t0) * 1e3)

    def resolve(self) -> list[float]:
        """Every timed block's milliseconds (waits for the device once, at the end)."""
        for start, end in self.pending:
            end.synchronize()
            self.ms.append(start.elapsed_time(end))
        self.pending = []
        return self.ms


@contextlib.contextmanager
def no_host_sync(device: torch.device) -> Iterator[None]:
    """Raise on any synchronising CUDA call in the block (a no-op on the CPU)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# ------------------------------------------------------------- P=1 checks
def train_harness(name: str, device: torch.device, steps: int = 4) -> tuple[dict, int, list[int]]:
    """Train the harness model with strategy config ``name``; hooks of steps >= 1 must not sync.

    Returns:
        The final parameters (on the CPU), the number of K-FAC layers and the
        host reads of each step after the first.
    """
    from dpkfac import KFACPreconditioner
    from experiments.models.harness import ResNetLike

    torch.manual_seed(0)
    model = ResNetLike().double().to(device)
    kwargs = preconditioner_kwargs_of(name, "cpu_gloo_local") or {}
    kwargs.update(kl_clip=0.01, inv_update_steps=2, lr=0.1)
    pre = KFACPreconditioner(model, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reads = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 3, 8, 8, generator=g, dtype=torch.float64).to(device)
        y = torch.randint(0, 5, (8,), generator=g).to(device)
        opt.zero_grad()
        with no_host_sync(device) if step > 0 else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        before = pre.host.reads
        pre.step()
        if step > 0:
            reads.append(pre.host.reads - before)
        opt.step()
    params = {n: p.detach().cpu() for n, p in model.named_parameters()}
    return params, len(pre.layers), reads


def check_strategies(device: torch.device, names: tuple[str, ...] = CHECKED) -> list[Row]:
    """Every strategy config at P=1 on ``device`` against the CPU."""
    rows = []
    for name in names:
        try:
            got, layers, reads = train_harness(name, device)
            ref, _, _ = train_harness(name, torch.device("cpu"))
            err = max(
                float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp(min=1e-30))
                for k in ref
            )
            ok = err < 1e-8
            detail = f"{layers} K-FAC layers; host reads per step after the first: {reads}"
            rows.append(Row("strategy", name, "ok" if ok else "MISMATCH", detail, max_rel_err=err))
        except Exception as err:  # every failure is a finding of the report
            rows.append(Row("strategy", name, "FAILED", f"{type(err).__name__}: {err}"[:300]))
    return rows


# ------------------------------------------------------------ side by side
def _resnet32_stepper(
    name: str, device: torch.device, batch: int
) -> tuple[Callable[[], None], Any]:
    """A ResNet-32 training step under strategy config ``name`` (a closure), its preconditioner."""
    from dpkfac import KFACPreconditioner
    from experiments.models.cifar_resnet import CIFARResNet

    torch.manual_seed(0)
    model = CIFARResNet(10, depth=32).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    kwargs = preconditioner_kwargs_of(name, "v100_ib100")
    pre = None
    if kwargs is not None:
        pre = KFACPreconditioner(
            model,
            **{**kwargs, "factor_update_steps": FACTOR_EVERY, "inv_update_steps": INV_EVERY},
        )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if pre is not None:
            pre.step()
        opt.step()

    return step, pre


def side_by_side(
    device: torch.device,
    names: tuple[str, ...] = SIDE_BY_SIDE,
    steps: int = 200,
    warmup: int = 5,
    batch: int = 128,
) -> list[Row]:
    """Median iteration per strategy, interleaved; peak memory of each run alone."""
    peaks: dict[str, float | None] = {}
    for name in names:  # alone, for the peak
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        step, _ = _resnet32_stepper(name, device, batch)
        for _ in range(3):
            step()
        peaks[name] = (
            torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
        )
        del step
    steppers = {name: _resnet32_stepper(name, device, batch) for name in names}
    timers = {name: Timer(device) for name in names}
    for i in range(warmup + steps):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            with timers[name]() if i >= warmup else contextlib.nullcontext():
                steppers[name][0]()
    medians = {name: statistics.median(timers[name].resolve()) for name in names}
    # The first-order baseline: the config without a preconditioner.
    base = next((name for name in names if steppers[name][1] is None), None)
    setup = f"batch {batch}, factors every {FACTOR_EVERY}, decompositions every {INV_EVERY}"
    rows = []
    for name, ms in medians.items():
        ratio = f"{ms / medians[base]:.2f}× {base}" if base and medians[base] else ""
        detail = f"{setup}, {steps} interleaved steps; {ratio}"
        rows.append(Row("resnet32", name, "ok", detail, iteration_ms=ms, peak_mib=peaks[name]))
    return rows


# ------------------------------------------------------------------ tests
def read_junit(path: Path | None) -> list[Row]:
    """The ``gpu`` tests' outcomes from pytest's JUnit XML (one row per test)."""
    if path is None or not path.exists():
        return [Row("tests", "pytest -m gpu", "NOT RUN", f"no JUnit XML at {path}")]
    labels = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}
    rows = []
    for case, outcome, message in smoke.junit_cases(path):
        rows.append(Row("tests", case.get("name", "?"), labels.get(outcome, "ok"), message[:300]))
    return rows


# ------------------------------------------------------------------ output
def write(rows: list[Row], out_dir: Path, device: torch.device) -> None:
    """``gpu.csv`` (every row) and ``gpu.md`` (a takeaway, then one table per section)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "gpu.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    bad = [r for r in rows if r.status not in ("ok", "skipped")]
    lines = [
        f"# GPU report ({name}, torch {torch.__version__})",
        "",
        f"{len(rows) - len(bad)} of {len(rows)} checks ok"
        + (f"; not ok: {', '.join(f'{r.section}/{r.name}' for r in bad)}." if bad else "."),
        "Generated by `make gpu-report` (experiments/bench/gpu_report.py).",
        "",
    ]
    for section, title in (
        ("tests", "`pytest -m gpu`"),
        ("strategy", "Every strategy at P=1 against the CPU (float64, harness model)"),
        ("resnet32", "ResNet-32, side by side (CUDA events; peak memory of each run alone)"),
    ):
        part = [r for r in rows if r.section == section]
        if not part:
            continue
        lines += [
            f"## {title}",
            "",
            "| name | status | iteration ms | peak MiB | max rel err | detail |",
            "|---|---|---|---|---|---|",
        ]
        for r in part:
            cells = [
                r.name,
                r.status,
                "" if r.iteration_ms is None else f"{r.iteration_ms:.2f}",
                "" if r.peak_mib is None else f"{r.peak_mib:.1f}",
                "" if r.max_rel_err is None else f"{r.max_rel_err:.1e}",
                r.detail.replace("|", "/"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    (out_dir / "gpu.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (to test)")
    parser.add_argument("--junit", type=Path, default=None, help="JUnit XML of pytest -m gpu")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--steps", type=int, default=200, help="side-by-side measured steps")
    parser.add_argument("--warmup", type=int, default=5, help="side-by-side untimed steps")
    parser.add_argument("--batch", type=int, default=128, help="ResNet-32 batch")
    parser.add_argument("--strategies", default=",".join(CHECKED))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "error: the GPU report needs a CUDA device and this machine has none; "
            "`make test` proves the GPU path on fake CUDA tensors without one",
            file=sys.stderr,
        )
        return 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the CPU comparison is in float64
    started = time.perf_counter()
    rows = read_junit(args.junit)
    rows += check_strategies(device, tuple(args.strategies.split(",")))
    rows += side_by_side(device, steps=args.steps, warmup=args.warmup, batch=args.batch)
    write(rows, args.out, device)
    print(f"wrote {args.out / 'gpu.md'} and gpu.csv in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
