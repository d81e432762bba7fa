"""Cost model of distributed K-FAC: exact bytes and memory, modelled seconds.

From layer shapes, the world size, a network alpha-beta model and a device's
matmul and decomposition rates, :func:`predict` gives per strategy
(``dp-kfac``, ``d-kfac``, ``spd-kfac``) and for plain data parallelism
(:func:`predict_sgd`):

* the bytes, calls and wire bytes per collective category that
  :meth:`dpkfac.KFACPreconditioner.comm_stats` reports (exactly: the same
  placement, fusion and bucket rules are replayed);
* :meth:`~dpkfac.KFACPreconditioner.memory_usage` of every rank (exactly);
* seconds per phase (the ``timings()`` keys) per rank, and the iteration as
  a critical path through the step's synchronisation points.

:func:`calibrate` fits a :class:`Hardware` model to measurements (bytes or
flops against seconds); :data:`PRESETS` holds the papers' 64-GPU cluster
(estimates with sources) and this machine (measured). :func:`predicted_table`
builds the DP-KFAC paper's table; ``python -m dpkfac.costmodel`` prints it.

Layout: ``hardware`` (models, fitting), ``presets``, ``shapes`` (what a
model contributes, :func:`shapes_from_model`), ``zoo`` (analytic ResNet-50,
BERT, Transformer), ``traffic`` (collectives and memory, exact),
``predict`` (timing), ``table``, ``calibration`` (local micro-benchmarks).
"""

from __future__ import annotations

from dpkfac.costmodel.calibration import calibrate_local
from dpkfac.costmodel.hardware import (
    Engine,
    Hardware,
    Link,
    Sample,
    Work,
    calibrate,
    nnls,
    scaled,
    wire_bytes,
)
from dpkfac.costmodel.predict import Prediction, StepPrediction, predict, predict_sgd
from dpkfac.costmodel.presets import PRESETS
from dpkfac.costmodel.shapes import ModelShapes, as_model_shapes, shapes_from_model
from dpkfac.costmodel.table import VARIANTS, format_table, predicted_table
from dpkfac.costmodel.traffic import Collective, Placement, comm_counts
from dpkfac.costmodel.zoo import PAPER_MODELS, bert_qa, resnet50, transformer

__all__ = [
    "PAPER_MODELS",
    "PRESETS",
    "VARIANTS",
    "Collective",
    "Engine",
    "Hardware",
    "Link",
    "ModelShapes",
    "Placement",
    "Prediction",
    "Sample",
    "StepPrediction",
    "Work",
    "as_model_shapes",
    "bert_qa",
    "calibrate",
    "calibrate_local",
    "comm_counts",
    "format_table",
    "nnls",
    "predict",
    "predict_sgd",
    "predicted_table",
    "resnet50",
    "scaled",
    "shapes_from_model",
    "transformer",
    "wire_bytes",
]
