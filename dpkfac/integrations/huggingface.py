"""K-FAC for Hugging Face ``transformers.Trainer`` in one line: a callback.

    from dpkfac.integrations.huggingface import KFACCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[KFACCallback(strategy="dp_kfac", damping=0.003)])

At ``on_train_begin`` the callback builds the preconditioner on ``trainer.model_wrapped``
(the DDP module under several processes) with ``accumulation_steps`` from
``args.gradient_accumulation_steps`` and the KL clip's learning rate read from the optimizer
at every step (so it follows the scheduler).

**Where it preconditions.** Trainer clips the gradients (``max_grad_norm``) before any
callback event of the step (``on_pre_optimizer_step`` comes after the clip), so a callback
alone would clip the raw gradient and let the preconditioned one through unclipped. The
callback therefore wraps, on this Trainer's own accelerator instance only, its public
``unscale_gradients``, which accelerate's ``clip_grad_norm_`` calls first thing: the wrapper
unscales (a no-op without fp16), then runs ``pre.step()``, and the clip follows. Trainer
clips once per optimizer step, after the last micro-batch's backward pass (with
``max_grad_norm=0`` too, to measure the norm it logs), so ``max_grad_norm`` clips the update
that is applied and the logged ``grad_norm`` is the preconditioned gradient's. Should a
Trainer path not clip through it (a mixed device-mesh model), ``on_pre_optimizer_step``
unscales and preconditions and warns that the clip came first. The wrapper is removed at
``on_train_end``.

**fp16.** Under ``fp16=True`` (a ``GradScaler``: accelerate makes one on a GPU, none on a
CPU, where fp16 trains in float32) the preconditioner is built with Trainer's scaler
(``grad_scaler``), and the wrapper's order makes ``pre.step()`` see unscaled gradients: G is
built from unscaled output gradients, and a step whose gradients overflowed keeps its
factors, as the scaler skips its optimizer step. Under the overlapped mode
(``pre.takes_scaled_gradients``) ``pre.step()`` runs first and the unscale after it, as that
mode asks.

**Loss scaling.** K-FAC's G assumes each micro-batch's loss is its mean divided by the
accumulation steps (:class:`dpkfac.KFACPreconditioner`, ``accumulation_steps``). Trainer does
that, except where the model "accepts loss kwargs" (most models' ``forward(**kwargs)``) and the
batch has ``labels``: it then passes ``num_items_in_batch``, does not divide, and multiplies
the loss by the number of processes, so a model that ignores the count (BERT's heads) gets a
loss k·P times the mean and G (k·P)² too large. The callback sets
``trainer.model_accepts_loss_kwargs = False``, which makes Trainer divide every micro-batch's
mean loss by the accumulation steps, the project's convention. Where the loss is the user's
(``compute_loss_func``, or ``loss_is_scaled_for_ga`` set), the callback warns that G assumes
this convention.

**Checkpoints.** ``on_save`` writes the preconditioner's state (a collective under dp_kfac:
every rank calls it) as ``dpkfac_preconditioner.pt`` in the checkpoint folder;
``trainer.train(resume_from_checkpoint=...)`` loads it, so a resumed run continues bitwise.

Trainer passes callbacks no reference to itself: the callback finds the Trainer that calls
its ``on_train_begin`` on the call stack (the Trainer whose callback list holds this
callback) and reads the checkpoint being resumed from that call. Needs ``transformers``
(``pip install 'dpkfac[hf]'``).
"""

from __future__ import annotations

import inspect
import logging
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch

from dpkfac import KFACPreconditioner
from dpkfac.integrations._common import build, check_options, follow_lr

__all__ = ["STATE_FILE", "KFACCallback"]

log = logging.getLogger(__name__)

#: The preconditioner's state in a Trainer checkpoint folder.
STATE_FILE = "dpkfac_preconditioner.pt"


def _calling_trainer(callback: object) -> tuple[Any, str | None]:
    """The Trainer running ``callback``'s event, and the checkpoint its ``train()`` resumes.

    Found on the call stack: the innermost frame whose ``self`` is a Trainer holding this
    callback (``_inner_training_loop``, whose ``resume_from_checkpoint`` is the folder).
    """
    from transformers import Trainer

    frame = inspect.currentframe()
    try:
        while frame is not None:
            trainer = frame.f_locals.get("self")
            if isinstance(trainer, Trainer) and callback in trainer.callback_handler.callbacks:
                resume = frame.f_locals.get("resume_from_checkpoint")
                folder = os.fspath(resume) if isinstance(resume, str | os.PathLike) else None
                return trainer, folder
            frame = frame.f_back
    finally:
        del frame
    raise RuntimeError(
        "dpkfac KFACCallback: on_train_begin was not called by a transformers.Trainer holding "
        "this callback; pass it as Trainer(..., callbacks=[KFACCallback(...)])"
    )


