"""Tiny models, batches and a run loop shared by the distributed strategy tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import dpkfac

BATCH = 6  # per rank
STRATEGY_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "dp_kfac": ("dp_kfac", {}),
    "dp_kfac_owner": ("dp_kfac", {"grad_reduction": "owner"}),
    "d_kfac": ("d_kfac", {}),
    "spd_kfac": ("spd_kfac", {"local_threshold": 0, "profile_steps": 1}),
    "spd_kfac_local": ("spd_kfac", {}),
    "kaisa_comm_opt": ("kaisa", {"grad_worker_fraction": "comm_opt"}),
    "kaisa_mem_opt": ("kaisa", {"grad_worker_fraction": "mem_opt"}),
    # Owners build the factors alone and broadcast decompositions (k = 1, f = 1).
    "grouped_local_decomp": ("grouped", {"factor_group_size": 1, "grad_worker_fraction": 1.0}),
    # (k, f) chosen by the cost model on a preset (no start-up measurement).
    "grouped_auto": ("grouped", {"hardware": "cpu_gloo_local"}),
}
#: Variants whose curvature is the whole (all-ranks) batch's.
REPLICATED_VARIANTS = ("d_kfac", "spd_kfac", "spd_kfac_local", "kaisa_comm_opt", "kaisa_mem_opt")


class TinyNet(nn.Module):
    """Conv (with positions) -> Linear -> Linear, plus a GroupNorm K-FAC leaves alone."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, stride=1)
        self.bn = nn.GroupNorm(1, 3)  # per-sample: the concatenated batch is exact
        self.fc1 = nn.Linear(3 * 4 * 4, 5)
        self.fc2 = nn.Linear(5, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)), inplace=True)
        x = torch.tanh(self.fc1(x.flatten(1)))
        return self.fc2(x)


#: EmbedNet's vocabulary: its 4000 x 8 float64 table (256 KB) is the last gradient of the
#: backward pass and, like BERT's word embedding, no K-FAC layer.
VOCAB = 4000


class EmbedNet(nn.Module):
    """Token ids -> embedding (no K-FAC layer, last in the backward pass) -> two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.embed(ids).mean(1))))


def embed_net(seed: int = 0) -> EmbedNet:
    torch.manual_seed(seed)
    return EmbedNet().double()


def embed_batch(step: int, source: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (8 sequences of 5) and labels identified by (step, source)."""
    g = torch.Generator().manual_seed(1000 * step + source)
    return torch.randint(0, VOCAB, (8, 5), generator=g), torch.randint(0, 4, (8,), generator=g)


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet().double()


def batch(step: int, source: int, size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch identified by (step, source)."""
    g = torch.Generator().manual_seed(1000 * step + source)
    x = torch.randn(size, 2, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (size,), generator=g)
    return x, y


def concat_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, r) for r in range(world_size)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def make_preconditioner(
    model: nn.Module, variant: str, **overrides: Any
) -> dpkfac.KFACPreconditioner:
    strategy, options = STRATEGY_VARIANTS[variant]
    kwargs: dict[str, Any] = {
        "damping": 0.01,
        "factor_decay": 0.9,
        "kl_clip": None,
        "lr": 0.1,
        "collective_timeout": 60.0,
    }
    kwargs.update(options)
    kwargs.update(overrides)
    return dpkfac.KFACPreconditioner(model, strategy=strategy, **kwargs)


def run(
    model: nn.Module,
    pre: dpkfac.KFACPreconditioner,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float = 0.1,
) -> dict[str, list[dict[str, torch.Tensor]]]:
    """Train on ``batches``; record gradients after ``pre.step()`` and parameters after steps."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    grads, params = [], []
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        inner = model.module if hasattr(model, "module") else model
        grads.append({n: p.grad.detach().clone() for n, p in inner.named_parameters()})
        opt.step()
        params.append({n: p.detach().clone() for n, p in inner.named_parameters()})
    return {"grads": grads, "params": params}


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest relative error over all tensors of two name->tensor dicts."""
    worst = 0.0
    for k in a:
        denom = b[k].abs().max().clamp(min=1e-30)
        worst = max(worst, float((a[k] - b[k]).abs().max() / denom))
    return worst
