"""Checkpoint entries of one K-FAC layer: factors, decompositions and placement.

Kept apart from the step loop so the preconditioner's ``state_dict`` only
decides *which* rank's entries to keep; the per-layer format lives here. Every
tensor is cloned onto the CPU when saved (a rank-0 checkpoint then never
refers to another rank's device) and moved to the layer's device when loaded.
"""

from __future__ import annotations

from typing import Any, overload

import torch

from dpkfac.curvature.decomposition import Decomposition
from dpkfac.curvature.layer import FACTORS, KFACLayer


@overload
def _clone(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor: ...
@overload
def _clone(t: None, device: torch.device | None = None) -> None: ...
def _clone(t: torch.Tensor | None, device: torch.device | None = None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().to(device, copy=True) if device is not None else t.detach().clone()


_CPU = torch.device("cpu")


def layer_state(
    layer: KFACLayer, *, held: bool = True, decompositions: bool | None = None
) -> dict[str, Any]:
    """A layer's checkpoint entry (CPU tensors).

    Args:
        layer: the layer.
        held: whether this rank holds the layer's factors (False: no factors).
        decompositions: whether it holds the layer's decompositions (None: as
            ``held``); a gradient worker holds them without the factors.
    """
    keep_decomp = held if decompositions is None else decompositions
    entry: dict[str, Any] = {
        "owner": layer.owner,
        "ever_captured": layer.ever_captured,
        "ever_seen": layer.ever_seen,
    }
    for which, state in layer.factors.items():
        dec = state.decomposition if keep_decomp else None
        entry[which] = _clone(state.running, _CPU) if held else None
        entry[f"{which}_decomp"] = None if dec is None else [_clone(t, _CPU) for t in dec.tensors()]
        entry[f"{which.lower()}_decomposer"] = state.decomposer
    return entry


def merge_layer_states(mine: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """One entry from two ranks' entries of a layer: each factor and decomposition from
    whichever holds it (``mine`` first); the placement is the same in both."""
    merged = dict(mine)
    for key in (*FACTORS, *(f"{w}_decomp" for w in FACTORS)):
        if merged.get(key) is None:
            merged[key] = other.get(key)
    for key in ("ever_captured", "ever_seen"):
        merged[key] = bool(mine.get(key) or other.get(key))
    return merged


def load_layer_state(
    layer: KFACLayer,
    entry: dict[str, Any],
    method: type[Decomposition],
    *,
    held: bool | None,
    decompositions: bool | None = None,
) -> None:
    """Restore a layer from its entry.

    Args:
        layer: the layer to restore.
        entry: output of :func:`layer_state`.
        method: decomposition class of the compute method.
        held: None restores only the placement; True also the factors and
            decompositions; False drops them (another rank holds this layer).
        decompositions: whether to restore the decompositions (None: as
            ``held``), for a gradient worker that holds them without the factors.
    """
    # Checkpoints from before the decomposers were named so call them "a_owner"/"g_owner".
    a, g = (entry.get(f"{w}_decomposer", entry.get(f"{w}_owner")) for w in "ag")
    layer.set_placement(entry["owner"], a, g)
    layer.ever_captured = bool(entry.get("ever_captured", False))
    # Checkpoints from before ever_seen: a captured layer was seen.
    layer.ever_seen = bool(entry.get("ever_seen", layer.ever_captured))
    layer.clear_pending()
    if held is None:
        return
    device = layer.helper.module.weight.device
    for which in FACTORS:
        state = layer.factors[which]
        state.running = _clone(entry[which], device) if held else None
        keep_decomp = held if decompositions is None else decompositions
        tensors = entry[f"{which}_decomp"] if keep_decomp else None
        state.decomposition = (
            None if tensors is None else method.from_tensors([_clone(t, device) for t in tensors])
        )