class _KFACCallback:
    """Precondition a ``transformers.Trainer`` run with K-FAC (see the module docstring).

    ``KFACCallback`` is this class with ``transformers.TrainerCallback`` (its other events'
    no-ops) as a base, made when it is first imported (:func:`__getattr__`), so that
    importing this module imports transformers only when the callback is used.

    Args:
        **kfac_options: :class:`dpkfac.KFACPreconditioner`'s keyword options (``strategy``,
            ``damping``, ...), except ``accumulation_steps``, ``lr`` and ``grad_scaler``, which
            come from the TrainingArguments, the optimizer and Trainer's accelerator
            (ValueError if given).

    Attributes:
        pre: the preconditioner, from ``on_train_begin`` on (None before).
    """

    def __init__(self, **kfac_options: Any) -> None:
        check_options(kfac_options, "huggingface", ("accumulation_steps", "lr", "grad_scaler"))
        self.kfac_options = kfac_options
        self.pre: KFACPreconditioner | None = None
        self._accelerator: Any = None
        self._preconditioned = False
        self._warned_late = False

    # ------------------------------------------------------------------ train begin
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, resume = _calling_trainer(self)
        self._settle_loss_scaling(trainer)
        model = trainer.model_wrapped
        if self.pre is None or self.pre.model is not model:
            self.pre = build(
                model,
                self.kfac_options,
                accumulation_steps=args.gradient_accumulation_steps,
                lr=follow_lr(trainer.optimizer),
                grad_scaler=trainer.accelerator.scaler,  # None but under fp16
            )
        if resume is not None:
            self._load(resume)
        self._install(trainer.accelerator)

    def _settle_loss_scaling(self, trainer: Any) -> None:
        """Make Trainer divide each micro-batch's mean loss by the accumulation steps, as G
        assumes (module docstring, "Loss scaling"), or warn where the loss is the user's."""
        if trainer.compute_loss_func is not None or trainer.loss_is_scaled_for_ga is not None:
            warnings.warn(
                "dpkfac KFACCallback: the Trainer's loss is scaled by the user "
                "(compute_loss_func or loss_is_scaled_for_ga): K-FAC's G assumes each "
                "micro-batch's loss is its mean divided by gradient_accumulation_steps "
                f"({trainer.args.gradient_accumulation_steps}); another scale c makes G c² "
                "times too large",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        if trainer.model_accepts_loss_kwargs:
            log.info(
                "dpkfac: Trainer.model_accepts_loss_kwargs set to False: each micro-batch's "
                "mean loss is divided by gradient_accumulation_steps, as K-FAC's G assumes"
            )
            trainer.model_accepts_loss_kwargs = False

    def _load(self, folder: str) -> None:
        assert self.pre is not None
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"dpkfac KFACCallback: resuming from {folder}, which holds no {STATE_FILE}: the "
                "checkpoint was written without KFACCallback, so K-FAC's factors and step "
                "count are lost. Resume from a checkpoint written with the callback, or start "
                "without resume_from_checkpoint"
            )
        self.pre.load_state_dict(torch.load(path, map_location="cpu", weights_only=False))

    # --------------------------------------------------------------- preconditioning
    def _install(self, accelerator: Any) -> None:
        """Run ``pre.step()`` whenever Trainer unscales the gradients, which accelerate's
        ``clip_grad_norm_`` does before it clips (or measures) them: after the unscale, or
        before it where the preconditioner takes scaled gradients (the overlapped mode)."""
        self._remove()
        original = accelerator.unscale_gradients

        def unscale_gradients(*args: Any, **kwargs: Any) -> Any:
            if self.pre is not None and self.pre.takes_scaled_gradients:
                self._precondition()
                return original(*args, **kwargs)
            result = original(*args, **kwargs)
            self._precondition()
            return result

        accelerator.unscale_gradients = unscale_gradients
        self._accelerator = accelerator

    def _remove(self) -> None:
        if self._accelerator is not None:
            # The wrapper is an instance attribute: deleting it restores the method.
            self._accelerator.__dict__.pop("unscale_gradients", None)
        self._accelerator = None

    def _precondition(self) -> None:
        if not self._preconditioned and self.pre is not None:
            self._preconditioned = True
            self.pre.step()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._preconditioned:
            return
        if not self._warned_late:
            self._warned_late = True
            warnings.warn(
                "dpkfac KFACCallback: Trainer did not clip through accelerator.clip_grad_norm_ "
                "this step, so K-FAC preconditions after its clipping: max_grad_norm bounds "
                "the raw gradient, not the update applied",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._accelerator is not None:
            self._accelerator.unscale_gradients()  # the wrapper: unscale, then precondition
        self._precondition()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._preconditioned = False

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._remove()

    # ------------------------------------------------------------------ checkpoints
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write the preconditioner's state beside Trainer's (every rank calls this)."""
        if self.pre is None:
            return
        pre_state = self.pre.state_dict()  # a collective under dp_kfac: every rank
        if args.should_save:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            torch.save(pre_state, os.path.join(folder, STATE_FILE))


if TYPE_CHECKING:  # what the checkers see; at run time, __getattr__ makes it
    KFACCallback = _KFACCallback


def __getattr__(name: str) -> Any:
    """``KFACCallback``, made on first use: :class:`_KFACCallback` on transformers'
    ``TrainerCallback`` (imported here, not with the module)."""
    if name != "KFACCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from transformers import TrainerCallback

    callback = type(
        "KFACCallback",
        (_KFACCallback, TrainerCallback),
        {"__module__": __name__, "__doc__": _KFACCallback.__doc__},
    )
    globals()["KFACCallback"] = callback
    return callback
