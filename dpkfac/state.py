"""The preconditioner's checkpoint: what ``state_dict()`` writes and ``load_state_dict()`` reads.

A rank holds only part of the curvature state under some strategies
(dp_kfac and grouped: the owners' factors; kaisa with f < 1 and grouped: the
gradient workers' decompositions), so saving is a collective there and rank 0
receives the whole. Loading is where a run resumes bitwise, or, from a state
of another world size (an elastic restart), continues from rank 0's complete
factors with the layers placed again at the next step. The per-layer entries
are :mod:`dpkfac.curvature.state`'s; this module is the whole run's header,
the gathering and the resize rule, handed the layers, the strategy and the
communicator by the preconditioner above it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dpkfac.comm import Communicator
from dpkfac.curvature import KFACLayer
from dpkfac.curvature.decomposition import Decomposition
from dpkfac.curvature.layer import FACTORS
from dpkfac.curvature.state import layer_state, load_layer_state, merge_layer_states
from dpkfac.plan import StrategyOptions, name_key
from dpkfac.strategies import Strategy
from dpkfac.strategies.base import layer_shape

__all__ = ["Loaded", "held", "load_state", "save_state"]


def held(layer: KFACLayer, strategy: Strategy) -> dict[str, bool]:
    """What this rank holds of a layer: its factors where it captures the layer, its
    decompositions there and where it preconditions the layer (a gradient worker)."""
    captures = strategy.captures(layer)
    return {"held": captures, "decompositions": captures or strategy.preconditions(layer)}


def save_state(
    layers: Sequence[KFACLayer],
    strategy: Strategy,
    comm: Communicator,
    *,
    steps: int,
    strategy_name: str,
    compute_method: str,
) -> dict[str, Any]:
    """``KFACPreconditioner.state_dict()``: a collective where the ranks' states differ
    (see its docstring); rank 0 receives the complete state."""
    # Lazily synchronised factors differ between ranks until averaged: a
    # checkpoint holds their average (a collective then, on every rank).
    strategy.sync_factors(layers)
    entries = {x.name: layer_state(x, **held(x, strategy)) for x in layers}
    if comm.active and not strategy.replicated_state:
        parts = comm.gather_objects(entries, dst=0)
        for part in parts or []:
            for name, entry in part.items():
                entries[name] = merge_layer_states(entries[name], entry)
    return {
        "steps": steps,
        "strategy": strategy_name,
        "compute_method": compute_method,
        "world_size": comm.size,
        "placed": strategy.placed,
        "layers": entries,
        "strategy_state": strategy.state_dict(),
    }


@dataclass(frozen=True)
class Loaded:
    """What a loaded state tells the step loop.

    Attributes:
        steps: the step counter to continue from.
        resized: the state was saved by another number of ranks.
        decompose_next: (resized only) the state lacks a decomposition of a held factor:
            the next step decomposes, whatever its schedule says.
    """

    steps: int
    resized: bool
    decompose_next: bool


def load_state(
    state: dict[str, Any],
    layers: Mapping[str, KFACLayer],
    strategy: Strategy,
    *,
    world_size: int,
    method: type[Decomposition],
    strategy_name: str,
    compute_method: str,
    given: StrategyOptions,
    allow_world_size_change: bool,
) -> Loaded:
    """``KFACPreconditioner.load_state_dict()`` (see its docstring for the rules).

    Raises:
        ValueError: another strategy or compute method, another world size
            without ``allow_world_size_change``, or layers this model lacks.
    """
    saved = dict(state)
    if isinstance(saved.get("strategy"), str):  # checkpoints of another spelling
        saved["strategy"] = name_key(saved["strategy"])
    for key, mine in (("strategy", strategy_name), ("compute_method", compute_method)):
        if saved.get(key) != mine:
            raise ValueError(
                f"checkpoint was saved with {key}={saved.get(key)!r} but this preconditioner "
                f"has {key}={mine!r}"
            )
    resized = saved.get("world_size") != world_size
    if resized and not allow_world_size_change:
        raise ValueError(
            f"checkpoint was saved with world_size={saved.get('world_size')!r} but this "
            f"preconditioner has world_size={world_size!r} (pass "
            "allow_world_size_change=True to continue without a bitwise guarantee)"
        )
    missing = sorted(set(state["layers"]) - set(layers))
    if missing:
        raise ValueError(f"checkpoint has K-FAC layers this model lacks: {missing}")
    steps = int(state["steps"])
    entries = {n: e for n, e in state["layers"].items() if n in layers}
    ordered = list(layers.values())
    if resized:
        decompose_next = _load_resized(
            entries, layers, strategy, method, given, saved.get("world_size"), world_size
        )
        return Loaded(steps, resized=True, decompose_next=decompose_next)
    strategy.placed = bool(state["placed"])
    strategy.load_state_dict(state.get("strategy_state", {}))
    for name, entry in entries.items():  # placement first: it decides what is held
        load_layer_state(layers[name], entry, method, held=None)
    strategy.restore(ordered, given=given)
    for name, entry in entries.items():
        layer = layers[name]
        load_layer_state(layer, entry, method, **held(layer, strategy))
    return Loaded(steps, resized=False, decompose_next=False)


def _load_resized(
    entries: dict[str, dict[str, Any]],
    layers: Mapping[str, KFACLayer],
    strategy: Strategy,
    method: type[Decomposition],
    given: StrategyOptions,
    saved_size: Any,
    world_size: int,
) -> bool:
    """Load layer entries saved by another number of ranks; whether a held factor lacks
    its decomposition (then the next step decomposes)."""
    # The saved owners may not exist here: place with nominal shapes now (every
    # rank captures every layer until the first step places with measured ones).
    ordered = list(layers.values())
    strategy.placed = False
    strategy.place(ordered, [layer_shape(x, 1, 1) for x in ordered], given=given)
    for name, entry in entries.items():
        layer = layers[name]
        here = {
            **entry,
            "owner": layer.owner,
            "a_decomposer": layer.factors["A"].decomposer,
            "g_decomposer": layer.factors["G"].decomposer,
        }
        load_layer_state(layer, here, method, held=True)
    # Identical on every rank (they load the same state), so all agree on the step.
    decompose_next = any(
        entry[w] is not None and entry[f"{w}_decomp"] is None
        for entry in entries.values()
        for w in FACTORS
    )
    warnings.warn(
        f"dpkfac: checkpoint was saved with world_size={saved_size!r}, this preconditioner has "
        f"world_size={world_size}: continuing with the saved factors"
        + (
            " (the missing decompositions are computed at the next step)"
            if decompose_next
            else " and decompositions"
        )
        + "; layers are placed again at the next step, and the run is not a bitwise "
        "continuation",
        RuntimeWarning,
        # The user's pre.load_state_dict(): this function, load_state(), load_state_dict().
        stacklevel=4,
    )
    return decompose_next
