"""The interface every distribution scheme implements.

The generic step loop in :mod:`dpkfac.preconditioner` never asks "which
strategy is this?"; it asks the strategy object questions (does this rank
build this layer's factors? decompose this factor? precondition this layer?)
and hands it the communication points of an iteration (gradients, factors,
decompositions, preconditioned gradients). Every collective goes through the
strategy's :class:`~dpkfac.comm.Communicator`, so bytes and waiting time are
accounted in one place.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from dpkfac.assignment import LayerShape
from dpkfac.comm import Communicator
from dpkfac.curvature import Decomposition, KFACLayer


@dataclass
class Preconditioned:
    """One layer's update direction after preconditioning.

    Attributes:
        matrix: (d_out, a_dim) update; the averaged gradient when not preconditioned.
        vg: ``⟨V, ∇W⟩`` for the KL clip (0 when not preconditioned).
        preconditioned: whether ``matrix`` is a preconditioned gradient.
    """

    matrix: torch.Tensor
    vg: float
    preconditioned: bool


def layer_shape(layer: KFACLayer, batch_size: int, positions: int) -> LayerShape:
    """The cost-model view of a layer, with the batch statistics all ranks agreed on."""
    kind = "conv2d" if isinstance(layer.module, nn.Conv2d) else "linear"
    return LayerShape(
        layer.name,
        kind,
        layer.helper.a_dim,
        layer.helper.g_dim,
        positions=max(1, int(positions)),
        batch_size=max(1, int(batch_size)),
    )


class Strategy(ABC):
    """Placement queries and communication points of one distribution scheme.

    Args:
        comm: accounted collectives over the preconditioner's process group.
        method: decomposition class of the compute method ("eigen"/"inverse").
        decomposition_dtype: dtype decompositions run in (receive buffers use it too).
        bucket_cap_mb: size cap of fused gradient buckets.
        options: strategy-specific keyword options; unknown ones raise ValueError.
    """

    name: ClassVar[str]
    #: Whether every rank holds every layer's factors (False: they live on owners only).
    replicated_state: ClassVar[bool] = True
    #: Option names (and defaults) this strategy accepts beyond the common ones.
    OPTIONS: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        comm: Communicator,
        method: type[Decomposition],
        *,
        decomposition_dtype: torch.dtype = torch.float32,
        bucket_cap_mb: float = 25.0,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ValueError(
                f"unknown option(s) {unknown} for strategy {self.name!r}; "
                f"accepted: {sorted(self.OPTIONS) or 'none'}"
            )
        self.options = {**self.OPTIONS, **options}
        self.comm = comm
        self.method = method
        self.decomposition_dtype = decomposition_dtype
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.placed = False

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.size

    # --------------------------------------------------------------- placement
    def needs_batch_shapes(self) -> bool:
        """Whether placement depends on the measured batch size and positions."""
        return False

    @abstractmethod
    def place(self, layers: Sequence[KFACLayer], shapes: Sequence[LayerShape]) -> None:
        """Write ``owner``/``a_owner``/``g_owner`` into every layer.

        Called at construction with nominal shapes and once more at the first
        ``step()`` with the shapes all ranks agreed on; it must be a pure
        function of its inputs so every rank computes the same placement.
        """

    # ----------------------------------------------------------------- queries
    @abstractmethod
    def captures(self, layer: KFACLayer) -> bool:
        """Whether this rank builds the layer's factors from its local batch."""

    def decomposes(self, layer: KFACLayer, which: str) -> bool:
        """Whether this rank computes the decomposition of factor ``which`` ("A"/"G")."""
        owner = layer.a_owner if which == "A" else layer.g_owner
        return owner is None or owner == self.rank

    @abstractmethod
    def preconditions(self, layer: KFACLayer) -> bool:
        """Whether this rank preconditions the layer's gradient."""

    # ---------------------------------------------------- communication points
    def factor_ready(self, layer: KFACLayer, which: str) -> None:
        """Called from the capture hooks right after a batch factor is built."""

    def reduce_gradients(
        self, layers: Sequence[KFACLayer], other_params: Sequence[nn.Parameter]
    ) -> None:
        """Average all gradients across ranks (fused buckets), as plain data parallelism."""
        grads = [
            p.grad for layer in layers for p in layer.helper.parameters() if p.grad is not None
        ]
        grads += [p.grad for p in other_params if p.grad is not None]
        self.comm.allreduce_mean(grads, "grad_allreduce", cap_bytes=self.bucket_cap_bytes)

    def reduce_factors(self, layers: Sequence[KFACLayer]) -> None:
        """Turn pending local batch factors into what ``update_factors`` should fold in."""

    def share_decompositions(
        self, layers: Sequence[KFACLayer], updated: set[tuple[str, str]]
    ) -> None:
        """Make decompositions available where they are needed for preconditioning.

        Args:
            layers: all K-FAC layers.
            updated: (layer name, factor) pairs whose decompositions were due this step.
        """

    def share_preconditioned(
        self,
        layers: Sequence[KFACLayer],
        results: dict[str, Preconditioned],
        *,
        with_kl: bool,
    ) -> dict[str, Preconditioned]:
        """Make every layer's update available on every rank.

        Args:
            layers: all K-FAC layers.
            results: what this rank computed, by layer name.
            with_kl: whether the KL-clip terms must travel with the updates.

        Returns:
            The update of every layer that has a gradient, by layer name.
        """
        return results

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Strategy state that must survive a checkpoint (placement lives in the layers)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
