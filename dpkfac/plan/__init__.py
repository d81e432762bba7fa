"""The plan floor: who does what in a run, known before it starts, as pure data.

Nothing here communicates, times or touches a model: the modules import the
standard library only (torch appears nowhere on this floor). Above it, the
runtime strategies (:mod:`dpkfac.strategies`) execute a :class:`Plan` and the
cost model (:mod:`dpkfac.costmodel`) prices the same one.

* :mod:`~dpkfac.plan.options`: the base of every scheme's options and the
  step-dependent values;
* :mod:`~dpkfac.plan.assignment`, :mod:`~dpkfac.plan.fusion`: the load
  balancing and tensor-fusion rules;
* :mod:`~dpkfac.plan.hardware`, :mod:`~dpkfac.plan.presets`,
  :mod:`~dpkfac.plan.probes`: the hardware model, its presets and the sizes
  of the start-up measurements;
* :class:`Traits`, :class:`Plan`, :class:`Scheme` and one scheme per
  distribution scheme, registered here by name.

Every scheme has one name, spelled the same in Python, Hydra (``strategy=``),
the command line, tables and W&B: ``dp_kfac``, ``d_kfac``, ``spd_kfac``,
``kaisa`` and ``grouped``. The hyphenated spellings of the papers
(``dp-kfac``, ...) are accepted as input and normalised by
:func:`canonical_name`; nothing is ever written with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpkfac.plan.assignment import LayerShape, Placement
from dpkfac.plan.d_kfac import DKFACOptions, DKFACScheme
from dpkfac.plan.dp_kfac import DPKFACOptions, DPKFACScheme
from dpkfac.plan.grouped import GroupedOptions, GroupedScheme
from dpkfac.plan.kaisa import KAISAOptions, KAISAScheme
from dpkfac.plan.options import StrategyOptions, make_options
from dpkfac.plan.roles import Plan
from dpkfac.plan.scheme import Scheme, Tuning
from dpkfac.plan.spd_kfac import SPDKFACOptions, SPDKFACScheme
from dpkfac.plan.traits import Traits

__all__ = [
    "SCHEMES",
    "DKFACOptions",
    "DPKFACOptions",
    "GroupedOptions",
    "KAISAOptions",
    "LayerShape",
    "Placement",
    "Plan",
    "SPDKFACOptions",
    "Scheme",
    "StrategyOptions",
    "Traits",
    "Tuning",
    "canonical_name",
    "scheme_of",
    "scheme_options",
]

#: The registered schemes, by name, in the order tables list them.
SCHEMES: dict[str, type[Scheme]] = {
    cls.name: cls for cls in (DPKFACScheme, DKFACScheme, SPDKFACScheme, KAISAScheme, GroupedScheme)
}


def canonical_name(name: str) -> str:
    """The registered spelling of a strategy name.

    Raises:
        ValueError: the name is not a registered strategy.
    """
    key = name.replace("-", "_") if isinstance(name, str) else name
    if key not in SCHEMES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {sorted(SCHEMES)}")
    return key


def scheme_of(name: str) -> type[Scheme]:
    """The scheme registered under ``name`` (any accepted spelling)."""
    return SCHEMES[canonical_name(name)]


def scheme_options(
    name: str, values: Mapping[str, Any] | StrategyOptions | None = None
) -> StrategyOptions:
    """Validated options of strategy ``name``: its ``Options`` as given, or built from
    keyword arguments.

    Raises:
        ValueError: an unknown strategy, an unknown option or a bad value.
        TypeError: options of another strategy's class.
    """
    scheme = scheme_of(name)
    if isinstance(values, StrategyOptions):
        return scheme.check(values)
    return make_options(scheme.Options, dict(values or {}), f"strategy {scheme.name!r}")
