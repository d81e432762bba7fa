"""Placement: the strategy built at start-up, and "auto" resolved and layers placed at step one.

Two decisions are made before a run's curvature work starts, and neither
belongs to the step loop or to a strategy:

* :func:`build_strategy`, at construction: a scheme that places work by a
  hardware model (spd_kfac, grouped's "auto" without ``hardware=``) has it
  measured on the run's group first (a collective), then the runtime
  strategy is made;
* :func:`finalise_placement`, at the first ``step()``: the ranks agree on the
  shapes of the step's batch, options left to choose ("auto") are priced by
  the cost model's :func:`~dpkfac.costmodel.predict.choose_options` for exactly those
  shapes, the strategy is configured with the choice, and the layers are
  placed for good; each rank then drops what it built of layers others hold.

It sits below the preconditioner (which calls it) and beside the cost model
(which it calls), so the runtime and a prediction resolve "auto" the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

from dpkfac.comm import Communicator
from dpkfac.costmodel.auto import Candidate, log_choice
from dpkfac.costmodel.fitting import calibrate
from dpkfac.costmodel.predict import choose_options
from dpkfac.costmodel.shapes import ModelShapes, as_model_shapes
from dpkfac.costmodel.traffic import with_buckets
from dpkfac.curvature import KFACLayer
from dpkfac.curvature.decomposition import Decomposition
from dpkfac.options import KFACOptions
from dpkfac.plan import LayerShape, Scheme, StrategyOptions
from dpkfac.probes import start_up_hardware
from dpkfac.strategies import Strategy, strategy_class
from dpkfac.strategies.base import layer_shape

__all__ = ["build_strategy", "finalise_placement"]

log = logging.getLogger("dpkfac")


def build_strategy(
    scheme: type[Scheme],
    options: StrategyOptions,
    *,
    comm: Communicator,
    method: type[Decomposition],
    kfac: KFACOptions,
) -> Strategy:
    """The runtime strategy, once the start-up measurement its options ask for is done.

    The options the run was given decide its one-time setup (the caller keeps
    them); a hardware model the scheme places work by is measured now, on this
    group (a collective).
    """
    if scheme.measures_hardware(options):
        options = scheme.with_hardware(options, start_up_hardware(comm, calibrate))
    return strategy_class(scheme.name)(
        comm,
        method,
        options,
        decomposition_dtype=kfac.decomposition_dtype,
        bucket_cap_mb=kfac.bucket_cap_mb,
        kfac=kfac,
    )


#: "auto" resolved in this process, by its inputs (their reprs). Ranks that are threads
#: of one process (``launcher=threads``) resolve the same choice once instead of once
#: per rank: at P=256 one resolution priced every candidate for about 16 s, and 256
#: of them ran one after another before the first step. A process of its own per
#: rank (torchrun) resolves once either way.
_RESOLVED: dict[str, tuple[StrategyOptions, list[Candidate]]] = {}
_RESOLVED_MAX = 64


def _resolve_once(
    strategy: Strategy,
    shapes: ModelShapes,
    *,
    world_size: int,
    kfac: KFACOptions,
    overlap_installed: bool,
    ddp: bool,
) -> tuple[StrategyOptions, list[Candidate]]:
    """``choose_options`` for these inputs, computed once per process (copies handed out)."""
    scheme = strategy.scheme
    # ``lr`` is each rank's own callable (it reads that rank's optimizer), and the
    # cost model never reads it; every other option is part of the key.
    options = {f.name: getattr(kfac, f.name) for f in dataclasses.fields(kfac) if f.name != "lr"}
    key = repr(
        (
            scheme.name,
            strategy.options,
            shapes,  # its repr holds the parameters' order too
            world_size,
            options,
            overlap_installed,
            ddp,
        )
    )
    if key not in _RESOLVED:
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        _RESOLVED[key] = choose_options(
            scheme,
            strategy.options,
            shapes=shapes,
            world_size=world_size,
            kfac=kfac,
            allow=lambda c: overlap_installed or not scheme.traits(c).overlapped_precondition,
            ddp=ddp,
        )
    return copy.deepcopy(_RESOLVED[key])


def _model_shapes(
    layers: Sequence[KFACLayer],
    shapes: Sequence[LayerShape],
    parameters: Sequence[tuple[int, int]],
) -> ModelShapes:
    """The layers' shapes with the model's other trainable parameters, in model order (a
    layer has a bias where it holds two of them); the layers' alone without ``parameters``."""
    if not parameters:
        return as_model_shapes(shapes)
    held = Counter(i for i, _ in parameters)
    return replace(
        as_model_shapes(
            shapes,
            bias=[held[k] > 1 for k in range(len(layers))],
            other_params=[n for i, n in parameters if i < 0],
        ),
        order=tuple(parameters),
    )


