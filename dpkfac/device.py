"""Device seams: where the library reads device values on the host, and the device rule.

A CPU-only test suite hides the GPU path: a tensor made on the CPU that meets
CUDA data, a CPU tensor handed to an NCCL collective, a host sync in a hook.
The library keeps the few places where it must touch the host behind small
injectable objects, so that the same code runs on fake CUDA tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``), which have shapes and
devices but no values:

* :class:`HostReader` is the one way the library reads a device value on the
  host (the joint finiteness check of a factor step, π-damping's traces,
  eigh's finiteness check, agreed start-up statistics). The default reads
  the tensor; :class:`DryRunReader` answers with the value the caller expects
  in a healthy run, for dry runs on tensors that hold no values. Every read
  is counted, so "one host read per factor step" is a number a test asserts.
* :class:`TableCache` keeps constant tensors (index and mask tables) made on
  the device of the data they meet, per key, device and dtype, in a cache an
  object owns: never a module-level cache, whose tensors could outlive a
  fake mode or meet another device's data.
* :func:`check_device` is the device rule of collectives (NCCL moves only
  CUDA tensors, and only those of the rank's own device): the communicator
  calls it on every buffer it hands to torch.distributed.

Phase timing has its own seam, the ``timing`` option of
:class:`~dpkfac.stats.PhaseTimer` ("events", "host" or "off").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

__all__ = [
    "DeviceMismatch",
    "DryRunReader",
    "HostReader",
    "TableCache",
    "check_device",
    "same_device",
]

T = TypeVar("T")


class DeviceMismatch(ValueError):
    """A tensor is on another device than the run's (e.g. a CPU tensor for an NCCL collective)."""


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are the same, ``cuda`` and ``cuda:<current>`` alike.

    An index-less device matches any index of its type: the run's device may
    be given as ``cuda`` while tensors report ``cuda:0``.
    """
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


def check_device(tensor: torch.Tensor, device: torch.device, what: str) -> None:
    """Raise :class:`DeviceMismatch` unless ``tensor`` lives on ``device``.

    Args:
        tensor: the tensor handed to a collective.
        device: the run's device (the model's, which the process group serves).
        what: the collective's category, for the message.
    """
    if not same_device(tensor.device, device):
        raise DeviceMismatch(
            f"dpkfac: a {tensor.device} tensor {tuple(tensor.shape)} {tensor.dtype} was handed "
            f"to the {what!r} collective of a run on {device}: every tensor a collective sees "
            "must be on the run's device (NCCL accepts only CUDA tensors of the rank's GPU)"
        )


class TableCache:
    """Constant tensors made once per key on the device they are used on.

    The key must name the device and dtype. Owned by the object that uses
    the tensors (a layer's helper, a communicator), so tensors made on one
    device, or under a ``FakeTensorMode``, never meet another run's data.
    """

    def __init__(self) -> None:
        self._store: dict[tuple[object, ...], object] = {}

    def get(self, key: tuple[object, ...], build: Callable[[], T]) -> T:
        """The cached value of ``key``, built by ``build()`` the first time."""
        if key not in self._store:
            self._store[key] = build()
        # One store holds values of many types; the key's build made this one.
        return cast(T, self._store[key])

    def __len__(self) -> int:
        return len(self._store)


class HostReader:
    """Reads device tensors on the host: the library's only way to do so.

    On a GPU each read waits for the device, so the hot path makes at most one
    per factor step (see ``docs/design.md``); :attr:`reads` counts them.
    """

    def __init__(self) -> None:
        self.reads = 0

    def read(self, tensor: torch.Tensor, expected: Any) -> Any:
        """``tensor.tolist()``.

        Args:
            tensor: the device tensor to read.
            expected: what a healthy run reads, with the structure of
                ``tensor.tolist()`` (all finite, the ranks in agreement);
                used only by :class:`DryRunReader`.
        """
        self.reads += 1
        return tensor.tolist()

    def flags(self, tensor: torch.Tensor) -> list[bool]:
        """A boolean tensor as a flat list (expected: all True)."""
        flat = tensor.reshape(-1)
        return [bool(v) for v in self.read(flat, [True] * flat.numel())]


class DryRunReader(HostReader):
    """Answers host reads with the expected values, without reading the device.

    For dry runs on fake (or meta) tensors, which hold no values: a finiteness
    check passes, an agreed statistic equals this rank's own, a trace is the
    caller's stand-in. The step then takes the path of a healthy run, and what
    it does with devices, shapes and collectives can be checked. Never use it
    on real tensors: it would hide a non-finite factor.
    """

    def read(self, tensor: torch.Tensor, expected: Any) -> Any:
        self.reads += 1
        return expected
