"""Measurement side of the project: per-rank benchmark workers, launching and tables' helpers.

``experiments.benchmark`` is the Hydra entry point and ``experiments.tables``
writes the tables; this package holds what they use:
:mod:`~experiments.bench.models` (the synthetic batches that turn a ``model``
config into a benchmark model, and rebuilding a row's model),
:mod:`~experiments.bench.measure` (the per-rank timing loop),
:mod:`~experiments.bench.convergence` (training runs through ``experiments.train``),
:mod:`~experiments.bench.launch` (local ranks through torch's elastic
launcher), :mod:`~experiments.bench.aggregate` (per-rank records to one row),
:mod:`~experiments.bench.predict` (rows against :mod:`dpkfac.costmodel`),
:mod:`~experiments.bench.plots` (figures) and :mod:`~experiments.bench.smoke`
(the training presets' smoke status).
"""

from __future__ import annotations
