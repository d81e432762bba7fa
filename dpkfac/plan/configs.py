"""Named strategy configurations: the one list of them, in the papers' order.

A configuration is a scheme (:data:`dpkfac.plan.SCHEMES`) with some of its options
set, under one name spelled the same everywhere: ``KFACPreconditioner(model,
strategy="dp_kfac_owner")``, ``python -m dpkfac.costmodel table --strategies
dp_kfac_owner``, Hydra's ``strategy=dp_kfac_owner`` (conf/strategy/NAME.yaml, which
sets the same options with its comments; tests/test_configs.py checks they agree),
and the ``strategy`` column of every table and figure. The benchmark, the plots,
the GPU report and the tests read this list; no other module lists them.

Adding a configuration: one entry here and conf/strategy/NAME.yaml with the same
options (the test says which option differs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpkfac.plan import name_key

__all__ = ["BASELINES", "CONFIGS", "REFERENCE", "kfac_configs", "resolve"]

#: Name -> (scheme, options other than the scheme's defaults); ``none``: no preconditioner.
CONFIGS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "none": (None, {}),
    "dp_kfac": ("dp_kfac", {}),
    "dp_kfac_overlap": ("dp_kfac", {"overlap": True}),
    "dp_kfac_owner": ("dp_kfac", {"grad_reduction": "owner"}),
    "dp_kfac_owner_overlap": ("dp_kfac", {"grad_reduction": "owner", "overlap": True}),
    "dp_kfac_owner_ready": (
        "dp_kfac",
        {"grad_reduction": "owner", "overlap": True, "drain": "ready"},
    ),
    "dp_kfac_auto": ("dp_kfac", {"grad_reduction": "auto", "overlap": "auto", "drain": "auto"}),
    "d_kfac_eager": ("d_kfac", {"lazy_factor_sync": False}),
    "d_kfac_triangle": ("d_kfac", {"triangle": True, "lazy_factor_sync": False}),
    "d_kfac_lazy": ("d_kfac", {"triangle": True}),
    "d_kfac": ("d_kfac", {}),
    "spd_kfac": ("spd_kfac", {}),
    "kaisa_comm_opt": ("kaisa", {"grad_worker_fraction": "comm_opt"}),
    "kaisa_mem_opt": ("kaisa", {"grad_worker_fraction": "mem_opt"}),
    "grouped_local_decomp": ("grouped", {"factor_group_size": 1, "grad_worker_fraction": 1.0}),
    "grouped_auto": ("grouped", {}),
}
#: The configuration the papers' headline compares the baselines with.
REFERENCE = "dp_kfac"
#: The D-KFAC family the headline compares with; "best baseline" is the cheapest of them.
BASELINES: tuple[str, ...] = ("d_kfac", "spd_kfac", "kaisa_comm_opt", "kaisa_mem_opt")


def resolve(name: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A scheme name and its options from a configuration's or a scheme's name (any
    spelling :func:`dpkfac.plan.name_key` reads) and explicit options, which win.

    Raises:
        ValueError: ``none``, which names no preconditioner.
    """
    scheme, preset = CONFIGS.get(name_key(name), (name, {}))
    if scheme is None:
        raise ValueError(f"strategy {name!r} is no preconditioner: build none")
    return scheme, {**preset, **options}


def kfac_configs() -> dict[str, tuple[str, dict[str, Any]]]:
    """The configurations that precondition (every one but ``none``), in order."""
    return {n: (s, dict(o)) for n, (s, o) in CONFIGS.items() if s is not None}
