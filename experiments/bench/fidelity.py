"""Curvature fidelity over short training runs: ``python -m experiments.bench table=fidelity``.

DP-KFAC builds each layer's factors from its owner's local batch (1/P of the
global one). The preconditioner's fidelity probe (``strategy.fidelity_every``,
``dpkfac/fidelity.py``) compares, on the owner, the averaged gradient
preconditioned with those local factors against the one preconditioned with the
factors averaged over all ranks. :func:`run_fidelity` trains, through the
training entry point (``torchrun -m experiments.train``, gloo on CPU), a short
digits_cnn run and a short ResNet-20 run on fake CIFAR-10 images (random
pixels), with the probe on, records what the trainer logs
(``fidelity/<layer>/cosine`` and ``.../rel_error``) through
:class:`RecordingLogger`, and writes

* ``results/fidelity.csv``: ``run, world_size, strategy, step, layer, cosine, rel_error``
  (``step``: optimizer steps done, the W&B step the trainer logs at; the probe
  ran in the last of them);
* ``results/fidelity.png``: cosine and relative error per layer over the steps;
* ``results/fidelity.md``: per run and layer, the cosine's mean and worst over the
  steps and the mean relative error, under a takeaway computed from them
  (:func:`write_markdown`; ``python -m experiments.bench.fidelity`` rewrites
  it and the figure from the CSV).

The ``table=fidelity`` preset (``task=fidelity``) calls it with the ``fidelity``
node of ``conf/benchmark.yaml`` and the job's ``world_size`` (ranks per run: two,
as one rank is trivially exact), strategy config and ``results_dir``. A few
minutes on two CPU cores.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiments.bench.launch import free_port
from experiments.bench.machine import machine
from experiments.loggers import NullLogger

REPO = Path(__file__).resolve().parents[2]
RECORD = "fidelity.jsonl"
FIELDS = (
    *("run", "world_size", "strategy", "step", "layer", "cosine", "rel_error"),
    # Where it ran (experiments.bench.machine.machine): the page names the machine.
    *("cpus", "cpu", "cpu_isa", "cpu_capability", "torch", "time"),
)

#: The runs: name -> training overrides (the probe's own settings are added).
RUNS: dict[str, list[str]] = {
    "digits_cnn": ["experiment=digits_cnn", "data.batch_size=32"],
    "resnet20_fake_cifar": [
        "experiment=cifar10_resnet32",
        "model.depth=20",
        "data.fake=true",
        "data.batch_size=16",
        "data.eval_batch_size=64",
        "data.num_workers=0",
        "data.augment=false",
        # Decompositions every 4 steps keep ResNet-20 on a CPU within a minute or two.
        "strategy.inv_update_steps=4",
        "strategy.fidelity_layers=[conv1,layers.0.conv1,layers.3.conv1,layers.6.conv1,layers.8.conv2,fc]",
    ],
}


class RecordingLogger(NullLogger):
    """A logger that appends the fidelity metrics it is given to ``<dir>/fidelity.jsonl``.

    Takes (and ignores) every other argument of the ``logger`` config node, so it
    replaces W&B with ``logger._target_=experiments.bench.fidelity.RecordingLogger``.
    """

    record = RECORD

    def __init__(self, dir: str | Path | None = None, **_: Any) -> None:
        self.path = Path(dir or ".") / self.record
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def lines(self, metrics: Mapping[str, float], step: int) -> list[dict[str, Any]]:
        """One line per layer with fidelity values in ``metrics``."""
        rows: dict[str, dict[str, Any]] = {}
        for key, value in metrics.items():
            if key.startswith("fidelity/"):
                layer, _, name = key.removeprefix("fidelity/").rpartition("/")
                rows.setdefault(layer, {"step": step, "layer": layer})[name] = float(value)
        return list(rows.values())

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if lines := self.lines(metrics, step):
            with self.path.open("a") as f:
                f.writelines(json.dumps(line) + "\n" for line in lines)


def train_run(
    name: str,
    overrides: Sequence[str],
    *,
    nproc: int,
    steps: int,
    every: int,
    strategy: str,
    out: Path,
    timeout: float,
) -> list[dict[str, Any]]:
    """One probed training run under torchrun; returns its CSV rows."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "-m",
        "experiments.train",
        *overrides,
        f"strategy={strategy}",
        f"strategy.fidelity_every={every}",
        f"trainer.max_steps={steps}",
        "trainer.progress_bar=false",
        "trainer.checkpoint_every_steps=null",
        "trainer.resume=null",
        "trainer.check_replicas=true",
        "logger._target_=experiments.bench.fidelity.RecordingLogger",
        f"hydra.run.dir={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    started = time.perf_counter()
    proc = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        raise RuntimeError(f"run {name!r} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"{name}: {steps} steps on {nproc} rank(s) in {time.perf_counter() - started:.0f} s")
    run = {"run": name, "world_size": nproc, "strategy": strategy, **machine()}
    run["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return [run | json.loads(line) for line in (out / RECORD).read_text().splitlines()]


def write_csv(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        # Rows from before the machine was recorded have no machine columns.
        writer.writerows({k: row.get(k, "") for k in FIELDS} for row in rows)


def figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """Cosine and relative error per layer over steps, one row of panels per run.

    Lines are layers, coloured by depth (``plasma``, input to output, in the
    order the probe first reports them), not by strategy config: the run's
    strategy is in the titles. Each run's layers are listed once, right of its row.

    Args:
        rows: CSV rows (``FIELDS``), e.g. ``pandas.read_csv(...).to_dict("records")``.

    Returns:
        The matplotlib figure.
    """
    import matplotlib
    from matplotlib.figure import Figure

    runs = list(dict.fromkeys(r["run"] for r in rows))
    fig = Figure(figsize=(13, 3.6 * len(runs)), layout="constrained")
    axes = fig.subplots(len(runs), 2, squeeze=False)
    depth = matplotlib.colormaps["plasma"]
    for (ax_cos, ax_err), run in zip(axes, runs, strict=True):
        mine = [r for r in rows if r["run"] == run]
        layers = list(dict.fromkeys(r["layer"] for r in mine))
        for k, layer in enumerate(layers):
            points = sorted((int(r["step"]), r) for r in mine if r["layer"] == layer)
            steps = [s for s, _ in points]
            color = depth(0.85 * k / max(len(layers) - 1, 1))
            style = {"marker": ".", "color": color, "label": layer}
            ax_cos.plot(steps, [float(r["cosine"]) for _, r in points], **style)
            ax_err.plot(steps, [float(r["rel_error"]) for _, r in points], **style)
        p, strategy = mine[0]["world_size"], mine[0]["strategy"]
        ax_cos.set_title(f"{run} ({strategy}, P={p}): cosine(local, all-ranks update)")
        ax_err.set_title(f"{run} ({strategy}, P={p}): ‖local − all‖ / ‖all‖")
        ax_err.set_yscale("log")
        for ax in (ax_cos, ax_err):
            ax.set_xlabel("optimizer step")
            ax.grid(alpha=0.3)
        ax_err.legend(
            fontsize=8, title=f"{run} layer", loc="upper left", bbox_to_anchor=(1.02, 1.0)
        )
    return fig


def plot_and_summarise(rows: Sequence[Mapping[str, Any]], out: Path) -> Path:
    """Write :func:`figure` to ``<out>/fidelity.png`` and :func:`write_markdown`'s table."""
    from experiments.bench import plots

    plots.save(figure(rows), out / "fidelity.png")
    return write_markdown(rows, out / "fidelity.md")


def run_fidelity(
    runs: Sequence[str],
    steps: Mapping[str, int],
    *,
    nproc: int = 2,
    every: int = 2,
    strategy: str = "dp_kfac",
    out: Path = REPO / "results",
    timeout: float = 600.0,
) -> dict[str, Path]:
    """Train the probed ``runs`` and write ``<out>/fidelity.{csv,png,md}``.

    Args:
        runs: Names of :data:`RUNS` to train, in order.
        steps: Optimizer steps of each run, by name.
        nproc: Ranks per run.
        every: The probe's interval (``strategy.fidelity_every``).
        strategy: The strategy config the runs train with.
        out: The results folder.
        timeout: Seconds per run.

    Returns:
        The files written: ``{"csv": ..., "png": ..., "md": ...}``.
    """
    shared = {"nproc": nproc, "every": every, "strategy": strategy, "timeout": timeout}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dpkfac-fidelity-") as tmp:
        for name in runs:
            out_dir = Path(tmp) / name
            rows += train_run(name, RUNS[name], steps=int(steps[name]), out=out_dir, **shared)
    paths = {"csv": out / "fidelity.csv", "png": out / "fidelity.png", "md": out / "fidelity.md"}
    write_csv(rows, paths["csv"])
    plot_and_summarise(rows, out)
    print(f"wrote {paths['csv']} ({len(rows)} rows), {paths['png']} and {paths['md']}")
    return paths


def layer_summary(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per run and layer (in the order the probe reported them): the cosine's mean and
    minimum over the probed steps, the mean relative error and the number of probes."""
    import pandas as pd

    frame = pd.DataFrame(list(rows)).astype(
        {"world_size": int, "strategy": str, "cosine": float, "rel_error": float}
    )
    summary = frame.groupby(["run", "layer"], sort=False).agg(
        world_size=("world_size", "first"),
        strategy=("strategy", "first"),
        cosine_mean=("cosine", "mean"),
        cosine_min=("cosine", "min"),
        rel_error_mean=("rel_error", "mean"),
        probes=("cosine", "size"),
    )
    return summary.reset_index().to_dict("records")


def takeaway(summary: Sequence[Mapping[str, Any]]) -> list[str]:
    """Two lines from :func:`layer_summary`: the spread of fidelity and its least faithful layer."""
    if not summary:
        return []
    worst = min(summary, key=lambda r: r["cosine_mean"])
    means = [r["cosine_mean"] for r in summary]
    faithful = sum(m >= 0.99 for m in means)
    p = "/".join(dict.fromkeys(str(r["world_size"]) for r in summary))
    low = [f"`{r['layer']}` ({r['run']})" for r in summary if r["cosine_mean"] < 0.9]
    return [
        f"**Takeaway.** At P={p}, the update an owner builds from its own batch's factors has a "
        f"mean cosine of {min(means):.3f}–{max(means):.3f} to the one built from all ranks' "
        f"factors ({len(summary)} layers of {len(dict.fromkeys(r['run'] for r in summary))} runs); "
        f"{faithful} of them stay at 0.99 or above.",
        f"Local curvature costs most at {worst['run']}'s `{worst['layer']}` (mean cosine "
        f"{worst['cosine_mean']:.3f}, worst {worst['cosine_min']:.3f}, relative error "
        f"{worst['rel_error_mean']:.2f}); below 0.9: {', '.join(low) or 'none'}.",
    ]


def write_markdown(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``results/fidelity.md``: the per-layer summary under its computed takeaway and figure."""
    import pandas as pd

    from experiments.bench.pages import machine_line, page, write_page

    summary = layer_summary(rows)
    table = [
        "| run | P | strategy | layer | mean cosine | worst cosine | mean rel. error | probes |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]
    table += [
        f"| {r['run']} | {r['world_size']} | {r['strategy']} | `{r['layer']}` | "
        f"{r['cosine_mean']:.3f} | {r['cosine_min']:.3f} | {r['rel_error_mean']:.3f} | "
        f"{r['probes']} |"
        for r in summary
    ]
    method = [
        "The probe (`strategy.fidelity_every`) compares, on each layer's owner, the averaged",
        "gradient preconditioned with the owner's local factors (DP-KFAC) against the one",
        "preconditioned with factors averaged over all ranks (D-KFAC), on the same step.",
        "Cosine 1 and relative error 0 mean local curvature costs nothing. `resnet20_fake_cifar`",
        "trains on random pixels (no download here): it shows the mechanism, not CIFAR-10's",
        "numbers. Per step: `fidelity.csv`; the figure draws every probe, so its spread over",
        "the steps is the figure itself.",
    ]
    answer = [*takeaway(summary), machine_line(pd.DataFrame(list(rows)))]
    lines = page(
        "Curvature fidelity: what one rank's batch costs DP-KFAC",
        answer,
        table,
        method,
        path.with_suffix(".png").name,
    )
    return write_page(path, lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Rewrite ``fidelity.md`` and ``fidelity.png`` from a saved ``fidelity.csv``."""
    import argparse

    parser = argparse.ArgumentParser(description="Rewrite the fidelity table from its CSV.")
    parser.add_argument("--results", type=Path, default=REPO / "results", help="results folder")
    args = parser.parse_args(argv)
    with (args.results / "fidelity.csv").open() as f:
        rows = list(csv.DictReader(f))
    print(plot_and_summarise(rows, args.results))


if __name__ == "__main__":
    main()
