"""Which files of ``dpkfac/`` one steady-state step passes through, counted by a profiler.

``python -m experiments.bench.step_files [--strategy dp_kfac] [--world-size 2]`` builds a
small MLP, runs three warm-up steps, then records with :func:`sys.setprofile` every function
of the package that one more step calls: its forward and backward pass (the capture hooks)
and ``pre.step()``. The ranks are one process in torch's fake process group (collectives
complete at once, doing nothing), so the distributed paths (gradient reduction, update
exchange) run as on rank 0 of a real job. It prints the number of files and the files, with
how many of the package's functions each one contributed.

This is the measure of "the step readable" in docs/design.md: how many files a reader must
open to follow one step.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Sequence
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dpkfac

WARMUP = 3


def step_files(strategy: str = "dp_kfac", world_size: int = 2, **options: Any) -> Counter[str]:
    """Per file of ``dpkfac/`` (relative path), the distinct functions one step called.

    Runs on rank 0 of torch's fake process group of ``world_size`` ranks
    (:func:`~experiments.bench.fake_cuda.fake_process_group`), a factor and decomposition
    step (``factor_update_steps`` and ``inv_update_steps`` 1) after :data:`WARMUP` steps.
    """
    from experiments.bench.fake_cuda import fake_process_group

    with fake_process_group(0, world_size):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        model.append(nn.Linear(16, 4))
        pre = dpkfac.KFACPreconditioner(model, strategy=strategy, **options)
        # The fake group receives nothing (its receive buffers stay as allocated, garbage a
        # received update lands in .grad): no optimizer steps the weights, so none of it
        # (not even lr 0 times a NaN) reaches the weights or the factors of the next step.
        root = os.path.dirname(dpkfac.__file__)
        seen: set[tuple[str, str]] = set()

        def tracer(frame: FrameType, event: str, arg: object) -> None:
            if event == "call" and frame.f_code.co_filename.startswith(root):
                path = os.path.relpath(frame.f_code.co_filename, root)
                seen.add((path, frame.f_code.co_qualname))

        for i in range(WARMUP + 1):
            x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
            model.zero_grad()
            if i == WARMUP:
                sys.setprofile(tracer)
            try:
                F.cross_entropy(model(x), y).backward()
                pre.step()
            finally:
                sys.setprofile(None)
        return Counter(path for path, _ in seen)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="dp_kfac")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    files = step_files(args.strategy, args.world_size)
    print(f"{len(files)} files of dpkfac/ in one {args.strategy} step at P={args.world_size}:")
    for path, functions in sorted(files.items()):
        print(f"  {path} ({functions} functions)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
