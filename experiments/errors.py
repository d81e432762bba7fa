"""The experiments layer's one error type for mistakes the user fixes (a leaf module).

It lives apart from :mod:`experiments.config` so that modules the configuration itself
reaches (the launchers, the emulated network) can raise it without importing the config.
"""

from __future__ import annotations


class ExperimentError(Exception):
    """A mistake in the configuration, the data or a checkpoint.

    The entry points print these as one line and exit with status 2 instead of
    showing a traceback: they are the user's to fix, not the code's.
    """
