"""K-FAC for PyTorch Lightning in one line: a callback.

    from dpkfac.integrations.lightning import KFACCallback
    trainer = lightning.Trainer(..., callbacks=[KFACCallback(strategy="dp_kfac")])

At ``on_fit_start`` (after the strategy wrapped the module: ``trainer.strategy.model``, DDP
under ``strategy="ddp"``) the callback builds the preconditioner with ``accumulation_steps``
from ``trainer.accumulate_grad_batches`` (Lightning divides each micro-batch's loss by it, as
K-FAC's G assumes) and the KL clip's learning rate read from the first optimizer at every
step (its scheduler's). It preconditions in ``on_before_optimizer_step``, which Lightning calls
once per optimizer step, after the last micro-batch's backward pass and before its gradient
clipping (``gradient_clip_val``), so the clip bounds the update that is applied. The
preconditioner's state is the callback's state in Lightning's checkpoints
(``state_dict``/``load_state_dict``; a collective under dp_kfac, which Lightning's saving,
run on every rank, satisfies), so ``trainer.fit(ckpt_path=...)`` continues bitwise. With
``precision="16-mixed"`` the preconditioner is built with Lightning's loss scaler
(``trainer.precision_plugin.scaler``), which unscales before ``on_before_optimizer_step``:
K-FAC sees unscaled gradients, builds G from unscaled output gradients and keeps its factors
on a step the scaler skips (the overlapped mode, which needs the scaled gradients, is
refused there).
Automatic optimization with one optimizer. Needs ``lightning``
(``pip install 'dpkfac[lightning]'``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from dpkfac import KFACPreconditioner
from dpkfac.integrations._common import build, check_options

__all__ = ["KFACCallback"]


class KFACCallback(pl.Callback):
    """Precondition a Lightning run with K-FAC (see the module docstring).

    Args:
        **kfac_options: :class:`dpkfac.KFACPreconditioner`'s keyword options, except
            ``accumulation_steps``, ``lr`` and ``grad_scaler`` (the Trainer's, the
            optimizer's and the precision plugin's; ValueError if given).

    Attributes:
        pre: the preconditioner, from ``on_fit_start`` on (None before).
    """

    def __init__(self, **kfac_options: Any) -> None:
        check_options(kfac_options, "lightning", ("accumulation_steps", "lr", "grad_scaler"))
        self.kfac_options = kfac_options
        self.pre: KFACPreconditioner | None = None
        # A checkpoint's state restored before on_fit_start built the preconditioner.
        self._pending: dict[str, Any] | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not pl_module.automatic_optimization or len(trainer.optimizers) != 1:
            raise ValueError(
                "dpkfac.integrations.lightning.KFACCallback needs automatic optimization with "
                f"one optimizer (got automatic_optimization={pl_module.automatic_optimization}, "
                f"{len(trainer.optimizers)} optimizers): with manual optimization call "
                "pre.step() yourself between manual_backward and optimizer.step"
            )

        def lr(step: int) -> float:
            # Read at each step: the optimizer's current (scheduled) learning rate.
            return float(trainer.optimizers[0].param_groups[0]["lr"])

        self.pre = build(
            trainer.strategy.model,
            self.kfac_options,
            accumulation_steps=trainer.accumulate_grad_batches,
            lr=lr,
            # precision="16-mixed": Lightning unscales before on_before_optimizer_step.
            grad_scaler=getattr(trainer.precision_plugin, "scaler", None),
        )
        if self.pre.takes_scaled_gradients:
            raise ValueError(
                "dpkfac.integrations.lightning.KFACCallback: the overlapped mode with "
                "precision='16-mixed' needs pre.step() before the loss scaler unscales, and "
                "Lightning unscales before on_before_optimizer_step; use precision='bf16-mixed' "
                "or a strategy without overlap"
            )
        if self._pending is not None:
            self.pre.load_state_dict(self._pending)
            self._pending = None

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.pre is not None:
            self.pre.step()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.pre is None else {"preconditioner": self.pre.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = state_dict.get("preconditioner")
        if state is None:
            return
        if self.pre is None:
            self._pending = state
        else:
            self.pre.load_state_dict(state)
