"""How a norm is computed: the route, the fused kernels, torch's native ops, and the functions that use them.

Public functions (all differentiable, all correct on any device):

* :func:`layer_norm` ``(x, weight, bias, eps)`` and :func:`rms_norm` ``(x, weight, eps)``
  normalize over the last dimension;
* :func:`add_layer_norm` ``(x, residual, weight, bias, eps)`` and
  :func:`add_rms_norm` ``(x, residual, weight, eps)`` return ``(y, residual_out)``
  with ``residual_out = x + residual`` rounded to the residual's dtype and
  ``y`` the norm of exactly that value — the two halves of a Pre-Norm
  residual step, in one pass over memory on GPU.

Which implementation computes a call is decided in one place,
:func:`normlib.ops.routing.route`: the Triton kernels (``"fused"``), torch's
own op with its statistics checked (``"native"``), or :mod:`normlib.functional`
(``"reference"``). :func:`path_for` and :func:`use_fused` are views of it;
:func:`~normlib.ops.routing.force_path` pins it for a block of code. Triton is imported lazily,
on the first call that needs it; ``import normlib`` works without it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import dispatch
from ..errors import NormTypeError, NormValueError
from .routing import (HAS_TRITON, FUSED, NATIVE, REFERENCE, compile_mode, force_path, kernels_run_on, route,
                      set_compile_mode, use_compile_mode)

__all__ = [
    "HAS_TRITON",
    "route",
    "force_path",
    "path_for",
    "use_fused",
    "set_compile_mode",
    "use_compile_mode",
    "compile_mode",
    "layer_norm",
    "rms_norm",
    "add_layer_norm",
    "add_rms_norm",
]

_PATH_NAMES = {NATIVE: "native", REFERENCE: "reference"}


def path_for(x: Tensor, residual: Optional[Tensor] = None, op: str = "layer_norm") -> str:
    """Which implementation normalizes ``x`` (and adds ``residual``) over its last dimension: a view of :func:`~normlib.ops.routing.route`.

    Returns ``"triton"`` (the kernels on a CUDA tensor), ``"triton-interpreter"``
    (the kernels on a CPU tensor through Triton's interpreter, inside
    ``force_path("fused")``), ``"native"`` (torch's op, its statistics
    checked) or ``"reference"`` (:mod:`normlib.functional`). The kernels
    cover float16/bfloat16/float32/float64 rows of up to 64 KiB; ``op`` is
    ``"layer_norm"`` or ``"rms_norm"``.

    Example:
        >>> path_for(torch.randn(4, 8))  # a CPU tensor: torch's own LayerNorm, checked
        'native'
        >>> path_for(torch.randn(4, 8, dtype=torch.bfloat16))  # normlib's float32 accumulation
        'reference'
    """
    if not isinstance(x, torch.Tensor):
        raise NormTypeError(f"x must be a torch.Tensor (got {type(x).__name__})")
    if residual is not None and not isinstance(residual, torch.Tensor):
        raise NormTypeError(f"residual must be a torch.Tensor or None (got {type(residual).__name__})")
    if op not in ("layer_norm", "rms_norm"):
        raise NormValueError(f"op must be 'layer_norm' or 'rms_norm' (got {op!r})")
    path = route(op, x, residual)
    if path == FUSED:
        return "triton" if x.is_cuda else "triton-interpreter"
    return _PATH_NAMES[path]


def use_fused(x: Tensor, residual: Optional[Tensor] = None) -> bool:
    """Whether the route sends ``x`` (and ``residual``) through the kernels: a view of :func:`~normlib.ops.routing.route`."""
    # the kernels run only where they can run at all: a CPU tensor is answered without the whole route
    return isinstance(x, torch.Tensor) and kernels_run_on(x) and route("layer_norm", x, residual) == FUSED


def _rows_of(x) -> tuple:
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        raise NormValueError("input must have at least one dimension (got a 0-D tensor)")
    return tuple(x.shape[-1:]) if isinstance(x, torch.Tensor) else ()


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension, by the implementation :func:`~normlib.ops.routing.route` picks.

    Same result as ``normlib.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)``.
    """
    return dispatch.layer_norm(x, _rows_of(x), weight, bias, eps)


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: Optional[float] = None) -> Tensor:
    """RMSNorm over the last dimension; ``eps=None`` as in :func:`normlib.functional.rms_norm`."""
    return dispatch.rms_norm(x, _rows_of(x), weight, eps)


def add_layer_norm(
    x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """``residual_out = x + residual`` (in the residual's dtype) and ``y = LayerNorm(residual_out)``.

    Returns ``(y, residual_out)``; ``y`` has ``x``'s dtype. Gradients flow to
    ``x``, ``residual``, ``weight`` and ``bias`` through both outputs.
    """
    return dispatch.add_norm(x, residual, weight, bias, eps, rms=False)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: Optional[float] = None
) -> tuple[Tensor, Tensor]:
    """``residual_out = x + residual`` (in the residual's dtype) and ``y = RMSNorm(residual_out)``."""
    return dispatch.add_norm(x, residual, weight, None, eps, rms=True)
