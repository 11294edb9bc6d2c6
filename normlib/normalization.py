"""LayerNorm, RMSNorm and GroupNorm modules with torch.nn's arguments and names.

Each module only holds its parameters; the math lives in
:mod:`normlib.functional`. Parameter names match :mod:`torch.nn`, so
``normlib.LayerNorm(8).load_state_dict(torch.nn.LayerNorm(8).state_dict())``
works, and the other way round.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import functional as F
from . import ops
from ._checks import _shape_t, check_eps, check_positive_int, normalize_shape

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm"]


def _layer_norm(input, normalized_shape, weight, bias, eps):
    """The fused kernels for CUDA rows they cover, the reference math otherwise."""
    if len(normalized_shape) == 1 and isinstance(input, Tensor) and ops.use_fused(input):
        F.check_layer_norm_args(input, normalized_shape, weight, bias, eps)
        return ops.layer_norm(input, weight, bias, eps)
    return F.layer_norm(input, normalized_shape, weight, bias, eps)


def _rms_norm(input, normalized_shape, weight, eps):
    if len(normalized_shape) == 1 and isinstance(input, Tensor) and ops.use_fused(input):
        _, eps = F.check_rms_norm_args(input, normalized_shape, weight, eps)
        return ops.rms_norm(input, weight, eps)
    return F.rms_norm(input, normalized_shape, weight, eps)


class LayerNorm(nn.Module):
    r"""Layer normalization over the trailing ``normalized_shape`` dimensions.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta

    Args:
        normalized_shape: int or tuple, the trailing dimensions to normalize.
        eps: added to the variance (default ``1e-5``).
        elementwise_affine: learn γ (``weight``, init 1) and β (``bias``, init 0).
        bias: learn β too (only with ``elementwise_affine``).

    Shape:
        input ``(*, *normalized_shape)``; output the same.

    Example:
        >>> ln = LayerNorm(4)
        >>> ln(torch.randn(2, 3, 4)).shape
        torch.Size([2, 3, 4])

    On CUDA tensors normalized over one dimension, forward and backward run
    through the fused Triton kernels (see :func:`normlib.ops.path_for`).
    """

    def __init__(
        self,
        normalized_shape: _shape_t,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.normalized_shape = normalize_shape(normalized_shape)
        self.eps = check_eps(eps)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            if bias:
                self.bias = nn.Parameter(torch.empty(self.normalized_shape, **factory))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return _layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}"
        )


class RMSNorm(nn.Module):
    r"""Root-mean-square normalization per sample (Zhang & Sennrich, 2019).

    .. math:: y = \frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}} \odot \gamma

    Args:
        normalized_shape: int or tuple, the trailing dimensions to normalize.
        eps: added to the mean square; ``None`` (default) means the machine
            epsilon of the compute dtype (float32 for float16/bfloat16/float32
            input), as :class:`torch.nn.RMSNorm` does.
        elementwise_affine: learn γ (``weight``, init 1).

    Example:
        >>> RMSNorm(4)(torch.randn(2, 4)).shape
        torch.Size([2, 4])

    On CUDA tensors normalized over one dimension, forward and backward run
    through the fused Triton kernels (see :func:`normlib.ops.path_for`).
    """

    def __init__(
        self,
        normalized_shape: _shape_t,
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.normalized_shape = normalize_shape(normalized_shape)
        self.eps = None if eps is None else check_eps(eps)
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, input: Tensor) -> Tensor:
        return _rms_norm(input, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}"
        )


class GroupNorm(nn.Module):
    r"""Group normalization (Wu & He, 2018): ``num_channels`` split into ``num_groups``.

    Args:
        num_groups: number of groups ``G``; must divide ``num_channels``.
        num_channels: number of channels ``C`` of the ``(N, C, *)`` input.
        eps: added to the variance (default ``1e-5``).
        affine: learn per-channel γ (``weight``) and β (``bias``).
        bias: (keyword-only) learn β too, when ``affine``.

    Example:
        >>> GroupNorm(2, 6)(torch.randn(4, 6, 5)).shape
        torch.Size([4, 6, 5])
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.num_groups = check_positive_int(num_groups, "num_groups")
        self.num_channels = check_positive_int(num_channels, "num_channels")
        if self.num_channels % self.num_groups != 0:
            raise ValueError(
                f"num_channels must be divisible by num_groups "
                f"(got num_channels={num_channels}, num_groups={num_groups})"
            )
        self.eps = check_eps(eps)
        self.affine = affine
        if affine:
            self.weight = nn.Parameter(torch.empty(num_channels, device=device, dtype=dtype))
            if bias:
                self.bias = nn.Parameter(torch.empty(num_channels, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.num_groups}, {self.num_channels}, eps={self.eps}, "
            f"affine={self.affine}, bias={self.bias is not None}"
        )

