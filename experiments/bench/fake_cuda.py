"""The fake-CUDA harness: the GPU path of a step, run on this CPU, as any rank of any job.

``FakeTensorMode`` tensors carry a shape, a dtype and a device but no values,
and an operation that mixes a CPU tensor with a CUDA one raises
``FakeTensorDeviceMismatchError``, as CUDA itself would. A model built under
the mode with ``torch.device("cuda")`` (:func:`on_fake_cuda`) is a CUDA model
as far as every library code path can tell, and costs no memory: the
paper-size ResNet-50 and BERT-large fit in one process of this CPU.

What the mode cannot run, and how the harness gets past it:

* the autograd engine asks for a CUDA context on backward, so
  :func:`drive_backward` calls the output-gradient hooks the preconditioner
  registered with a fake gradient, and gives every parameter a fake ``.grad``;
* host reads have no value to read: the library's own seam,
  :class:`dpkfac.device.DryRunReader`, answers them as a healthy run would
  (:func:`dry_run_preconditioner`);
* CUDA-event timing needs a context: the library's ``timing="off"`` seam;
* collectives go to torch's fake process group (:func:`fake_process_group`),
  which accepts them on fake CUDA tensors at any world size in one process
  and returns no real values; the communicator's device check and its byte
  counters still see every tensor handed to it.

Two users: ``make test`` (``tests/fake_cuda.py`` re-exports these pieces for
the device tests) and the scale simulation (:mod:`experiments.bench.scale_sim`,
``python -m experiments.bench table=scale_sim``), which plays chosen ranks of
jobs of up to thousands of ranks.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import dpkfac
from dpkfac.device import DryRunReader

DEVICE = torch.device("cuda", 0)


def fake_mode() -> FakeTensorMode:
    """A strict fake mode: real tensors may not enter it (a CPU constant would raise)."""
    _start_autograd_engine()
    return FakeTensorMode(allow_non_fake_inputs=False)


@functools.cache
def _start_autograd_engine() -> None:
    """Run one tiny real backward before the first fake CUDA tensor exists.

    The autograd engine starts its device threads once, at the process's first
    backward, one per device it then believes present. Once a fake CUDA tensor
    has been made it believes in a CUDA device even on a machine without one,
    starts a thread for it, and from then on a forked child (the gloo ranks of
    the multi-process tests) refuses to run any backward ("Unable to handle
    autograd's threading in combination with fork-based multiprocessing").
    Starting the engine first, with the devices really there, keeps the
    process fork-safe as it was.
    """
    probe = torch.ones(1, requires_grad=True)
    (probe * 2).sum().backward()


def on_fake_cuda(
    mode: FakeTensorMode, build: Callable[[], Any], dtype: torch.dtype | None = None
) -> Any:
    """``build()`` with every tensor it makes a fake CUDA tensor (of ``dtype``, default float32).

    Built in place: ``module.to()`` cannot swap fake parameters. ``build`` may
    return a module or anything holding one (with its example inputs, say).
    """
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or default)
    try:
        with mode, torch.device("cuda"):
            return build()
    finally:
        torch.set_default_dtype(default)


def copy_fake(mode: FakeTensorMode, module: nn.Module) -> nn.Module:
    """A deep copy of a fake module (fresh parameters, no hooks of earlier runs), in ``mode``.

    Much cheaper than building the module again (a paper-size BERT-large takes
    seconds to build, milliseconds to copy). The copy's tensors belong to
    ``mode`` too (a plain deep copy would give each its own mode, and modes do
    not mix). Copying reads each fake tensor's data pointer, about which torch
    warns; nothing uses it.
    """
    with mode, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        return copy.deepcopy(module, memo={id(mode): mode})


class Outputs:
    """Records each module's output in forward order (to drive their hooks in backward order)."""

    def __init__(self, model: nn.Module) -> None:
        self.tensors: list[tuple[nn.Module, torch.Tensor]] = []
        self._handles = [m.register_forward_hook(self._keep) for m in model.modules()]

    def _keep(self, module: nn.Module, args: Any, output: Any) -> None:
        # A container returns its last child's output: keep each tensor once, with the
        # innermost module that produced it (hooks of children fire first).
        if isinstance(output, torch.Tensor) and all(output is not t for _, t in self.tensors):
            self.tensors.append((module, output))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _accumulate(params: Iterable[nn.Parameter], done: set[int]) -> None:
    """Give each trainable parameter not in ``done`` a fake gradient and run its
    post-accumulate-grad hooks, as autograd would; add it to ``done``.

    ``Tensor.register_post_accumulate_grad_hook`` keeps hooks in
    ``_post_accumulate_grad_hooks`` (the preconditioner's and dp_kfac's overlap's).
    """
    for param in params:
        if param.requires_grad and id(param) not in done:
            param.grad = torch.randn_like(param)
            for hook in list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values()):
                hook(param)
            done.add(id(param))


def drive_backward(model: nn.Module, outputs: Outputs) -> int:
    """Stand in for ``loss.backward()`` on fake CUDA tensors.

    In backward order, module by module: calls the gradient hooks registered
    on the module's output (the preconditioner's G hooks) with a fake output
    gradient, then gives the module's own trainable parameters a fake
    ``.grad`` and runs their post-accumulate-grad hooks; parameters of no
    recorded module come last. Hooks are read from the tensor's
    ``_backward_hooks``, where ``Tensor.register_hook`` keeps them.

    Returns:
        How many output-gradient hooks were called.
    """
    called = 0
    done: set[int] = set()
    for module, out in reversed(outputs.tensors):
        for hook in list((getattr(out, "_backward_hooks", None) or {}).values()):
            hook(torch.randn_like(out))
            called += 1
        _accumulate(module.parameters(recurse=False), done)
    outputs.tensors.clear()
    _accumulate(model.parameters(), done)
    return called


def fake_forward_backward(model: nn.Module, inputs: Sequence[Any]) -> int:
    """A forward pass on ``inputs`` (positional, fake CUDA) and the driven backward.

    Returns:
        How many output-gradient hooks fired.
    """
    outputs = Outputs(model)
    try:
        model(*inputs)
    finally:
        outputs.remove()
    return drive_backward(model, outputs)


def fake_step(
    model: nn.Module, pre: dpkfac.KFACPreconditioner, *, inputs: Sequence[Any] | None = None
) -> int:
    """One training step on fake CUDA: forward, hooks driven as in backward, ``pre.step()``.

    ``inputs``: the forward pass's positional inputs (fake CUDA tensors); without
    them, a batch of three 8 x 8 RGB images.

    Returns:
        How many output-gradient hooks fired.
    """
    if inputs is None:
        inputs = (torch.randn(3, 3, 8, 8, device="cuda"),)
    called = fake_forward_backward(model, inputs)
    pre.step()
    return called


def dry_run_preconditioner(model: nn.Module, **kwargs: Any) -> dpkfac.KFACPreconditioner:
    """A preconditioner with the dry-run seams: no timing, host reads answered."""
    kwargs.setdefault("timing", "off")
    kwargs.setdefault("host_reader", DryRunReader())
    return dpkfac.KFACPreconditioner(model, **kwargs)


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Rank ``rank`` of a ``world_size`` job in this process, on torch's fake backend.

    Collectives complete at once and move nothing. torch's broadcast asks the
    device for its compute capability, which needs a driver: the answer of an
    H100 is given instead, for the duration of the block.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process")
    with mock.patch.object(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0)):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield
        finally:
            dist.destroy_process_group()
