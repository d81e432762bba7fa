"""What the cost model needs to know about a model beyond its K-FAC layer shapes.

A :class:`~dpkfac.plan.assignment.LayerShape` carries a layer's factor sizes and
batch statistics. Exact byte predictions need three more facts, because
buffers are split between *tensors* at the bucket cap and a layer's factors
only travel when its hooks fire:

* whether each K-FAC layer has a bias (its gradient is a separate tensor);
* whether each layer's capture hooks fire (a Linear whose weight the model
  applies functionally is registered, broadcast under dp_kfac, but never has
  factors; ``nn.MultiheadAttention.out_proj``, known to be called so, is no
  layer at all: :func:`dpkfac.attention.not_capturable`);
* the element counts of the other trainable parameters, in
  ``model.parameters()`` order (their gradients are averaged too).

:class:`ModelShapes` bundles them and is itself a sequence of ``LayerShape``,
so every function taking layer shapes accepts it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, overload

from dpkfac.plan.assignment import LayerShape

__all__ = ["ModelShapes", "as_model_shapes", "shapes_from_model"]


@dataclass(frozen=True)
class ModelShapes(Sequence[LayerShape]):
    """K-FAC layers in registration order plus the facts exact accounting needs.

    Attributes:
        layers: shapes of the K-FAC layers, in ``named_modules()`` order. A
            layer whose hooks never fire has ``positions = batch_size = 1``,
            as the preconditioner's placement sees it.
        bias: whether each layer has a bias (the last column of its A factor).
        captured: whether each layer's hooks fire (it has factors).
        other_params: element counts of the other trainable parameters.
        order: every trainable parameter in ``model.parameters()`` order, as
            (its K-FAC layer's index, or -1 for another parameter; elements),
            which the overlapped mode's backward buckets follow. Empty: the
            layers' parameters in layer order, then the others (:meth:`param_order`).
        buffer_bytes: bytes of the model's buffers (BatchNorm running statistics
            and counters, of different dtypes), which whole-process memory
            (:mod:`dpkfac.costmodel.memory`) counts.
        saved: per K-FAC layer, (input, output) elements per sample as one
            forward pass saw them, for the activation estimate
            (:func:`dpkfac.costmodel.memory.activation_bytes`); the input is 0
            where the very same tensor was already counted (Q, K and V share
            one input; a layer fed by another's output directly).
        ready: every trainable parameter, as in ``order``, in the order one
            backward pass made its gradient ready, the order DDP rebuilds its
            buckets in after the first iteration (autograd may finish a layer's
            bias before or after its weight). Empty: the reverse of
            :meth:`param_order` (:meth:`backward_order`).

    The last four are not compared (two models with the same layers and
    parameters are the same shapes) and are empty or 0 where unknown (the
    analytic zoo writes none of them down).
    """

    layers: tuple[LayerShape, ...]
    bias: tuple[bool, ...]
    captured: tuple[bool, ...]
    other_params: tuple[int, ...] = ()
    order: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    buffer_bytes: int = field(default=0, compare=False)
    saved: tuple[tuple[int, int], ...] = field(default=(), compare=False)
    ready: tuple[tuple[int, int], ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        n = len(self.layers)
        if len(self.bias) != n or len(self.captured) != n:
            raise ValueError("bias and captured need one entry per layer")
        if self.saved and len(self.saved) != n:
            raise ValueError("saved needs one entry per layer (or none)")

    @overload
    def __getitem__(self, i: int) -> LayerShape: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[LayerShape]: ...
    def __getitem__(self, i: int | slice) -> LayerShape | Sequence[LayerShape]:
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerShape]:
        return iter(self.layers)

    def param_numels(self, i: int) -> list[int]:
        """Element counts of layer ``i``'s parameter tensors: weight, then bias."""
        s = self.layers[i]
        if self.bias[i]:
            return [s.g_dim * (s.a_dim - 1), s.g_dim]
        return [s.g_dim * s.a_dim]

    def param_order(self) -> tuple[tuple[int, int], ...]:
        """(layer index or -1, elements) of every trainable parameter, in model order."""
        if self.order:
            return self.order
        kfac = [(i, n) for i in range(len(self)) for n in self.param_numels(i)]
        return (*kfac, *((-1, n) for n in self.other_params))

    def backward_order(self) -> tuple[tuple[int, int], ...]:
        """(layer index or -1, elements) of every trainable parameter in the order a backward
        pass makes the gradients ready: ``ready`` where it was recorded, else the reverse of
        :meth:`param_order` (a sequential network's order)."""
        return self.ready if self.ready else self.param_order()[::-1]

    @property
    def num_params(self) -> int:
        """Trainable parameter elements (K-FAC layers and the rest)."""
        return sum(s.a_dim * s.g_dim for s in self.layers) + sum(self.other_params)

    def with_batch_size(self, batch_size: int) -> ModelShapes:
        """The same model at another local batch size (captured layers only)."""
        layers = tuple(
            replace(s, batch_size=batch_size) if c else s
            for s, c in zip(self.layers, self.captured, strict=True)
        )
        return replace(self, layers=layers)


def as_model_shapes(
    shapes: Sequence[LayerShape],
    *,
    bias: Sequence[bool] | None = None,
    other_params: int | Sequence[int] = 0,
) -> ModelShapes:
    """Promote plain layer shapes to :class:`ModelShapes`.

    Args:
        shapes: layer shapes, or a ``ModelShapes`` (returned unchanged when no
            other argument is given).
        bias: per layer; default: Linear layers have a bias, Conv2d layers do
            not (torchvision's and Hugging Face's convention). Only the split
            of gradient buckets at the cap depends on it.
        other_params: element count of the non-K-FAC parameters, as one
            tensor (int) or per tensor.
    """
    if isinstance(shapes, ModelShapes) and bias is None and not other_params:
        return shapes
    layers = tuple(shapes)
    biases = tuple(s.kind == "linear" for s in layers) if bias is None else tuple(bias)
    others = (other_params,) if isinstance(other_params, int) else tuple(other_params)
    others = tuple(n for n in others if n > 0)
    if isinstance(shapes, ModelShapes):  # keep what a forward pass measured
        return replace(shapes, bias=biases, other_params=others, order=())
    return ModelShapes(layers, biases, (True,) * len(layers), others)


def shapes_from_model(
    model: Any,
    example_input: Any,
    batch_size: int | None = None,
    *,
    skip_layers: str | Iterable[str] = (),
    example_kwargs: dict[str, Any] | None = None,
    ready_order: bool = False,
) -> ModelShapes:
    """K-FAC layer shapes of a torch model, read from one forward pass.

    Layers are selected exactly as :class:`dpkfac.KFACPreconditioner` selects
    them (:func:`dpkfac.curvature.helper_for`, less what
    :func:`dpkfac.attention.not_capturable` names, ``skip_layers`` regexes
    searched in module names, all parameters trainable), in
    ``named_modules()`` order. Forward hooks read each layer's input and
    output sizes: ``N`` is dim 0 of the input, ``T`` the output positions of
    a Conv2d or the product of a Linear input's middle dims. The model may
    live on the ``meta`` device (nothing is computed then).

    Args:
        model: the model (a ``DistributedDataParallel`` wrapper is unwrapped).
        example_input: positional input (a tensor, or a tuple of arguments).
        batch_size: local batch size ``N`` to record instead of the example's.
        skip_layers: regexes of layers the preconditioner will skip.
        example_kwargs: keyword inputs of the forward call.
        ready_order: also run one backward pass (of the sum of the outputs) to record
            the order the gradients become ready (``ModelShapes.ready``, DDP's bucket
            order); the model's gradients are left as they were.

    Returns:
        The model's :class:`ModelShapes`.
    """
    import torch

    from dpkfac.attention import not_capturable
    from dpkfac.curvature import helper_for

    inner = getattr(model, "module", model)
    patterns = [
        re.compile(p) for p in ((skip_layers,) if isinstance(skip_layers, str) else skip_layers)
    ]
    functional = not_capturable(inner)
    selected: dict[str, Any] = {}
    for name, module in inner.named_modules():
        helper = helper_for(module)
        if helper is None or name in functional or any(p.search(name) for p in patterns):
            continue
        if all(p.requires_grad for p in helper.parameters()):
            selected[name] = helper
    seen: dict[str, tuple[int, int]] = {}
    saved: dict[str, tuple[int, int]] = {}
    # Tensors already counted as some layer's input or output, held (so their ids stay
    # theirs) until the pass ends: a tensor several layers read is saved once.
    counted: dict[int, Any] = {}

    def hook(name: str, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        x = args[0] if args else kwargs.get("input")
        if name in seen or not isinstance(x, torch.Tensor):
            return
        if isinstance(module, torch.nn.Conv2d):
            n = x.shape[0] if x.dim() == 4 else 1
            t = output.shape[-1] * output.shape[-2]
        elif x.dim() == 1:
            n, t = 1, 1
        else:
            n, t = x.shape[0], math.prod(x.shape[1:-1])
        seen[name] = (int(n) if batch_size is None else batch_size, int(t))
        new_input = 0 if id(x) in counted else x.numel() // n
        saved[name] = (int(new_input), int(output.numel() // n))
        counted[id(x)], counted[id(output)] = x, output

    handles = [
        h.module.register_forward_hook(
            lambda m, a, k, o, name=name: hook(name, m, a, k, o), with_kwargs=True
        )
        for name, h in selected.items()
    ]
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    layer_of = {id(p): i for i, h in enumerate(selected.values()) for p in h.parameters()}
    trainable = [p for p in inner.parameters() if p.requires_grad]
    ready: list[tuple[int, int]] = []
    if ready_order:
        old_grads = [p.grad for p in trainable]
        handles += [
            p.register_post_accumulate_grad_hook(
                lambda p: ready.append((layer_of.get(id(p), -1), p.numel()))
            )
            for p in trainable
        ]
    try:
        with torch.set_grad_enabled(ready_order):
            out = inner(*args, **(example_kwargs or {}))
            if ready_order:
                _sum_of_outputs(out).backward()
    finally:
        for h in handles:
            h.remove()
        counted.clear()
        if ready_order:
            for p, g in zip(trainable, old_grads, strict=True):
                p.grad = g

    def layer(name: str, helper: Any) -> LayerShape:
        n, t = seen.get(name, (1, 1))
        kind = "conv2d" if isinstance(helper.module, torch.nn.Conv2d) else "linear"
        return LayerShape(name, kind, helper.a_dim, helper.g_dim, t, n)

    order = tuple((layer_of.get(id(p), -1), p.numel()) for p in trainable)
    return ModelShapes(
        layers=tuple(layer(name, helper) for name, helper in selected.items()),
        bias=tuple(helper.has_bias for helper in selected.values()),
        captured=tuple(name in seen for name in selected),
        other_params=tuple(n for i, n in order if i < 0),
        order=order,
        buffer_bytes=sum(b.numel() * b.element_size() for b in inner.buffers()),
        saved=tuple(saved.get(name, (0, 0)) for name in selected),
        ready=tuple(ready),
    )


def _sum_of_outputs(out: Any) -> Any:
    """One scalar from a forward's output (a tensor, or tensors in sequences and mappings,
    as Hugging Face outputs are) whose backward reaches every parameter it used."""
    import torch

    if isinstance(out, torch.Tensor):
        return (
            out.float().sum() if out.is_floating_point() else out.new_zeros((), dtype=torch.float32)
        )
    parts = (
        out.values() if isinstance(out, Mapping) else out if isinstance(out, (list, tuple)) else ()
    )
    total = [_sum_of_outputs(x) for x in parts]
    total = [t for t in total if t.requires_grad]
    if not total:
        raise ValueError("ready_order needs a forward output with a tensor that requires grad")
    return sum(total[1:], total[0])
