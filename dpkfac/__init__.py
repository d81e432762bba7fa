"""dpkfac: distributed K-FAC preconditioning (DP-KFAC) and its D-KFAC baselines."""

from __future__ import annotations

from dpkfac.attention import LinearMultiheadAttention, split_attention
from dpkfac.memory import ProcessMemory, process_memory
from dpkfac.preconditioner import KFACPreconditioner
from dpkfac.strategies import STRATEGIES

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "KFACPreconditioner",
    "LinearMultiheadAttention",
    "ProcessMemory",
    "__version__",
    "process_memory",
    "split_attention",
]
