"""K-FAC for a Hugging Face ``accelerate`` loop in one line: ``prepare``.

    model, opt = accelerator.prepare(model, opt)
    pre = dpkfac.integrations.accelerate.prepare(accelerator, model, optimizer=opt)
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            pre.step()                      # a no-op until the accumulation's last micro-batch
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step(); opt.zero_grad()

The standard accelerate loop calls everything on every micro-batch and lets
``accelerator.sync_gradients`` decide. ``prepare`` builds the preconditioner on the prepared
model (DDP under several processes), with ``accumulation_steps`` from
``accelerator.gradient_accumulation_steps`` (``accelerator.backward`` divides each
micro-batch's loss by it, as K-FAC's G assumes), makes ``pre.step()`` return at once while
``accelerator.sync_gradients`` is False (inside DDP's ``no_sync``, mid-accumulation), and
registers the preconditioner with ``accelerator.register_for_checkpointing``, so
``accelerator.save_state``/``load_state`` keep it (every process calls both, as accelerate
asks; the state is a collective under dp_kfac). With ``optimizer=`` the KL clip reads that
optimizer's learning rate at every step (its scheduler's). Clipping after ``pre.step()``
clips the update that is applied. fp16 is refused: accelerate unscales inside
``clip_grad_norm_``, after ``pre.step()`` (bf16 needs no scaler). Needs ``accelerate``
(``pip install 'dpkfac[accelerate]'``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from dpkfac import KFACPreconditioner
from dpkfac.compile import unwrap_compiled
from dpkfac.integrations._common import build, check_options, follow_lr

__all__ = ["prepare"]


def prepare(
    accelerator: Any,
    model: nn.Module,
    *,
    optimizer: Optimizer | None = None,
    **kfac_options: Any,
) -> KFACPreconditioner:
    """The preconditioner of an accelerate run (see the module docstring).

    Args:
        accelerator: the run's ``accelerate.Accelerator``.
        model: what ``accelerator.prepare`` returned for the model.
        optimizer: the (prepared) optimizer whose learning rate the KL clip follows; None:
            ``lr`` from ``kfac_options`` (default 0.1), fixed or a callable of the step.
        **kfac_options: :class:`dpkfac.KFACPreconditioner`'s options, except
            ``accumulation_steps`` (the accelerator's) and, with ``optimizer``, ``lr``.

    Raises:
        ValueError: an option the accelerator decides was given, a multi-process run
            passed the model before ``accelerator.prepare`` wrapped it, or fp16 (a loss
            scaler: its unscale comes inside ``clip_grad_norm_``, after ``pre.step()``).
    """
    decided = ("accumulation_steps", "lr") if optimizer is not None else ("accumulation_steps",)
    check_options(kfac_options, "accelerate", decided)
    if accelerator.scaler is not None:
        raise ValueError(
            "dpkfac.integrations.accelerate.prepare refuses fp16 (accelerator.scaler): "
            "accelerator.clip_grad_norm_ unscales the gradients after pre.step(), which would "
            "precondition them still scaled; use mixed_precision='bf16'"
        )
    if accelerator.num_processes > 1 and not isinstance(
        unwrap_compiled(model), DistributedDataParallel
    ):
        raise ValueError(
            f"dpkfac.integrations.accelerate.prepare: the model is a "
            f"{type(model).__name__}, not the DistributedDataParallel module that "
            f"accelerator.prepare returns with {accelerator.num_processes} processes: pass "
            "the prepared model (model = accelerator.prepare(model) first)"
        )
    pre = build(
        model,
        kfac_options,
        accumulation_steps=accelerator.gradient_accumulation_steps,
        lr=follow_lr(optimizer) if optimizer is not None else None,
    )
    pre.synced = lambda: bool(accelerator.sync_gradients)
    accelerator.register_for_checkpointing(pre)
    return pre
