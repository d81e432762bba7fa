"""What the first-order optimizer holds and touches per step: the one home of those counts.

Both halves of the cost model read them: :mod:`dpkfac.costmodel.memory` counts
the optimizer's state tensors, :mod:`dpkfac.costmodel.timing` prices the
optimizer's step as one memory-bound pass over the parameters (torch's
``foreach`` kernels): it reads each gradient, each parameter and each state
tensor and writes back the parameter and the state, ``3 + 2·s`` bytes per
parameter byte with ``s`` state tensors per parameter.
"""

from __future__ import annotations

__all__ = ["OPTIMIZER_STATE", "check_optimizer", "step_bytes"]

#: Optimizer kind -> (state tensors per parameter, float32 ``step`` scalars per tensor).
OPTIMIZER_STATE: dict[str, tuple[int, int]] = {
    "none": (0, 0),
    "sgd": (0, 0),
    "sgd_momentum": (1, 0),
    "adam": (2, 1),
    "adamw": (2, 1),
}


def check_optimizer(optimizer: str) -> tuple[int, int]:
    """The state counts of ``optimizer``; a clear error naming it when it is unknown."""
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE)}"
        )
    return OPTIMIZER_STATE[optimizer]


def step_bytes(num_params: int, itemsize: int, optimizer: str) -> int:
    """Bytes one optimizer step reads and writes (0 for ``"none"``: no optimizer step)."""
    if optimizer == "none":
        return 0
    state, _ = check_optimizer(optimizer)
    return (3 + 2 * state) * num_params * itemsize
