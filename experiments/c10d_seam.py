"""The private torch.distributed internals the in-process ranks rely on, in one place.

:mod:`experiments.threads` runs many ranks as threads of one process. Public
torch.distributed cannot do that: its group bookkeeping is one module global
(``distributed_c10d._world``, an instance of the private ``_World``), its C++
group registry is per process unless ``_set_thread_isolation_mode`` makes it
per thread, and a Python-side process group hands out ``Work`` objects only
through ``_create_work_from_future``. Everything private that the launcher
touches goes through this module, so that a torch upgrade that moves one of
them fails here, with a message naming what moved, instead of somewhere deep
in a collective.

:func:`problems` lists what is missing or changed; :func:`check` raises with
that list (the launcher calls it before it starts a rank thread) and warns when
the torch version is not the one this seam was written against;
``tests/test_threads_group.py`` runs it, so a torch upgrade that breaks the seam
turns the suite red with the names.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist

#: The torch release (major.minor) whose internals this module was written against.
WRITTEN_AGAINST = "2.14"

#: What ``_World`` exposes and :class:`ThreadLocalWorld` must therefore provide per thread.
WORLD_FIELDS = (
    "default_pg",
    "pg_map",
    "pg_names",
    "pg_group_ranks",
    "pg_backend_config",
    "group_count",
    "tags_to_pg",
    "pg_to_tag",
    "pg_coalesce_state",
    "comms",
)


def _c10d() -> Any:
    return dist.distributed_c10d


def _world_properties() -> set[str]:
    """The public names ``_World`` defines (its properties): c10d reads and writes these."""
    world = getattr(_c10d(), "_World", None)
    if world is None:
        return set()
    return {n for n, v in vars(world).items() if isinstance(v, property) and not n.startswith("_")}


def problems() -> list[str]:
    """What this seam needs and torch no longer has, one line each (empty: all present)."""
    found = []
    c10d, cpp = _c10d(), torch._C._distributed_c10d
    for owner, name, where in (
        (c10d, "_world", "torch.distributed.distributed_c10d._world"),
        (c10d, "_World", "torch.distributed.distributed_c10d._World"),
        (
            cpp,
            "_set_thread_isolation_mode",
            "torch._C._distributed_c10d._set_thread_isolation_mode",
        ),
        (cpp, "_create_work_from_future", "torch._C._distributed_c10d._create_work_from_future"),
    ):
        if not hasattr(owner, name):
            found.append(f"{where} is gone")
    world = getattr(c10d, "_World", None)
    if world is not None and not isinstance(vars(world).get("pg_config_info"), property):
        found.append("torch.distributed.distributed_c10d._World.pg_config_info is no property")
    if world is not None:
        extra = sorted(_world_properties() - set(WORLD_FIELDS) - {"pg_config_info"})
        if extra:
            found.append(f"_World has fields this seam does not make thread-local: {extra}")
    return found


def check() -> None:
    """Raise naming what moved; warn when torch is not the release this was written for.

    Raises:
        RuntimeError: a private name the launcher needs is gone or changed.
    """
    version = ".".join(torch.__version__.split(".")[:2])
    found = problems()
    if found:
        raise RuntimeError(
            f"launcher=threads needs torch.distributed internals that torch {torch.__version__} "
            f"no longer has as in {WRITTEN_AGAINST} (experiments/c10d_seam.py): " + "; ".join(found)
        )
    if version != WRITTEN_AGAINST:
        warnings.warn(
            f"experiments/c10d_seam.py was written against torch {WRITTEN_AGAINST}, this is "
            f"{torch.__version__}: its checks pass, but run tests/test_threads_group.py",
            stacklevel=2,
        )


class ThreadLocalWorld(threading.local):
    """torch.distributed's group bookkeeping (``distributed_c10d._world``), one per thread.

    The attributes are :data:`WORLD_FIELDS`, those c10d reads and writes; a
    ``threading.local`` subclass runs ``__init__`` afresh in every thread that touches it.
    """

    def __init__(self) -> None:
        self.default_pg: dist.ProcessGroup | None = None
        self.pg_map: dict[Any, Any] = {}
        self.pg_names: dict[Any, Any] = {}
        self.pg_group_ranks: dict[Any, Any] = {}
        self.pg_backend_config: dict[Any, Any] = {}
        self.group_count = 0
        self.tags_to_pg: dict[str, list[Any]] = {}
        self.pg_to_tag: dict[Any, str] = {}
        self.pg_coalesce_state: dict[Any, list[Any]] = {}
        self.comms: list[Any] = []

    # c10d's own derivation of the configuration from the maps above.
    pg_config_info = property(dist.distributed_c10d._World.pg_config_info.fget)  # type: ignore[attr-defined]


def swap_world(world: Any) -> Any:
    """Install ``world`` as c10d's group bookkeeping; the one it replaces is returned."""
    old = _c10d()._world
    _c10d()._world = world
    return old


def set_thread_isolation(on: bool) -> None:
    """Make c10d's C++ group registry per thread (on) or per process (off)."""
    torch._C._distributed_c10d._set_thread_isolation_mode(on)  # type: ignore[attr-defined]


def work_from_future(future: torch.futures.Future) -> Any:
    """A ``Work`` that completes with ``future`` (what a Python process group returns)."""
    return torch._C._distributed_c10d._create_work_from_future(future)
