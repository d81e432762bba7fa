"""Time the batch-factor kernels per ResNet-32 layer shape.

Run as ``python -m experiments.bench table=factor_kernels`` (``task=factor_kernels``,
with the ``factor_kernels`` node of ``conf/benchmark.yaml``: ``batch``, ``reps``,
``threads``).

For every distinct K-FAC layer shape of CIFAR ResNet-32 (shortcut option B, so
the 1×1 stride-2 projections are included; option A has the same layers
minus those three) at batch 32, float32, the batch A and G factors are built
with each method of ``factor_method`` (:mod:`dpkfac.curvature.factors`) plus
"unfold+tri" (im2col with the triangle-only product), methods interleaved
within every repetition (order rotated), median of ``reps`` repetitions.
Totals weight each shape by how many layers share it. Run for 1 and 2 torch
threads unless ``threads`` says otherwise. The report is printed and kept in
``results/factor_kernels.txt``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dpkfac.curvature.factors import a_factor
from dpkfac.curvature.modules import helper_for
from experiments.models.cifar_resnet import CIFARResNet

A_METHODS = ("unfold", "unfold+tri", "auto", "auto_bf16")
G_METHODS = ("unfold", "auto")


def layer_inputs(batch: int) -> list[tuple[str, nn.Module, torch.Tensor, torch.Tensor, int]]:
    """(shape key, module, input, output gradient, count) per distinct layer shape."""
    torch.manual_seed(0)
    model = CIFARResNet(10, depth=32, shortcut="B")
    seen: dict[str, list] = {}  # key -> [key, module, input, output gradient, count]

    def hook(module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        key = _key(module, args[0])
        if key in seen:
            seen[key][4] += 1
            return
        seen[key] = [key, module, args[0].detach().clone(), None, 1]
        output.register_hook(lambda g: seen[key].__setitem__(3, g.detach().clone()))

    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            module.register_forward_hook(hook)
    x = torch.randn(batch, 3, 32, 32)
    F.cross_entropy(model(x), torch.randint(0, 10, (batch,))).backward()
    return [tuple(entry) for entry in seen.values()]


def _key(module: nn.Module, x: torch.Tensor) -> str:
    if isinstance(module, nn.Linear):
        return f"linear {module.in_features}->{module.out_features}"
    k, s = module.kernel_size, module.stride
    return (
        f"conv {module.in_channels}->{module.out_channels} {x.shape[2]}x{x.shape[3]} "
        f"k{k[0]}x{k[1]} s{s[0]}"
    )


def _a_fn(module: nn.Module, x: torch.Tensor, method: str) -> Callable[[], object]:
    helper = helper_for(module)
    if method == "unfold+tri":
        return lambda: a_factor(helper.a_matrix(x), has_bias=helper.has_bias, triangle=True)
    return lambda: helper.a_factor(x, "expand", None, method)


def _g_fn(module: nn.Module, g: torch.Tensor, method: str) -> Callable[[], object]:
    helper = helper_for(module)
    return lambda: helper.g_factor(g, "expand", None, method)


def interleaved(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds per function, the functions alternated within each repetition."""
    for fn in fns.values():
        fn()  # warm-up (plan caches, allocator)
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run(
    threads: int, batch: int, reps: int, say: Callable[[str], object] = print
) -> dict[str, dict[str, float]]:
    """Time every layer shape with ``threads`` torch threads; ``say`` gets the report's lines."""
    torch.set_num_threads(threads)
    layers = layer_inputs(batch)
    say(f"\n== {threads} thread(s), batch {batch}, float32, median of {reps} (ms) ==")
    head = "".join(f"{m:>11}" for m in A_METHODS) + "".join(f"{'G ' + m:>11}" for m in G_METHODS)
    say(f"{'layer':<34}{'n':>3}{head}{'A unf/auto':>11}")
    totals = {f"A {m}": 0.0 for m in A_METHODS} | {f"G {m}": 0.0 for m in G_METHODS}
    for key, module, x, g, count in layers:
        with torch.no_grad():
            ta = interleaved({m: _a_fn(module, x, m) for m in A_METHODS}, reps)
            tg = interleaved({m: _g_fn(module, g, m) for m in G_METHODS}, reps)
        for side, times in (("A", ta), ("G", tg)):
            for m, seconds in times.items():
                totals[f"{side} {m}"] += count * seconds
        cells = "".join(f"{1e3 * ta[m]:>11.3f}" for m in A_METHODS)
        cells += "".join(f"{1e3 * tg[m]:>11.3f}" for m in G_METHODS)
        say(f"{key:<34}{count:>3}{cells}{ta['unfold'] / ta['auto']:>11.2f}")
    base = totals["A unfold"] + totals["G unfold"]
    say("totals over all layers (ms):")
    for k, v in totals.items():
        say(f"  {k:<16}{1e3 * v:>10.2f}")
    for a_m in ("unfold+tri", "auto", "auto_bf16"):
        both = totals[f"A {a_m}"] + totals["G auto"]
        say(
            f"  A+G {a_m:<10} {1e3 * both:>9.2f} ms vs unfold {1e3 * base:.2f} ms: "
            f"ratio {both / base:.3f} (speed-up {base / both:.2f}x)"
        )
    return {"totals": totals}


def run_factor_kernels(
    threads: Sequence[int] = (1, 2), batch: int = 32, reps: int = 7, out: Path | None = None
) -> dict[str, Path]:
    """:func:`run` for each thread count, printed and written to ``<out>/factor_kernels.txt``.

    Args:
        threads: Torch thread counts, one report each.
        batch: Examples per batch.
        reps: Repetitions (the median is reported).
        out: The results folder; None: print only.

    Returns:
        The file written (``{"txt": ...}``), if any.
    """
    lines: list[str] = []

    def say(line: str) -> None:
        print(line)
        lines.append(line)

    previous = torch.get_num_threads()
    try:
        for count in threads:
            run(int(count), int(batch), int(reps), say)
    finally:
        torch.set_num_threads(previous)
    if out is None:
        return {}
    path = Path(out) / "factor_kernels.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).lstrip("\n") + "\n")
    return {"txt": path}
