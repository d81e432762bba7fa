"""Checkpoint entries of one K-FAC layer: factors, decompositions and placement.

Kept apart from the step loop so the preconditioner's ``state_dict`` only
decides *which* rank's entries to keep; the per-layer format lives here.
"""

from __future__ import annotations

from typing import Any

import torch

from dpkfac.curvature.decomposition import Decomposition
from dpkfac.curvature.layer import KFACLayer


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _tensors(dec: Decomposition | None) -> list[torch.Tensor] | None:
    return None if dec is None else [t.detach().clone() for t in dec.tensors()]


def layer_state(layer: KFACLayer, *, held: bool = True) -> dict[str, Any]:
    """A layer's checkpoint entry; with ``held=False`` only its placement."""
    return {
        "A": _clone(layer.a_factor) if held else None,
        "G": _clone(layer.g_factor) if held else None,
        "A_decomp": _tensors(layer.a_decomp) if held else None,
        "G_decomp": _tensors(layer.g_decomp) if held else None,
        "owner": layer.owner,
        "a_owner": layer.a_owner,
        "g_owner": layer.g_owner,
        "ever_captured": layer.ever_captured,
    }


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
    layer.owner, layer.a_owner, layer.g_owner = entry["owner"], entry["a_owner"], entry["g_owner"]
    layer.ever_captured = bool(entry.get("ever_captured", False))
    layer.clear_pending()
    if held is None:
        return
    layer.a_factor = _clone(entry["A"]) if held else None
    layer.g_factor = _clone(entry["G"]) if held else None
    decs = []
    for key in ("A_decomp", "G_decomp"):
        tensors = entry[key] if held else None
        decs.append(None if tensors is None else method.from_tensors([_clone(t) for t in tensors]))
    layer.a_decomp, layer.g_decomp = decs
