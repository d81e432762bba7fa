"""Mixed precision: the loss scale of a ``torch.amp.GradScaler``, read on the device.

With a scaled loss every output gradient is ``s`` times too large. G is built
from the output gradient multiplied by ``1/s`` first, in the factor's dtype,
so ``s²`` never appears: ``s²·G`` overflows float32 long before the gradients
do (a scaler at ``2**70`` already), which would reject every factor update.
The scale is read as a device tensor, never on the host, so the capture hook
does not wait for the device.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_grad_scaler", "inverse_loss_scale"]


def check_grad_scaler(scaler: Any) -> None:
    """Raise ValueError unless ``scaler`` is None or behaves like a ``torch.amp.GradScaler``."""
    if scaler is None:
        return
    missing = [m for m in ("is_enabled", "get_scale") if not callable(getattr(scaler, m, None))]
    if missing:
        raise ValueError(
            f"grad_scaler must be a torch.amp.GradScaler (or None), got {scaler!r} "
            f"without {missing}"
        )


def inverse_loss_scale(scaler: Any, device: torch.device) -> torch.Tensor | None:
    """``1/s`` as a float64 tensor on ``device``; None without an enabled, started scaler.

    The scaler's own scale tensor is used when it has one (no host read);
    a scaler that has not scaled a loss yet scales nothing.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    get_async = getattr(scaler, "_get_scale_async", None)
    scale = get_async() if get_async is not None else None
    if scale is None:
        return None
    return scale.to(device, torch.float64).reciprocal()
