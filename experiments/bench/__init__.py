"""Everything benchmark-only: the measurement entry point, its workers and the tables.

``python -m experiments.bench [overrides]`` is the Hydra entry point
(:mod:`~experiments.bench.run`, primary config ``conf/benchmark.yaml``) and
``python -m experiments.bench.tables NAME`` rewrites a table from saved rows
(:mod:`~experiments.bench.tables`). The rest is what they use:
:mod:`~experiments.bench.workloads` (the synthetic batches that turn a ``model``
config into a benchmark model, and rebuilding a row's model),
:mod:`~experiments.bench.measure` (the per-rank timing loop),
:mod:`~experiments.bench.convergence` (training runs through ``experiments.train``),
:mod:`~experiments.bench.fidelity` (the curvature-fidelity runs, ``table=fidelity``),
:mod:`~experiments.bench.factor_kernels` (the factor kernels' timings,
``table=factor_kernels``), :mod:`~experiments.bench.scale_sim` (ranks of jobs of
up to thousands of ranks simulated in one process against the cost model,
``table=scale_sim``), :mod:`~experiments.bench.fake_cuda` (the fake-CUDA harness
it and the tests run on), :mod:`~experiments.bench.launch` (local ranks through
torch's elastic launcher), :mod:`~experiments.bench.aggregate` (per-rank records
to one row), :mod:`~experiments.bench.predict` (rows against
:mod:`dpkfac.costmodel`), :mod:`~experiments.bench.plots` (figures),
:mod:`~experiments.bench.pages` (what every results page shares: the rows a table
uses, markdown, takeaway and footer; below every table module),
:mod:`~experiments.bench.results_index` (``results/README.md``),
:mod:`~experiments.bench.smoke` (the training presets' smoke status, read from a
JUnit report), :mod:`~experiments.bench.takeaways` (the tables' takeaways and the
README's headline) and :mod:`~experiments.bench.gpu_report` (``make gpu-report``).
"""

from __future__ import annotations
