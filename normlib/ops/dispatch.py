"""Each norm, validated once, routed once, computed by the implementation :func:`~normlib.ops.routing.route` names.

The functions here take torch.nn.functional's arguments, apply torch's
autocast policy (:mod:`normlib._autocast`), check the arguments with
:mod:`normlib.functional`'s checks (the one place their messages live),
ask :func:`~normlib.ops.routing.route` once, and run:

* ``"fused"``: the Triton kernels (:func:`fused`);
* ``"native"``: torch's op, whose statistics :mod:`normlib.ops.native` checks;
  when it does not trust them the call is computed by the reference instead;
* ``"reference"``: :mod:`normlib.functional`'s autograd Functions.

normlib's modules (``LayerNorm``, ``BatchNorm2d``, ...) and the public
functions of :mod:`normlib.ops` call these.
"""

from __future__ import annotations

from typing import Optional, cast

import torch
from torch import Tensor

from .. import functional as F
from .._autocast import autocast_float32, runs_in_float32
from .._checks import check_float_tensor
from ..numerics import acc_dtype
from . import native
from . import _custom_ops  # registers normlib::fused_norm and its backward with torch.library
from .rounding import FLOAT32_OUT, TORCH, Rounding
from .routing import FUSED, NATIVE, route

__all__ = ["layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "add_norm", "fused"]

_HALF = (torch.float16, torch.bfloat16)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def fused(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float, *,
          rms: bool, rounding: Rounding = TORCH) -> tuple[Tensor, Optional[Tensor]]:
    """The kernels on checked arguments: ``(y, residual_out)``.

    Through the custom operator while ``torch.compile`` traces, through the
    autograd Function when a gradient is wanted, directly otherwise.
    ``rounding`` selects another library's rounding order (see
    :mod:`normlib.ops.rounding`).
    """
    from . import _functions  # Triton is imported on first use only

    if torch.compiler.is_compiling():
        return _custom_ops.fused_norm(x, residual, weight, bias, eps, rms=rms, rounding=rounding)
    if _needs_grad(x, residual, weight, bias):
        return _functions.FusedNormFunction.apply(x, residual, weight, bias, eps, rms, rounding)
    y, res_out, _, _ = _functions.forward(x, residual, weight, bias, eps, rms, rounding)
    return y, res_out


def layer_norm(input: Tensor, normalized_shape, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """:func:`normlib.functional.layer_norm`, by the implementation the route picks."""
    ctx, input, weight, bias = autocast_float32("layer_norm", input, weight, bias)
    shape, eps = F.check_layer_norm_args(input, normalized_shape, weight, bias, eps)
    with ctx:
        path = route("layer_norm", input, None, weight, bias, rows=len(shape) == 1)
        if path == FUSED:
            return fused(input, None, weight, bias, eps, rms=False)[0]
        if path == NATIVE and input.numel():
            y = native.layer_norm(input, shape, weight, bias, eps)
            if y is not None:
                return y
        return F._layer_norm(input, shape, weight, bias, eps)


def rms_norm(input: Tensor, normalized_shape, weight: Optional[Tensor] = None, eps: Optional[float] = None) -> Tensor:
    """:func:`normlib.functional.rms_norm`, by the implementation the route picks (never native: see route)."""
    ctx, input, weight = autocast_float32("rms_norm", input, weight)
    shape, eps = F.check_rms_norm_args(input, normalized_shape, weight, eps)
    with ctx:
        if route("rms_norm", input, None, weight, rows=len(shape) == 1) == FUSED:
            return fused(input, None, weight, None, eps, rms=True)[0]
        return F._rms_norm(input, shape, weight, eps)


def group_norm(input: Tensor, num_groups: int, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """:func:`normlib.functional.group_norm`, by the implementation the route picks."""
    ctx, input, weight, bias = autocast_float32("group_norm", input, weight, bias)
    G, eps = F.check_group_norm_args(input, num_groups, weight, bias, eps)
    with ctx:
        if route("group_norm", input, None, weight, bias, rows=False) == NATIVE and input.numel():
            y = native.group_norm(input, G, weight, bias, eps)
            if y is not None:
                return y
        return F._group_norm(input, G, weight, bias, eps)


def batch_norm(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
               weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """:func:`normlib.functional.batch_norm`, by the implementation the route picks."""
    ctx, input, running_mean, running_var, weight, bias = autocast_float32(
        "batch_norm", input, running_mean, running_var, weight, bias
    )
    momentum, eps = F.check_batch_norm_args(input, running_mean, running_var, weight, bias, training, momentum, eps)
    with ctx:
        op = "batch_norm" if training else "batch_norm_eval"
        if route(op, input, None, weight, bias, rows=False) == NATIVE and input.numel():
            y = native.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
            if y is not None:
                return y
        return F._batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


def instance_norm(input: Tensor, running_mean: Optional[Tensor] = None, running_var: Optional[Tensor] = None,
                  weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """:func:`normlib.functional.instance_norm`, by the implementation the route picks.

    Without running statistics to record, InstanceNorm is GroupNorm with one
    channel per group, and runs as torch's ``native_group_norm``.
    """
    ctx, input, running_mean, running_var, weight, bias = autocast_float32(
        "instance_norm", input, running_mean, running_var, weight, bias
    )
    momentum, eps = F.check_instance_norm_args(input, running_mean, running_var, weight, bias, use_input_stats,
                                               momentum, eps)
    with ctx:
        if (use_input_stats and running_mean is None and input.numel()
                and route("instance_norm", input, None, weight, bias, rows=False) == NATIVE):
            y = native.group_norm(input, input.shape[1], weight, bias, eps)
            if y is not None:
                return y
        return F._instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)


def _to_float32(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.float() if t is not None and t.dtype in _HALF else t


def _reference_add(x: Tensor, residual: Tensor) -> Tensor:
    acc = acc_dtype(x.dtype, residual.dtype)
    return (x.to(acc) + residual.to(acc)).to(residual.dtype)


def add_norm(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: Optional[float],
             *, rms: bool) -> tuple[Tensor, Tensor]:
    """``(norm(x + residual), x + residual)``: the residual sum in the residual's dtype, ``y`` in ``x``'s.

    Under autocast γ/β are taken in float32 and ``y`` is float32 where torch
    runs the norm in float32, as torch's autocast does for the unfused pair.
    """
    op = "rms_norm" if rms else "layer_norm"
    check_float_tensor(x)
    check_float_tensor(residual, "residual")
    if x.dim() == 0:
        raise ValueError("input must have at least one dimension (got a 0-D tensor)")
    if residual.shape != x.shape:
        raise ValueError(f"residual must have the shape of input {list(x.shape)} (got {list(residual.shape)})")
    if residual.device != x.device:
        raise ValueError(f"residual must be on the input's device {x.device} (got {residual.device})")
    f32 = runs_in_float32(op, x)
    if f32:
        weight, bias = _to_float32(weight), _to_float32(bias)
    shape = x.shape[-1:]
    if rms:
        _, eps = F.check_rms_norm_args(x, shape, weight, eps)
    else:
        _, eps = F.check_layer_norm_args(x, shape, weight, bias, eps)
    rounding = FLOAT32_OUT if f32 and x.dtype in _HALF else TORCH
    path = route(op, x, residual, weight, bias)
    if path == FUSED:
        y_fused, fused_sum = fused(x, residual, weight, bias, eps, rms=rms, rounding=rounding)
        return y_fused, cast(Tensor, fused_sum)  # never None: a residual was given
    res_out = _reference_add(x, residual)
    y = None
    if path == NATIVE and not rms and res_out.numel():
        y = native.layer_norm(res_out, tuple(shape), weight, bias, eps)
    if y is None:
        y = F._rms_norm(res_out, tuple(shape), weight, eps) if rms else F._layer_norm(res_out, tuple(shape), weight, bias, eps)
    return y.to(rounding.out_dtype(x.dtype)), res_out
