"""Per-rank digits training for the ``convergence`` table.

The paper's convergence claims (DP-KFAC reaches the accuracy of D-KFAC and
SGD) are checked here on the one real data set that needs no download:
scikit-learn's 8x8 digits, with the default experiment's split
(``experiments/data/digits.py``: stratified 80/20, ``random_state=0``,
pixels standardised by the training set) and its model (:class:`DigitsCNN`).
The loop is deliberately small and self-contained: every rank takes every
P-th sample of a seeded per-epoch permutation (like ``DistributedSampler``),
the preconditioner averages gradients (SGD uses the same accounted
all-reduce), the learning rate drops by ``gamma`` at the preset's epoch
milestones, and rank 0 scores the full test split after every epoch.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from experiments.bench.measure import process_group


def digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The default experiment's train/test split of the digits, as 1x8x8 float images."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.2, stratify=labels, random_state=0
    )
    mean, std = x_train.mean(), x_train.std()

    def to_x(x: Any) -> torch.Tensor:
        return torch.tensor((x - mean) / std, dtype=torch.float32).reshape(-1, 1, 8, 8)

    return to_x(x_train), torch.tensor(y_train), to_x(x_test), torch.tensor(y_test)


def _replicas_identical(model: torch.nn.Module) -> bool:
    """Whether every rank holds bitwise the same parameters (the strategies' promise)."""
    if not dist.is_initialized():
        return True
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    same = torch.tensor([float(torch.equal(flat, ref))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item() == 1.0)


def run_convergence(spec: dict[str, Any]) -> dict[str, Any]:
    """Train DigitsCNN for ``epochs`` and report test accuracy after each epoch.

    Args:
        spec: ``strategy`` (as in the benchmark spec), ``convergence`` settings,
            ``seed``, ``threads``, ``timeout_s``.

    Returns:
        ``rank``, ``world_size``, ``epochs`` (a list of ``{epoch, test_acc,
        train_loss, seconds}``; filled on rank 0), ``replicas_identical``.
    """
    from dpkfac import KFACPreconditioner
    from dpkfac.comm import Communicator
    from experiments.models.digits_cnn import DigitsCNN

    torch.set_num_threads(int(spec.get("threads", 1)))
    conf = spec["convergence"]
    with process_group("cpu", float(spec.get("timeout_s", 300))) as (rank, size, _):
        x_train, y_train, x_test, y_test = digits_split()
        torch.manual_seed(spec["seed"])
        model = DigitsCNN(num_classes=10)
        optimizer = torch.optim.SGD(
            model.parameters(),
            lr=conf["lr"],
            momentum=conf["momentum"],
            weight_decay=conf["weight_decay"],
        )
        milestones = [int(e) for e in conf.get("milestones", [])]
        gamma = float(conf.get("gamma", 0.1))

        def lr_at_epoch(epoch: int) -> float:
            return float(conf["lr"]) * gamma ** sum(epoch >= m for m in milestones)

        kfac = spec["strategy"].get("kfac")
        pre = None
        comm = Communicator()
        if kfac is not None:
            pre = KFACPreconditioner(
                model,
                damping=conf["damping"],
                kl_clip=conf["kl_clip"],
                lr=lambda _: optimizer.param_groups[0]["lr"],
                factor_update_steps=int(conf["factor_every"]),
                inv_update_steps=int(conf["inv_every"]),
                **kfac,
            )
        history = []
        start = time.perf_counter()
        per_rank = len(x_train) // size
        for epoch in range(int(conf["epochs"])):
            model.train()
            for group in optimizer.param_groups:
                group["lr"] = lr_at_epoch(epoch)
            g = torch.Generator().manual_seed(spec["seed"] + epoch)
            order = torch.randperm(len(x_train), generator=g)[: per_rank * size]
            mine = order[rank::size]
            losses = []
            for i in range(0, len(mine), int(conf["batch_size"])):
                idx = mine[i : i + int(conf["batch_size"])]
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
                loss.backward()
                if pre is not None:
                    pre.step()
                else:
                    grads = [p.grad for p in model.parameters() if p.grad is not None]
                    comm.allreduce_mean(grads, "grad_allreduce")
                optimizer.step()
                losses.append(float(loss.detach()))
            if rank == 0:
                model.eval()
                with torch.no_grad():
                    acc = (model(x_test).argmax(1) == y_test).float().mean().item()
                history.append(
                    {
                        "epoch": epoch + 1,
                        "test_acc": acc,
                        "train_loss": sum(losses) / max(len(losses), 1),
                        "seconds": time.perf_counter() - start,
                    }
                )
        return {
            "rank": rank,
            "world_size": size,
            "epochs": history,
            "steps_per_epoch": -(-per_rank // int(conf["batch_size"])),
            "replicas_identical": _replicas_identical(model),
        }
