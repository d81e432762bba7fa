"""Cost model of distributed K-FAC: exact bytes and memory, modelled seconds.

From layer shapes, the world size, the preconditioner's own option
dataclasses (:class:`~dpkfac.options.KFACOptions` and the strategy's
options), a network alpha-beta model and a device's matmul and
decomposition rates, :func:`predict` gives per strategy (any registered
one: it is priced through its class's traits and placement, never by name)
and for plain data parallelism (``strategy=None``, :func:`predict_sgd`):

* the bytes, calls and wire bytes per collective category that
  :meth:`dpkfac.KFACPreconditioner.comm_stats` reports (exactly: the same
  placement, fusion and bucket rules are replayed);
* :meth:`~dpkfac.KFACPreconditioner.memory_usage` of every rank (exactly), and
  with :mod:`~dpkfac.costmodel.memory` the whole process's tally
  (:func:`dpkfac.process_memory`, exactly) plus an activation estimate;
* seconds per phase (the ``timings()`` keys) per rank, and the iteration as
  a critical path through the step's synchronisation points.

:func:`calibrate` fits a :class:`Hardware` model to samples (bytes or
flops against seconds); :func:`fit` fits one to measured runs
(:class:`Measurement`); :data:`PRESETS` holds the papers' 64-GPU cluster
(estimates with sources) and this machine (measured). :func:`predicted_table`
prices every configuration on the papers' models; ``python -m dpkfac.costmodel`` prints it,
and ``python -m dpkfac.costmodel balance`` the load balance of DP-KFAC's
layer assignments on the same models.

Layout: ``shapes`` (what a model contributes, :func:`shapes_from_model`),
``zoo`` (analytic ResNet-50, BERT, Transformer), ``traffic`` (collectives
and memory, exact), ``timing`` (work per phase, critical path), ``predict`` and
``auto`` (:func:`choose_options`: "auto" priced candidate by candidate), ``table``,
``balance``, ``calibration`` (local micro-benchmarks), ``fitting`` (hardware
from samples, :func:`calibrate` by :func:`nnls`, and from measured runs). The
hardware model, its presets and the plans it prices live on the plan floor
(:mod:`dpkfac.plan`); this package reads the same :class:`~dpkfac.plan.Plan`
the runtime executes.
"""

from __future__ import annotations

from dpkfac.costmodel.balance import balance_rows
from dpkfac.costmodel.calibration import calibrate_local
from dpkfac.costmodel.fitting import Measurement, Regime, calibrate, fit, nnls, predict_measurement
from dpkfac.costmodel.memory import OPTIMIZER_STATE, predict_process_memory
from dpkfac.costmodel.predict import (
    Prediction,
    StepPrediction,
    choose_options,
    predict,
    predict_sgd,
)
from dpkfac.costmodel.shapes import ModelShapes, shapes_from_model
from dpkfac.costmodel.table import format_table, predicted_table
from dpkfac.costmodel.timing import owner_seconds, seconds_cost
from dpkfac.costmodel.zoo import PAPER_MODELS, bert_qa, resnet50, transformer
from dpkfac.plan.hardware import Engine, Hardware, Link, Sample, scaled
from dpkfac.plan.presets import PRESETS

__all__ = [
    "OPTIMIZER_STATE",
    "PAPER_MODELS",
    "PRESETS",
    "Engine",
    "Hardware",
    "Link",
    "Measurement",
    "ModelShapes",
    "Prediction",
    "Regime",
    "Sample",
    "StepPrediction",
    "balance_rows",
    "bert_qa",
    "calibrate",
    "calibrate_local",
    "choose_options",
    "fit",
    "format_table",
    "nnls",
    "owner_seconds",
    "predict",
    "predict_measurement",
    "predict_process_memory",
    "predict_sgd",
    "predicted_table",
    "resnet50",
    "scaled",
    "seconds_cost",
    "shapes_from_model",
    "transformer",
]
