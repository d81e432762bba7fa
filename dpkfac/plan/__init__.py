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
* :mod:`~dpkfac.plan.configs`: the named configurations of the schemes
  (``dp_kfac_owner``, ``kaisa_mem_opt``, ...), their one list;
* :class:`Traits`, :class:`Plan`, :class:`Scheme` and one scheme per
  distribution scheme, registered here by name.

Every scheme has one name, spelled the same in Python, Hydra (``strategy=``),
the command line, tables and W&B: ``dp_kfac``, ``d_kfac``, ``spd_kfac``,
``kaisa`` and ``grouped``. As input a name is read in any case and with ``-``
for ``_`` (the papers' ``DP-KFAC``, ``dp-kfac``): :func:`name_key` is that
rule, :func:`canonical_name` applies it and checks the name; nothing is ever
written in another spelling.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Mapping
from typing import Any

from dpkfac.plan.assignment import LayerShape, Placement
from dpkfac.plan.d_kfac import DKFACOptions, DKFACScheme
from dpkfac.plan.dp_kfac import DPKFACOptions, DPKFACScheme
from dpkfac.plan.grouped import GroupedOptions, GroupedScheme
from dpkfac.plan.kaisa import KAISAOptions, KAISAScheme
from dpkfac.plan.options import StrategyOptions, did_you_mean, make_options
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
    "name_key",
    "scheme_of",
    "scheme_options",
]

#: The registered schemes, by name, in the order tables list them; a scheme of another
#: module of this package joins when its name is first asked for (:func:`canonical_name`).
SCHEMES: dict[str, type[Scheme]] = {
    cls.name: cls for cls in (DPKFACScheme, DKFACScheme, SPDKFACScheme, KAISAScheme, GroupedScheme)
}


def _load(key: str) -> type[Scheme] | None:
    """The scheme named ``key`` from its own module, ``dpkfac/plan/<key>.py``, registered once
    found (None: no such module, or no scheme of that name in it).

    A new scheme is its module alone: the first question about its name imports it, so no
    list elsewhere has to name it (the configurations name it in ``CONFIGS``).
    """
    if not key.isidentifier() or key.startswith("_"):  # a module name, never a private one
        return None
    try:
        module = importlib.import_module(f"{__name__}.{key}")
    except ModuleNotFoundError as err:
        if err.name == f"{__name__}.{key}":
            return None
        raise
    for value in vars(module).values():
        if isinstance(value, type) and issubclass(value, Scheme) and value.name == key:
            SCHEMES[key] = value
            return value
    return None


def name_key(name: str) -> str:
    """A strategy name as registered spellings are written: lower case, ``_`` for ``-``.

    The one home of the spelling rule. Names come from papers (``DP-KFAC``,
    ``dp-kfac``), configs and old checkpoints; reading them all alike means
    no spelling is refused for its case or its dash.
    """
    return name.lower().replace("-", "_")


def canonical_name(name: str) -> str:
    """The registered spelling of a strategy name given in any accepted spelling.

    Raises:
        ValueError: the name is not a registered strategy (with the closest one).
    """
    key = name_key(name) if isinstance(name, str) else name
    if key not in SCHEMES and (not isinstance(key, str) or _load(key) is None):
        hint = did_you_mean([key], SCHEMES) if isinstance(key, str) else ""
        expected = "Expected" if hint else "expected"
        raise ValueError(
            f"unknown strategy {name!r};{hint} {expected} one of {sorted(SCHEMES)}, in any case, "
            "with '-' or '_'"
        )
    return key


def scheme_of(name: str) -> type[Scheme]:
    """The scheme registered under ``name`` (any accepted spelling)."""
    return SCHEMES[canonical_name(name)]


def scheme_options(
    name: str,
    values: Mapping[str, Any] | StrategyOptions | None = None,
    *,
    common: Collection[str] = (),
) -> StrategyOptions:
    """Validated options of strategy ``name``: its ``Options`` as given, or built from
    keyword arguments.

    ``common``: the names the caller accepts beside the strategy's own (the
    preconditioner's common options), named in the message for an unknown
    key (:func:`~dpkfac.plan.options.make_options`).

    Raises:
        ValueError: an unknown strategy, an unknown option or a bad value.
        TypeError: options of another strategy's class.
    """
    scheme = scheme_of(name)
    if isinstance(values, StrategyOptions):
        return scheme.check(values)
    return make_options(
        scheme.Options, dict(values or {}), f"strategy {scheme.name!r}", common=common
    )
