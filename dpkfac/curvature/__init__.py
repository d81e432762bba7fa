"""Per-layer K-FAC maths: capture helpers, Kronecker factors and decompositions.

Nothing in this package communicates: the distribution strategies decide who
calls what, and all collectives live in :mod:`dpkfac.comm`.
"""

from __future__ import annotations

from dpkfac.curvature.decomposition import (
    DECOMPOSITIONS,
    Decomposition,
    EigenDecomposition,
    InverseDecomposition,
    precondition,
)
from dpkfac.curvature.factors import a_factor, g_factor
from dpkfac.curvature.layer import KFACLayer
from dpkfac.curvature.modules import MODULE_HELPERS, ModuleHelper, helper_for

__all__ = [
    "DECOMPOSITIONS",
    "MODULE_HELPERS",
    "Decomposition",
    "EigenDecomposition",
    "InverseDecomposition",
    "KFACLayer",
    "ModuleHelper",
    "a_factor",
    "g_factor",
    "helper_for",
    "precondition",
]
