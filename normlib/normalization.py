"""LayerNorm, RMSNorm and GroupNorm modules with torch.nn's arguments and names.

Each module only holds its parameters; the math lives in
:mod:`normlib.functional`. Each class is a subclass of its :mod:`torch.nn`
namesake, so code that looks for norms by type (``isinstance(m,
torch.nn.LayerNorm)``: the Hugging Face trainer's no-weight-decay rule, weight
initialisation, ...) finds normlib's too, and state_dicts load in both
directions: ``normlib.LayerNorm(8).load_state_dict(torch.nn.LayerNorm(8).state_dict())``.
normlib checks the arguments (with its own error messages) and then lets
torch's constructor create the parameters; ``forward`` is normlib's.

dtypes follow torch.nn: the output has the input's dtype; LayerNorm and
GroupNorm accept parameters of the input's dtype, or float32 ones with
float16/bfloat16 input, and raise a ``TypeError`` naming both dtypes
otherwise (torch raises a ``RuntimeError``); RMSNorm, like
:class:`torch.nn.RMSNorm`, accepts any floating dtypes.
"""

from __future__ import annotations

from typing import Optional

import inspect

import torch  # noqa: F401 (the docstrings' examples, run as doctests, use it)
from torch import Tensor, nn

from . import ops
from ._checks import _shape_t, check_eps, check_positive_int, normalize_shape
from .errors import NormValueError

__all__ = ["LayerNorm", "RMSNorm", "GroupNorm"]


class _NormlibRepr:
    """``repr`` is torch's own, with the class named ``normlib.LayerNorm(...)``.

    A printed model shows whose layer it is and otherwise reads exactly as the
    installed torch prints its namesake. Where that torch's text has no
    ``bias`` (older releases print none, and before 2.13 BatchNorm, GroupNorm
    and InstanceNorm take no ``bias`` argument) a layer built with
    ``bias=False`` says so.
    """

    def _get_name(self) -> str:
        cls = type(self)
        return f"normlib.{cls.__name__}" if cls.__module__.startswith("normlib.") else cls.__name__

    def extra_repr(self) -> str:
        text = super().extra_repr()  # type: ignore[misc]  # torch's namesake follows in the MRO
        params = self._parameters  # type: ignore[attr-defined]
        no_bias = params.get("weight") is not None and "bias" in params and params["bias"] is None
        if no_bias and not _accepts_bias(_torch_namesake(type(self))):
            text += ", bias=False"
        return text


def _torch_namesake(cls: type) -> type:
    """The first ``torch.nn`` class ``cls`` derives from (``nn.BatchNorm1d`` for normlib's)."""
    return next(c for c in cls.__mro__ if c.__module__.startswith("torch.nn."))


def _accepts_bias(cls: type[nn.Module]) -> bool:
    """Whether ``cls.__init__`` takes ``bias`` (torch added it to GroupNorm/BatchNorm/InstanceNorm in 2026)."""
    return "bias" in inspect.signature(cls.__init__).parameters


