"""The runtime strategies: each executes its scheme's plan over a communicator.

The pure half of every scheme (options, traits, placement, roles) lives on
the plan floor (:mod:`dpkfac.plan`), registered there by name; this package
maps each name to the class that runs it. Names are those of
:func:`dpkfac.plan.canonical_name`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from dpkfac.plan import SCHEMES, StrategyOptions, Traits, canonical_name, scheme_options
from dpkfac.strategies.base import Preconditioned, Strategy
from dpkfac.strategies.d_kfac import DKFAC, DKFACOptions
from dpkfac.strategies.dp_kfac import DPKFAC, DPKFACOptions
from dpkfac.strategies.grouped import GroupedKFAC, GroupedOptions
from dpkfac.strategies.kaisa import KAISA, KAISAOptions
from dpkfac.strategies.spd_kfac import SPDKFAC, SPDKFACOptions

#: The runtime class of every registered scheme, by name. A scheme whose traits and roles say
#: all it does needs none of its own: :func:`strategy_class` runs it on the base strategy.
STRATEGIES: dict[str, type[Strategy]] = {
    cls.scheme.name: cls for cls in (DPKFAC, DKFAC, SPDKFAC, KAISA, GroupedKFAC)
}
assert list(STRATEGIES) == list(SCHEMES), "every built-in scheme has one runtime class"


def strategy_class(name: str) -> type[Strategy]:
    """The runtime class of strategy ``name`` (any accepted spelling): its own, or for a
    scheme without one the base strategy bound to it, made once."""
    key = canonical_name(name)
    if key not in STRATEGIES:
        scheme = SCHEMES[key]
        doc = f"{key}: the base strategy, running the plan of {scheme.__name__}."
        made = type(f"{scheme.__name__}Strategy", (Strategy,), {"scheme": scheme, "__doc__": doc})
        STRATEGIES[key] = made
    return STRATEGIES[key]


def strategy_options(
    name: str,
    values: Mapping[str, Any] | StrategyOptions | None = None,
    *,
    common: Collection[str] = (),
) -> StrategyOptions:
    """Validated options of strategy ``name`` (see :func:`dpkfac.plan.scheme_options`)."""
    return scheme_options(name, values, common=common)


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
