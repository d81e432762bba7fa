"""Layer-type helpers: how a module's captured tensors become K-FAC inputs.

Each supported module type gets a :class:`ModuleHelper` that turns the layer
input into the patch matrix ``a`` of shape (N, T, d_in) and the output
gradient into ``g`` of shape (N, T, d_out), with T positions per sample, and
that reads and writes the weight gradient as the (d_out, d_in[+1]) matrix of
the design contract (bias gradient as the last column). The registry
``MODULE_HELPERS`` maps module types to helpers, so a new layer type is one
class and one registry entry.

:meth:`ModuleHelper.a_factor` / :meth:`ModuleHelper.g_factor` build the batch
factors; the default goes through ``a``/``g`` and
:mod:`dpkfac.curvature.factors`, and :class:`Conv2dHelper` dispatches on
``factor_method`` (see the kernels there): "auto" builds a
stride-1 expand A factor by shifted correlations, a reduce A factor by masked
window sums, neither with im2col; "unfold" is the original im2col path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Generic, TypeAlias, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from dpkfac.curvature import factors
from dpkfac.curvature.factors import a_factor, conv_g_factor, g_factor
from dpkfac.device import TableCache

#: Module types a helper may wrap: what :class:`ModuleHelper` reads ``weight`` and
#: ``bias`` of (typing only; a helper for a new layer type adds its type here).
SupportedModule: TypeAlias = nn.Linear | nn.Conv2d
ModuleT = TypeVar("ModuleT", bound=SupportedModule, covariant=True)


class ModuleHelper(ABC, Generic[ModuleT]):
    """Shape and gradient plumbing for one supported module.

    Args:
        module: the layer whose weight (and bias) K-FAC preconditions.
    """

    def __init__(self, module: ModuleT) -> None:
        self.module = module

    @property
    def has_bias(self) -> bool:
        """Whether the bias joins the weight as a last gradient column."""
        return getattr(self.module, "bias", None) is not None

    @property
    @abstractmethod
    def in_features(self) -> int:
        """Columns of ``a`` before the bias column (d_in, or C·kh·kw)."""

    @property
    @abstractmethod
    def out_features(self) -> int:
        """Columns of ``g`` (d_out)."""

    @property
    def a_dim(self) -> int:
        """Dimension of the A factor (bias column included)."""
        return self.in_features + int(self.has_bias)

    @property
    def g_dim(self) -> int:
        """Dimension of the G factor."""
        return self.out_features

    @abstractmethod
    def a_matrix(self, x: torch.Tensor) -> torch.Tensor:
        """Layer input as (N, T, in_features)."""

    @abstractmethod
    def g_matrix(self, grad_output: torch.Tensor) -> torch.Tensor:
        """Output gradient as (N, T, out_features)."""

    def a_factor(
        self,
        x: torch.Tensor,
        weight_sharing: str,
        dtype: torch.dtype | None,
        method: str = factors.DEFAULT_METHOD,
    ) -> tuple[torch.Tensor, int, int]:
        """The batch A factor of layer input ``x``, with N and T.

        Args:
            x: the layer input (detached).
            weight_sharing: "expand" or "reduce".
            dtype: dtype the factor is built in (None: the input's).
            method: a :data:`~dpkfac.curvature.factors.FACTOR_METHODS` value;
                "unfold" keeps the original full product.
        """
        factors.check_method(method)
        a = self.a_matrix(x)
        factor = a_factor(
            a,
            has_bias=self.has_bias,
            weight_sharing=weight_sharing,
            dtype=dtype,
            triangle=method != "unfold",
            bf16=method == "auto_bf16",
        )
        return factor, a.shape[0], a.shape[1]

    def g_factor(
        self,
        grad_output: torch.Tensor,
        weight_sharing: str,
        dtype: torch.dtype | None,
        method: str = factors.DEFAULT_METHOD,
    ) -> torch.Tensor:
        """The batch G factor of the layer's output gradient (see :meth:`a_factor`)."""
        factors.check_method(method)
        return g_factor(
            self.g_matrix(grad_output),
            weight_sharing=weight_sharing,
            dtype=dtype,
            triangle=method != "unfold",
            bf16=method == "auto_bf16",
        )

    def parameters(self) -> list[torch.Tensor]:
        """Weight, then bias when present: the order of the gradient matrix columns."""
        params = [self.module.weight]
        bias = self.module.bias
        if bias is not None:
            params.append(bias)
        return params

    def grad_matrix(
        self, grad_of: Callable[[torch.Tensor], torch.Tensor | None] | None = None
    ) -> torch.Tensor | None:
        """The gradient as (d_out, a_dim), or None when the layer got no gradient.

        ``grad_of`` maps a parameter to the gradient to read (default: its
        ``.grad``); the overlapped mode reads DDP's bucket copy, which reaches
        ``.grad`` only at the end of the backward pass.
        """
        read = grad_of if grad_of is not None else (lambda p: p.grad)
        weight = self.module.weight
        weight_grad = read(weight)
        if weight_grad is None:
            return None
        grad = weight_grad.reshape(weight.shape[0], -1)
        bias = self.module.bias
        if bias is not None:
            bias_grad = read(bias)
            if bias_grad is None:
                bias_grad = torch.zeros_like(bias)
            grad = torch.cat([grad, bias_grad.reshape(-1, 1)], dim=1)
        return grad

    def set_grad_matrix(self, matrix: torch.Tensor) -> None:
        """Write a (d_out, a_dim) matrix back into ``.grad`` of weight and bias."""
        weight = self.module.weight
        w_cols = matrix[:, : self.in_features]
        weight_grad = weight.grad
        assert weight_grad is not None, "set_grad_matrix needs the weight's gradient"
        weight_grad.copy_(w_cols.reshape(weight.shape).to(weight_grad.dtype))
        bias = self.module.bias
        if bias is not None:
            if bias.grad is None:
                bias.grad = torch.zeros_like(bias)
            bias.grad.copy_(matrix[:, -1].reshape(bias.shape).to(bias.grad.dtype))


class LinearHelper(ModuleHelper[nn.Linear]):
    """``nn.Linear`` with input (N, *, d_in): the extra dims are positions."""

    @property
    def in_features(self) -> int:
        return self.module.in_features

    @property
    def out_features(self) -> int:
        return self.module.out_features

    def a_matrix(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:
            x = x.unsqueeze(0)
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def g_matrix(self, grad_output: torch.Tensor) -> torch.Tensor:
        if grad_output.dim() == 1:
            grad_output = grad_output.unsqueeze(0)
        return grad_output.reshape(grad_output.shape[0], -1, grad_output.shape[-1])


class Conv2dHelper(ModuleHelper[nn.Conv2d]):
    """``nn.Conv2d`` (groups=1): ``a`` is the im2col patch matrix of the layer's geometry.

    The kernels' index and mask tensors are kept per input geometry, device
    and dtype in this helper's own :class:`~dpkfac.device.TableCache`.
    """

    def __init__(self, module: nn.Conv2d) -> None:
        super().__init__(module)
        self.tables = TableCache()

    @property
    def in_features(self) -> int:
        kh, kw = self.module.kernel_size
        return self.module.in_channels * kh * kw

    @property
    def out_features(self) -> int:
        return self.module.out_channels

    def _padded_input(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Apply string or non-zero padding modes explicitly so ``unfold`` sees padding 0."""
        conv = self.module
        if isinstance(conv.padding, str):
            if conv.padding == "valid":
                return x, (0, 0)
            pads: list[int] = []
            for k, d in zip(reversed(conv.kernel_size), reversed(conv.dilation), strict=True):
                total = d * (k - 1)
                pads += [total // 2, total - total // 2]
            mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
            return F.pad(x, pads, mode=mode), (0, 0)
        if conv.padding_mode != "zeros":
            return F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode), (0, 0)
        ph, pw = conv.padding
        return x, (ph, pw)

    def a_matrix(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.unsqueeze(0)
        x, padding = self._padded_input(x)
        conv = self.module
        patches = F.unfold(
            x, conv.kernel_size, dilation=conv.dilation, padding=padding, stride=conv.stride
        )
        return patches.transpose(1, 2)

    def g_matrix(self, grad_output: torch.Tensor) -> torch.Tensor:
        if grad_output.dim() == 3:
            grad_output = grad_output.unsqueeze(0)
        n, c = grad_output.shape[:2]
        return grad_output.reshape(n, c, -1).transpose(1, 2)

    def a_factor(
        self,
        x: torch.Tensor,
        weight_sharing: str,
        dtype: torch.dtype | None,
        method: str = factors.DEFAULT_METHOD,
    ) -> tuple[torch.Tensor, int, int]:
        """A without im2col where the geometry allows (see the module docstring).

        Other padding modes and string padding are applied to the input
        first, so the kernels see zero padding (or none). "expand" with a
        stride other than 1 falls back to im2col with the triangle product.
        """
        factors.check_method(method)
        if method == "unfold":
            return super().a_factor(x, weight_sharing, dtype, method)
        if x.dim() == 3:
            x = x.unsqueeze(0)
        x, padding = self._padded_input(x)
        if dtype is not None:
            x = x.to(dtype)
        conv, bf16 = self.module, method == "auto_bf16"
        (sh, sw), (dh, dw) = conv.stride, conv.dilation
        stride, dilation = (sh, sw), (dh, dw)
        n, _, h, w = x.shape
        kh, kw = conv.kernel_size
        t = factors.out_positions((h, w), (kh, kw), stride, padding, dilation)
        if weight_sharing == "reduce":
            factor = factors.conv_a_reduce(
                x,
                (kh, kw),
                stride,
                padding,
                dilation,
                has_bias=self.has_bias,
                bf16=bf16,
                cache=self.tables,
            )
        elif factors.use_shifted(method, stride, (kh, kw), (n, h, w)):
            factor = factors.conv_a_shifted(
                x, (kh, kw), padding, dilation, has_bias=self.has_bias, bf16=bf16, cache=self.tables
            )
        else:
            a = F.unfold(x, (kh, kw), dilation=dilation, padding=padding, stride=stride)
            factor = a_factor(
                a.transpose(1, 2),
                has_bias=self.has_bias,
                weight_sharing=weight_sharing,
                bf16=bf16,
            )
        return factor, n, t

    def g_factor(
        self,
        grad_output: torch.Tensor,
        weight_sharing: str,
        dtype: torch.dtype | None,
        method: str = factors.DEFAULT_METHOD,
    ) -> torch.Tensor:
        """G by one batched product of the (C, H·W) slices of each sample ("unfold": original)."""
        factors.check_method(method)
        if method == "unfold":
            return super().g_factor(grad_output, weight_sharing, dtype, method)
        if grad_output.dim() == 3:
            grad_output = grad_output.unsqueeze(0)
        return conv_g_factor(
            grad_output, weight_sharing=weight_sharing, dtype=dtype, bf16=method == "auto_bf16"
        )


#: Helper type per module type (the pairing is the registry's, so the helper's
#: module parameter is Any to the type checker).
MODULE_HELPERS: dict[type[nn.Module], type[ModuleHelper[Any]]] = {
    nn.Linear: LinearHelper,
    nn.Conv2d: Conv2dHelper,
}


def helper_for(module: nn.Module) -> ModuleHelper[SupportedModule] | None:
    """The helper for a supported module, or None for layers K-FAC leaves alone.

    Subclasses of registered types count (e.g. ``NonDynamicallyQuantizableLinear``);
    grouped convolutions do not, because their weight is not one Kronecker block.
    """
    for module_type, helper_type in MODULE_HELPERS.items():
        if isinstance(module, module_type):
            if isinstance(module, nn.Conv2d) and module.groups != 1:
                return None
            if getattr(module, "weight", None) is None:
                return None
            return helper_type(module)
    return None
