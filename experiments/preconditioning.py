"""From a ``strategy`` config node to a preconditioner, for both entry points.

A node of the ``strategy`` group (``conf/strategy/*.yaml``) names itself
(``name``: how runs, rows, tables and logs call it), the distribution scheme
(``algorithm``: a key of :data:`dpkfac.strategies.STRATEGIES`) and every other
keyword argument of :class:`dpkfac.KFACPreconditioner`. The first-order
baseline (``strategy=none``) has no ``_target_``. Training instantiates the node
(its ``_target_`` is :func:`build_preconditioner`); the benchmark ships
:func:`preconditioner_kwargs` to its ranks and records them in its rows. Either
way the preconditioner is ``KFACPreconditioner(model, strategy=<algorithm>, **rest)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn

if TYPE_CHECKING:
    from dpkfac import KFACPreconditioner

#: Keys of a strategy node that are not preconditioner arguments.
NODE_KEYS = ("_target_", "name", "algorithm")
#: Options given as dtype names in a config ("float32") and as torch dtypes to the library.
DTYPE_OPTIONS = ("factor_dtype", "decomposition_dtype")
#: The update intervals: null in a strategy node means not set there, and is not passed on,
#: so the entry point decides (training: the library's default or the experiment preset's
#: value; the benchmark: its setting's, see :func:`experiments.config.check_update_intervals`).
UPDATE_INTERVALS = ("factor_update_steps", "inv_update_steps")


def uses_preconditioner(node: Mapping[str, Any] | DictConfig) -> bool:
    """Whether a strategy node configures a preconditioner (``strategy=none`` does not)."""
    return node.get("_target_") is not None


def strategy_name(node: Mapping[str, Any] | DictConfig) -> str:
    """The config's name (``dp_kfac_owner``, ``none``, ...) as runs and rows report it."""
    return str(node.get("name") or "none")


def to_dtype(key: str, value: Any) -> Any:
    """A dtype option's value as the library takes it (``"bfloat16"`` -> ``torch.bfloat16``).

    Anything that is not the name of a torch dtype is passed on unchanged, for
    the library's options to reject with its own message.
    """
    if key in DTYPE_OPTIONS and isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."), None)
        return dtype if isinstance(dtype, torch.dtype) else value
    return value


def node_options(node: Mapping[str, Any] | DictConfig) -> dict[str, Any]:
    """The node's preconditioner arguments as plain values, without ``strategy``.

    Schedules (``_target_`` nodes under e.g. ``damping``) are kept as config
    nodes: they are instantiated by whoever builds the preconditioner. Update
    intervals left null (:data:`UPDATE_INTERVALS`) are not arguments.
    """
    options: dict[str, Any] = {}
    for key in node:
        key = str(key)
        value = node[key]
        if key in NODE_KEYS or (key in UPDATE_INTERVALS and value is None):
            continue
        if isinstance(value, DictConfig | Mapping) and "_target_" in value:
            options[key] = value
        elif isinstance(value, DictConfig | ListConfig):
            options[key] = OmegaConf.to_container(value, resolve=True)
        else:
            options[key] = to_dtype(key, value)
    return options


def preconditioner_kwargs(node: Mapping[str, Any] | DictConfig) -> dict[str, Any] | None:
    """``KFACPreconditioner`` keyword arguments of a strategy node (None for first order).

    ``strategy`` is the node's ``algorithm``; the ``model`` (and, where the
    caller decides them, ``lr`` and the update intervals) are added by the caller.
    """
    if not uses_preconditioner(node):
        return None
    return {"strategy": str(node["algorithm"]), **node_options(node)}


def split_options(kwargs: Mapping[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """Preconditioner arguments (with ``strategy``) split as the library splits them: the
    strategy's name, the common options (:class:`dpkfac.options.KFACOptions` fields, dtypes
    as torch's) and the strategy's own options. Private keys (``_target_``) are not options.
    """
    from dataclasses import fields

    from dpkfac.options import KFACOptions

    values = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    if "strategy" not in values:
        raise ValueError(f"preconditioner arguments {sorted(values)} name no strategy")
    name = str(values.pop("strategy"))
    known = {f.name for f in fields(KFACOptions)}
    common = {k: to_dtype(k, values.pop(k)) for k in list(values) if k in known}
    return name, common, values


def with_schedules(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Preconditioner arguments (:func:`preconditioner_kwargs`, as the benchmark ships them to
    its ranks) with their schedule nodes (``_target_``) instantiated."""
    from hydra.utils import instantiate

    return {
        key: instantiate(value) if isinstance(value, Mapping) and "_target_" in value else value
        for key, value in kwargs.items()
    }


def build_preconditioner(
    model: nn.Module, *, algorithm: str, name: str | None = None, **kwargs: Any
) -> KFACPreconditioner:
    """``dpkfac.KFACPreconditioner(model, strategy=algorithm, **kwargs)``: the group's ``_target_``.

    Args:
        model: The network to precondition.
        algorithm: The distribution scheme (``dp_kfac``, ``d_kfac``, ``spd_kfac``).
        name: The config's name; a label for runs and rows, not an argument.
        **kwargs: Every other preconditioner argument (dtype names are accepted;
            an update interval left null is not passed, the library's default applies).
    """
    from dpkfac import KFACPreconditioner

    del name  # a label: the preconditioner knows the scheme, not the config
    kwargs = {
        key: to_dtype(key, value)
        for key, value in kwargs.items()
        if not (key in UPDATE_INTERVALS and value is None)
    }
    return KFACPreconditioner(model, strategy=algorithm, **kwargs)
