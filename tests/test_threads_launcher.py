"""``launcher=threads``: the training loop's ranks as threads of one process.

A fast run at P=8 (replicas bitwise identical, as every distributed run checks at
its end), then the claim that matters: at P = 2, 3 and 4 a run under the
in-process launcher is the run forked gloo ranks make, parameters after 20 steps
to 1e-12 in float64 and every rank's random streams equal, for dp_kfac, d_kfac,
kaisa and grouped. The model drops units, so each rank draws its own dropout
masks: a rank whose stream were another's would change the parameters. Last, the
launcher's settings are checked before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

from experiments.config import ExperimentError
from experiments.models.mlp import MLP
from experiments.train import run

pytestmark = pytest.mark.distributed

COMMON = [
    "experiment=digits_cnn",
    "data.fake=true",
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.resume=null",
    "trainer.checkpoint_every_steps=null",
    "trainer.eval_every_epochs=1000",
    "trainer.dist_timeout_s=60",
]


class DropoutMLP(MLP):
    """The digits MLP with dropout after each hidden layer, computing in the default dtype.

    The data module's images are float32; under ``torch.set_default_dtype(float64)``
    the parameters are float64, so inputs are cast to them.
    """

    def __init__(self, num_classes: int, d_in: int = 64, hidden: int = 24, p: float = 0.2) -> None:
        super().__init__(num_classes, d_in, [hidden, hidden])
        for index in (4, 2):  # after each ReLU
            self.insert(index, nn.Dropout(p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self[0].weight.dtype))


MODEL = ["model=mlp", f"model._target_={__name__}.DropoutMLP", "model.hidden=24"]


def _final(out: Path) -> dict[str, Any]:
    return torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)


def test_eight_ranks_in_one_process(compose: Callable[..., Any], tmp_path: Path) -> None:
    """P=8, three steps of dp_kfac on the digits CNN; run() checks the replicas bitwise."""
    cfg = compose(
        *COMMON,
        "launcher=threads",
        "launcher.world_size=8",
        "strategy=dp_kfac",
        "data.batch_size=4",
        "trainer.max_steps=3",
        f"output_dir={tmp_path}",
    )
    result = run(cfg)
    assert result["world_size"] == 8 and result["steps"] == 3
    ckpt = _final(tmp_path)
    # Every rank's streams, gathered into the checkpoint: seeded seed + rank, all different.
    assert len({bytes(r["torch"].numpy()) for r in ckpt["rng"]}) == 8


# (strategy, overrides, world sizes): kaisa at f = 1/2 and grouped at k = 2, f = 1/2 make
# subgroups at P = 4; at P = 2 and 3 their groups are the whole world or single ranks.
CASES = [
    ("dp_kfac", [], (2, 3, 4)),
    ("d_kfac", [], (2, 4)),
    ("kaisa_comm_opt", ["strategy.grad_worker_fraction=0.5"], (2, 4)),
    (
        "grouped_auto",
        ["strategy.factor_group_size=2", "strategy.grad_worker_fraction=0.5"],
        (2, 4),
    ),
]


def _gloo_rank(rank: int, world_size: int, cfg: Any) -> None:
    """One forked gloo rank (run_ranks joined the group): the same run, in float64."""
    torch.set_default_dtype(torch.float64)
    run(cfg)


@pytest.mark.parametrize(
    ("strategy", "extra", "world_size"),
    [(s, e, p) for s, e, sizes in CASES for p in sizes],
    ids=[f"{s}-P{p}" for s, _, sizes in CASES for p in sizes],
)
def test_threads_run_equals_the_gloo_run(
    strategy: str,
    extra: list[str],
    world_size: int,
    compose: Callable[..., Any],
    tmp_path: Path,
) -> None:
    common = [
        *COMMON,
        *MODEL,
        f"strategy={strategy}",
        *extra,
        "data.batch_size=8",
        "trainer.max_steps=20",
    ]
    gloo = compose(*common, f"output_dir={tmp_path / 'gloo'}")
    run_ranks(_gloo_rank, world_size, gloo)
    threads = compose(
        *common,
        "launcher=threads",
        f"launcher.world_size={world_size}",
        f"output_dir={tmp_path / 'threads'}",
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        run(threads)
    finally:
        torch.set_default_dtype(default)
    a, b = _final(tmp_path / "gloo"), _final(tmp_path / "threads")
    assert a["step"] == b["step"] == 20
    for name, tensor in a["model"].items():
        assert tensor.dtype == torch.float64, name
        torch.testing.assert_close(b["model"][name], tensor, rtol=0, atol=1e-12, msg=name)
    # Each rank's own streams, at the end: what it seeded (seed + rank) and drew (dropout).
    for rank, (ra, rb) in enumerate(zip(a["rng"], b["rng"], strict=True)):
        assert torch.equal(ra["torch"], rb["torch"]), rank
        assert ra["python"] == rb["python"] and torch.equal(
            ra["numpy"]["keys"], rb["numpy"]["keys"]
        ), rank


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["launcher.world_size=0"], "invalid value launcher.world_size=0: expected a positive"),
        (["launcher.world_size=two"], "invalid value launcher.world_size='two'"),
        (["trainer.device=cuda"], "trainer.device=cuda with launcher=threads"),
        (["data.num_workers=2"], "data.num_workers=2 with launcher=threads"),
    ],
)
def test_threads_settings_are_checked_first(
    overrides: list[str], message: str, compose: Callable[..., Any], tmp_path: Path
) -> None:
    cfg = compose(*COMMON, "launcher=threads", *overrides, f"output_dir={tmp_path}")
    with pytest.raises(ExperimentError, match=message):
        run(cfg)


def test_world_size_belongs_to_the_threads_launcher(
    compose: Callable[..., Any], tmp_path: Path
) -> None:
    cfg = compose(*COMMON, "+launcher.world_size=4", f"output_dir={tmp_path}")
    with pytest.raises(ExperimentError, match="--nproc_per_node"):
        run(cfg)


def test_a_rank_error_is_the_runs_error(compose: Callable[..., Any], tmp_path: Path) -> None:
    """A configuration error on the ranks surfaces as itself, not as a thread failure."""
    cfg = compose(
        *COMMON,
        "launcher=threads",
        "launcher.world_size=4",
        "data.batch_size=100",  # 160 training images: fewer than 100 x 4
        f"output_dir={tmp_path}",
    )
    with pytest.raises(ExperimentError, match=r"fewer than data.batch_size=100 x 4 rank"):
        run(cfg)