class LayerNorm(_NormlibRepr, nn.LayerNorm):
    r"""Layer normalization over the trailing ``normalized_shape`` dimensions.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta

    Args:
        normalized_shape: int or tuple, the trailing dimensions to normalize.
        eps: added to the variance (default ``1e-5``).
        elementwise_affine: learn γ (``weight``, init 1) and β (``bias``, init 0).
        bias: learn β too (only with ``elementwise_affine``).

    Shape:
        input ``(*, *normalized_shape)``; output the same, in the input's dtype.

    dtypes: ``weight``/``bias`` must have the input's dtype, or be float32
    for float16/bfloat16 input (as :class:`torch.nn.LayerNorm`); anything
    else is a ``TypeError``. Statistics are computed in float32 (float64 for
    float64 input). Under ``torch.autocast`` it computes in the dtype torch's
    would: float32 on CUDA (autocast's list for ``layer_norm``), the input's
    dtype on CPU; normlib asks torch's dispatcher, it keeps no list of its own.

    A subclass of :class:`torch.nn.LayerNorm`: ``isinstance(m, torch.nn.LayerNorm)`` holds.

    Example:
        >>> ln = LayerNorm(4)
        >>> ln(torch.randn(2, 3, 4)).shape
        torch.Size([2, 3, 4])
        >>> ln
        normlib.LayerNorm((4,), eps=1e-05, elementwise_affine=True, bias=True)

    Computed by the implementation :func:`normlib.ops.routing.route` picks: the
    fused Triton kernels on CUDA tensors normalized over one dimension,
    torch's own op with its statistics checked on CPU, the reference math of
    :mod:`normlib.functional` wherever neither is right for the call.
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
        # normlib's checks and messages first; torch's constructor then registers
        # weight/bias (or None) and calls reset_parameters()
        super().__init__(normalize_shape(normalized_shape), check_eps(eps), elementwise_affine, bias, device, dtype)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor, residual: Optional[Tensor] = None):
        """``LayerNorm(input)``; with ``residual``, ``(LayerNorm(input + residual), input + residual)``.

        The sum is rounded to the residual's dtype and is exactly what is normalized: the Pre-Norm
        step ``x = x + branch; y = norm(x)`` in one call (one kernel on GPU).
        """
        return ops.dispatch.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, residual)



class RMSNorm(_NormlibRepr, nn.RMSNorm):
    r"""Root-mean-square normalization per sample (Zhang & Sennrich, 2019).

    .. math:: y = \frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}} \odot \gamma

    Args:
        normalized_shape: int or tuple, the trailing dimensions to normalize.
        eps: added to the mean square; ``None`` (default) means the machine
            epsilon of the compute dtype (float32 for float16/bfloat16/float32
            input), as :class:`torch.nn.RMSNorm` does.
        elementwise_affine: learn γ (``weight``, init 1).

    dtypes: any floating ``weight`` dtype, as :class:`torch.nn.RMSNorm`; the
    statistics are computed in float32 (float64 for float64 input) and the
    output has the input's dtype.

    A subclass of :class:`torch.nn.RMSNorm`: ``isinstance(m, torch.nn.RMSNorm)`` holds.

    Example:
        >>> RMSNorm(4)(torch.randn(2, 4)).shape
        torch.Size([2, 4])

    Computed by the implementation :func:`normlib.ops.routing.route` picks: the
    fused Triton kernels on CUDA tensors normalized over one dimension;
    torch's own op on float32/float64 CPU tensors where it returns its rstd
    (``torch._fused_rms_norm``), checked (a row beyond ~1.8e19 overflows
    there to zeros: normlib then computes it again); the reference math of
    :mod:`normlib.functional` wherever neither is right for the call.
    """

    def __init__(
        self,
        normalized_shape: _shape_t,
        eps: Optional[float] = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        eps = None if eps is None else check_eps(eps)
        super().__init__(normalize_shape(normalized_shape), eps, elementwise_affine, device, dtype)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, input: Tensor, residual: Optional[Tensor] = None):
        """``RMSNorm(input)``; with ``residual``, ``(RMSNorm(input + residual), input + residual)`` (as
        :meth:`LayerNorm.forward`)."""
        return ops.dispatch.rms_norm(input, self.normalized_shape, self.weight, self.eps, residual)



class GroupNorm(_NormlibRepr, nn.GroupNorm):
    r"""Group normalization (Wu & He, 2018): ``num_channels`` split into ``num_groups``.

    Args:
        num_groups: number of groups ``G``; must divide ``num_channels``.
        num_channels: number of channels ``C`` of the ``(N, C, *)`` input.
        eps: added to the variance (default ``1e-5``).
        affine: learn per-channel γ (``weight``) and β (``bias``).
        bias: (keyword-only) learn β too, when ``affine``.

    dtypes: as :class:`LayerNorm` (``weight``/``bias`` of the input's dtype,
    or float32 for float16/bfloat16 input; a ``TypeError`` otherwise).

    A subclass of :class:`torch.nn.GroupNorm`: ``isinstance(m, torch.nn.GroupNorm)`` holds.

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
        num_groups = check_positive_int(num_groups, "num_groups")
        num_channels = check_positive_int(num_channels, "num_channels")
        if num_channels % num_groups != 0:
            raise NormValueError(
                f"num_channels must be divisible by num_groups "
                f"(got num_channels={num_channels}, num_groups={num_groups})"
            )
        # torch < 2.13 has no `bias` argument: then drop the bias after construction
        extra = {"bias": bias} if _accepts_bias(nn.GroupNorm) else {}
        super().__init__(num_groups, num_channels, check_eps(eps), affine, device, dtype, **extra)
        if affine and not bias and self.bias is not None:
            self.register_parameter("bias", None)  # what `self.bias = None` does, typed

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return ops.dispatch.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)


