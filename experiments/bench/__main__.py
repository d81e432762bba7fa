"""``python -m experiments.bench [overrides]``: the benchmark's Hydra entry point.

See :mod:`experiments.bench.run`.
"""

from experiments.bench.run import main

if __name__ == "__main__":
    main()
