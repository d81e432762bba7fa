"""Checkpoint entries of one K-FAC layer: factors, decompositions and placement.

Kept apart from the step loop so the preconditioner's ``state_dict`` only
decides *which* rank's entries to keep; the per-layer format lives here. Every
tensor is cloned onto the CPU when saved (a rank-0 checkpoint then never
refers to another rank's device) and moved to the layer's device when loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from dpkfac.curvature.decomposition import Decomposition
from dpkfac.curvature.layer import FACTORS, KFACLayer


def _clone(t: torch.Tensor | None, device: torch.device | None = None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().to(device, copy=True) if device is not None else t.detach().clone()


_CPU = torch.device("cpu")


def layer_state(layer: KFACLayer, *, held: bool = True) -> dict[str, Any]:
    """A layer's checkpoint entry (CPU tensors); with ``held=False`` only its placement."""
    entry: dict[str, Any] = {"owner": layer.owner, "ever_captured": layer.ever_captured}
    for which, state in layer.factors.items():
        dec = state.decomposition if held else None
        entry[which] = _clone(state.running, _CPU) if held else None
        entry[f"{which}_decomp"] = None if dec is None else [_clone(t, _CPU) for t in dec.tensors()]
        entry[f"{which.lower()}_owner"] = state.owner
    return entry


def load_layer_state(
    layer: KFACLayer, entry: dict[str, Any], method: type[Decomposition], *, held: bool | None
) -> None:
    """Restore a layer from its entry.

    Args:
        layer: the layer to restore.
        entry: output of :func:`layer_state`.
        method: decomposition class of the compute method.
        held: None restores only the placement; True also the factors and
            decompositions; False drops them (another rank holds this layer).
    """
    layer.set_placement(entry["owner"], entry["a_owner"], entry["g_owner"])
    layer.ever_captured = bool(entry.get("ever_captured", False))
    layer.clear_pending()
    if held is None:
        return
    device = layer.module.weight.device
    for which in FACTORS:
        state = layer.factors[which]
        state.running = _clone(entry[which], device) if held else None
        tensors = entry[f"{which}_decomp"] if held else None
        state.decomposition = (
            None if tensors is None else method.from_tensors([_clone(t, device) for t in tensors])
        )
