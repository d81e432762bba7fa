"""Distribution schemes behind one interface, looked up by name.

Every strategy has one name, spelled the same in Python, Hydra (``strategy=``),
the command line, tables and W&B: ``dp_kfac``, ``d_kfac``, ``spd_kfac``,
``kaisa`` and ``grouped`` (the space between them). The
hyphenated spellings of the papers (``dp-kfac``, ...) are accepted as input
and normalised by :func:`canonical_name`; nothing is ever written with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpkfac.options import StrategyOptions, make_options
from dpkfac.strategies.base import Preconditioned, Strategy, Traits
from dpkfac.strategies.d_kfac import DKFAC, DKFACOptions
from dpkfac.strategies.dp_kfac import DPKFAC, DPKFACOptions
from dpkfac.strategies.grouped import GroupedKFAC, GroupedOptions
from dpkfac.strategies.kaisa import KAISA, KAISAOptions
from dpkfac.strategies.spd_kfac import SPDKFAC, SPDKFACOptions

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (DPKFAC, DKFAC, SPDKFAC, KAISA, GroupedKFAC)
}


def canonical_name(name: str) -> str:
    """The registered spelling of a strategy name.

    Raises:
        ValueError: the name is not a registered strategy.
    """
    key = name.replace("-", "_") if isinstance(name, str) else name
    if key not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {sorted(STRATEGIES)}")
    return key


def strategy_class(name: str) -> type[Strategy]:
    """The strategy class registered under ``name`` (any accepted spelling)."""
    return STRATEGIES[canonical_name(name)]


def strategy_options(name: str, values: Mapping[str, Any] | None = None) -> StrategyOptions:
    """Validated options of strategy ``name`` from keyword arguments.

    Raises:
        ValueError: an unknown strategy, an unknown option or a bad value.
    """
    cls = strategy_class(name)
    return make_options(cls.Options, dict(values or {}), f"strategy {cls.name!r}")


__all__ = [
    "DKFAC",
    "DPKFAC",
    "KAISA",
    "SPDKFAC",
    "STRATEGIES",
    "DKFACOptions",
    "DPKFACOptions",
    "GroupedKFAC",
    "GroupedOptions",
    "KAISAOptions",
    "Preconditioned",
    "SPDKFACOptions",
    "Strategy",
    "Traits",
    "canonical_name",
    "strategy_class",
    "strategy_options",
]