def finalise_placement(
    layers: Sequence[KFACLayer],
    strategy: Strategy,
    *,
    comm: Communicator,
    kfac: KFACOptions,
    given: StrategyOptions,
    overlap_installed: bool,
    parameters: Sequence[tuple[int, int]] = (),
    ddp: bool = False,
) -> list[Candidate] | None:
    """Place layers from the first batch's shapes, agreed on by all ranks.

    Where options are left to choose ("auto"), the cost model resolves them
    first for these shapes, and the strategy is configured with the choice; a
    candidate that overlaps is allowed only where the overlapped mode's hooks
    were installed at construction (``overlap_installed``). The choice prices the
    whole model: ``parameters`` are its trainable parameters in ``model.parameters()``
    order, as (index of their K-FAC layer in ``layers`` or -1, elements), whose
    gradients the step reduces beside the layers'; ``ddp``: the model is DDP-wrapped.

    Returns:
        Every candidate "auto" priced, or None where the strategy was already
        configured (nothing was resolved now).
    """
    stats = [float(v) for x in layers for v in (x.batch_size, x.positions)]
    if strategy.scheme.placement_uses_batch(given):
        stats = comm.agree_max(stats)
    # A step's batch is its k micro-batches: placing by one micro-batch would
    # place (and so precondition) an accumulated run unlike the same batch in one.
    k = kfac.accumulation_steps
    shapes = [
        layer_shape(x, k * int(stats[2 * i]), int(stats[2 * i + 1])) for i, x in enumerate(layers)
    ]
    model = _model_shapes(layers, shapes, parameters)
    # Each layer's backward bucket, as the overlapped mode cuts them: dp_kfac's placement
    # balances every bucket's updates (the cost model places its candidates alike).
    itemsize = next((p.element_size() for x in layers for p in x.helper.parameters()), 4)
    shapes = with_buckets(
        shapes, model, itemsize=itemsize, cap_bytes=kfac.bucket_cap_bytes, ddp=ddp
    )
    choice = None
    if not strategy.configured:
        chosen, choice = _resolve_once(
            strategy,
            model,
            world_size=comm.size,
            kfac=kfac,
            overlap_installed=overlap_installed,
            ddp=ddp,
        )
        strategy.configure(chosen)
        log_choice(strategy.scheme, comm.size, chosen, choice)
    strategy.place(layers, shapes, final=True, given=given)
    if comm.rank == 0 and comm.size > 1:
        for x in layers:
            log.info(
                "placed %s: owner rank %d, A decomposed by %s, G by %s",
                x.name,
                x.owner,
                x.a_decomposer,
                x.g_decomposer,
            )
    for layer in layers:
        if not strategy.captures(layer):
            # Another rank holds this layer: drop what was built here, and what a
            # checkpoint of another world size gave every rank (dp_kfac's factors).
            layer.clear_pending()
            keep_decompositions = strategy.preconditions(layer)
            for state in layer.factors.values():
                state.running = None
                if not keep_decompositions:  # a gradient worker keeps them
                    state.decomposition = None
    return choice
