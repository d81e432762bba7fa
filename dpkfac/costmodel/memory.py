"""Whole-process memory predicted from shapes: the runtime's tally, and an activation estimate.

:func:`predict_process_memory` predicts :func:`dpkfac.memory.process_memory`
field by field, exactly (``tests/test_process_memory.py`` compares them byte
for byte on real models):

* parameters and gradients: every trainable parameter
  (:attr:`ModelShapes.num_params`) times the parameters' itemsize, once each;
* the optimizer's state, by kind (:data:`OPTIMIZER_STATE`): ``"none"`` (or
  SGD without momentum) holds nothing, ``"sgd_momentum"`` one momentum buffer
  per parameter, ``"adamw"`` (and Adam) two moments per parameter plus one
  float32 ``step`` scalar per parameter tensor (torch keeps ``step`` as a
  tensor; it is 4 bytes a tensor, whatever the parameters' dtype);
* module buffers: :attr:`ModelShapes.buffer_bytes`, as
  :func:`~dpkfac.costmodel.shapes.shapes_from_model` read them (0 for the
  analytic zoo, which does not write them down);
* K-FAC state: one rank's ``Prediction.memory`` entry (the same
  ``memory_usage()`` the runtime reports; the busiest rank by default).

Frozen parameters are not in :class:`ModelShapes` (it describes the
trainable ones), so a model with frozen parameters holds more than predicted.

:func:`activation_bytes` is an *estimate*, kept apart because no tally can
check it: see its docstring for what it counts and what it leaves out.
"""

from __future__ import annotations

from collections.abc import Mapping

from dpkfac.costmodel.optimizers import OPTIMIZER_STATE, check_optimizer
from dpkfac.costmodel.predict import Prediction
from dpkfac.costmodel.shapes import ModelShapes
from dpkfac.memory import ProcessMemory

__all__ = [
    "OPTIMIZER_STATE",
    "activation_bytes",
    "predict_process_memory",
    "process_memory_of",
]

#: Bytes of the ``step`` scalar torch's Adam and AdamW keep per parameter tensor (float32).
_STEP_BYTES = 4


def predict_process_memory(
    shapes: ModelShapes,
    kfac_memory: Mapping[str, int] | None,
    *,
    optimizer: str,
    param_itemsize: int = 4,
) -> ProcessMemory:
    """The tally :func:`dpkfac.memory.process_memory` reports, from shapes (see the module
    docstring for each field).

    Args:
        kfac_memory: one rank's K-FAC memory (``Prediction.memory[rank]``);
            None without a preconditioner.
        optimizer: a key of :data:`OPTIMIZER_STATE` (explicit: the optimizer
            is no part of the K-FAC prediction); an unknown one raises ValueError.
    """
    per_param, steps = check_optimizer(optimizer)
    params = shapes.num_params * param_itemsize
    return ProcessMemory.with_kfac(
        kfac_memory,
        parameters=params,
        gradients=params,
        optimizer=per_param * params + steps * _STEP_BYTES * len(shapes.param_order()),
        module_buffers=shapes.buffer_bytes,
    )


def process_memory_of(
    prediction: Prediction,
    shapes: ModelShapes,
    *,
    optimizer: str,
    param_itemsize: int = 4,
    rank: int | None = None,
) -> ProcessMemory:
    """:func:`predict_process_memory` of one rank of a prediction (None: the busiest rank).

    Every rank holds the same parameters, gradients, optimizer state and
    buffers, so the busiest rank is the one with the most K-FAC state.
    """
    if rank is None:
        rank = max(range(len(prediction.memory)), key=lambda r: sum(prediction.memory[r].values()))
    return predict_process_memory(
        shapes,
        prediction.memory[rank] if prediction.strategy is not None else None,
        optimizer=optimizer,
        param_itemsize=param_itemsize,
    )


def activation_bytes(shapes: ModelShapes, itemsize: int = 4) -> int:
    """An estimate of the activations one step saves for backward, in bytes.

    Counted: for every captured K-FAC layer, the input it saves for its
    weight gradient (for a Conv2d the input map ``N x C_in x H_in x W_in``,
    not the im2col'd ``N x T x a_dim`` the factor is built from) and its
    output, which the following normalisation or nonlinearity saves, both
    times ``itemsize`` (activations in the parameters' dtype). A tensor that
    several layers read (Q, K and V's shared input, a block input feeding a
    convolution and its downsample) is counted once (:attr:`ModelShapes.saved`).

    Not counted, so the estimate is a lower bound: what layers outside K-FAC
    save on top, i.e. normalisation outputs not fed straight to a K-FAC layer,
    pooling inputs and indices (ResNet's stem max-pool), attention scores and
    their softmax and dropout masks (``N x heads x T x T`` per attention layer,
    of the order of what is counted at BERT's T = 384), dropout and ReLU
    masks, embeddings' outputs and the loss's logits; nor the autograd
    graph's bookkeeping or the allocator's fragmentation.

    Raises:
        ValueError: shapes without the saved sizes (the analytic zoo: build
            the shapes with :func:`~dpkfac.costmodel.shapes_from_model`, which
            works on the ``meta`` device at any size).
    """
    if not shapes.saved:
        raise ValueError(
            "these shapes carry no saved-activation sizes; build them with shapes_from_model"
        )
    elements = sum(
        s.batch_size * (x + y)
        for s, (x, y), captured in zip(shapes.layers, shapes.saved, shapes.captured, strict=True)
        if captured
    )
    return elements * itemsize
