"""What the start-up measurements send: the one home of their sizes.

:mod:`dpkfac.probes` runs them over a communicator; the plans book them as
one-time "setup" collectives, so predicted and measured setup traffic come
from the same numbers.
"""

from __future__ import annotations

__all__ = [
    "ALLREDUCE_PROBE_NUMELS",
    "BROADCAST_PROBE_NUMELS",
    "EIGH_PROBE_DIMS",
    "MEASURE_ALLREDUCE_NUMELS",
    "MEASURE_COLLECTIVES",
    "PROBE_REPEATS",
    "allreduce_probe_collectives",
]

#: Sides of the factors whose ``eigh`` the start-up measurement times.
EIGH_PROBE_DIMS = (32, 128, 320)
#: float32 elements of the broadcasts the start-up measurement times.
BROADCAST_PROBE_NUMELS = (256, 16384, 262144)
#: float32 elements of the all-reduces timed to fit the fusion rule's alpha-beta model.
ALLREDUCE_PROBE_NUMELS = (256, 16384, 262144)
#: Repeats of every timed probe.
PROBE_REPEATS = 3

#: float32 elements of the all-reduces the start-up measurement times (the gradients'
#: link), up to 4 MiB: a token-bucket-shaped network lets a burst through at line rate,
#: so only sizes well past it measure the link's rate.
MEASURE_ALLREDUCE_NUMELS = (256, 16384, 262144, 1048576)
#: Parameters the ranks agree on after the fit: eigh's inverse rate and latency, then the
#: broadcast's and the all-reduce's alpha and beta.
MEASURE_AGREED = 6

#: Collectives of one hardware measurement (:func:`dpkfac.probes.measure_in_group`),
#: as (kind, bytes): per probe size a meeting all-reduce and the repeats of it, the
#: broadcasts then the all-reduces, then the agreement on the fitted parameters.
MEASURE_COLLECTIVES: tuple[tuple[str, int], ...] = (
    *(
        collective
        for kind, numels in (
            ("broadcast", BROADCAST_PROBE_NUMELS),
            ("allreduce", MEASURE_ALLREDUCE_NUMELS),
        )
        for n in numels
        for collective in (("allreduce", 8), *((kind, 4 * n),) * PROBE_REPEATS)
    ),
    ("allreduce", 8 * MEASURE_AGREED),
)


def allreduce_probe_collectives() -> list[tuple[str, int]]:
    """The all-reduces of one alpha-beta measurement (:func:`dpkfac.probes.measure_comm_model`)."""
    return [("allreduce", 4 * n) for n in ALLREDUCE_PROBE_NUMELS for _ in range(PROBE_REPEATS)]
