"""Each norm, validated once, planned once, computed by what :func:`~normlib.ops.routing.plan` names.

The functions here take torch.nn.functional's arguments, ask once whether
any autocast is on (and only then apply torch's autocast policy,
:mod:`normlib._autocast`), check the arguments (:mod:`normlib._checks`, the
one place their messages live), ask :func:`~normlib.ops.routing.plan` once,
and run what it names:

* ``"fused"``, ``"fused:grad"``, ``"fused:op"``: the Triton kernels, called
  directly, through their autograd Function, or as the custom operator
  (:func:`fused`);
* ``"native"``: torch's op, whose statistics :mod:`normlib.ops.native` checks;
  when it does not trust them the call is computed by the reference instead;
* ``"reference"``: :mod:`normlib.functional`'s autograd Functions.

normlib's modules (``LayerNorm``, ``BatchNorm2d``, ...) and the public
functions of :mod:`normlib.ops` call these.
"""

from __future__ import annotations

import contextlib
from typing import Optional, cast

import torch
from torch import Tensor

from .. import functional as F
from .._autocast import any_autocast, autocast_float32, runs_in_float32
from .._checks import (check_batch_norm_args, check_float_tensor, check_group_norm_args, check_instance_norm_args,
                       check_layer_norm_args, check_rms_norm_args)
from ..numerics import acc_dtype
from . import native
from . import _custom_ops  # registers normlib::fused_norm and its backward with torch.library
from .rounding import FLOAT32_OUT, TORCH, Rounding
from .routing import FUSED_GRAD, FUSED_OP, NATIVE, REFERENCE, plan
from ..errors import NormValueError

__all__ = ["layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "add_norm", "fused"]

_HALF = (torch.float16, torch.bfloat16)
_NO_AUTOCAST = contextlib.nullcontext()  # reusable: entering it does nothing


def fused(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float, *,
          rms: bool, rounding: Rounding = TORCH, how: str = FUSED_GRAD) -> tuple[Tensor, Optional[Tensor]]:
    """The kernels on checked arguments: ``(y, residual_out)``, entered as ``how`` (a fused plan) says.

    ``"fused:op"``: the custom operator (while ``torch.compile`` traces);
    ``"fused:grad"``: the autograd Function; ``"fused"``: the launchers
    directly, recording no graph. ``rounding`` selects another library's
    rounding order (see :mod:`normlib.ops.rounding`).
    """
    # The kernels read γ and β with unit stride: a strided or expanded one is copied (differentiably) first.
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if how == FUSED_OP:
        return _custom_ops.fused_norm(x, residual, weight, bias, eps, rms=rms, rounding=rounding)
    from . import _functions  # Triton is imported on first use only

    if how == FUSED_GRAD:
        return _functions.FusedNormFunction.apply(x, residual, weight, bias, eps, rms, rounding)
    y, res_out, _, _ = _functions.forward(x, residual, weight, bias, eps, rms, rounding)
    return y, res_out


def _autocast(op: str, input: Tensor, *others: Optional[Tensor]) -> tuple:
    """``(context, autocast, input, *others)``: torch's autocast policy applied where any autocast is on.

    ``autocast`` is what :func:`~normlib.ops.routing.plan` is told: ``False``
    when none is on (the common call: one question to torch), else ``None``,
    so that it asks about the input's device itself, inside the context.
    """
    if not any_autocast():
        return (_NO_AUTOCAST, False, input) + others
    ctx, *cast_ = autocast_float32(op, input, *others)
    return (ctx, None, *cast_)


def layer_norm(input: Tensor, normalized_shape, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5, residual: Optional[Tensor] = None):
    """:func:`normlib.functional.layer_norm`, by the implementation the plan picks.

    With ``residual``: ``(y, residual_out)`` as :func:`add_norm` (normalized over the last dimension).
    """
    if residual is not None:
        return add_norm(input, residual, weight, bias, eps, rms=False, normalized_shape=normalized_shape)
    # _autocast written out, here and in the other hot entries: the one question every call asks torch
    if any_autocast():
        (ctx, input, weight, bias), amp = autocast_float32("layer_norm", input, weight, bias), None
    else:
        ctx, amp = _NO_AUTOCAST, False
    shape, eps = check_layer_norm_args(input, normalized_shape, weight, bias, eps)
    with ctx:
        how = plan("layer_norm", input, None, weight, bias, rows=len(shape) == 1, autocast=amp)
        if how == NATIVE:
            y = native.layer_norm(input, shape, weight, bias, eps)
            if y is not None:
                return y
        elif how != REFERENCE:
            return fused(input, None, weight, bias, eps, rms=False, how=how)[0]
        return F._layer_norm(input, shape, weight, bias, eps)


def rms_norm(input: Tensor, normalized_shape, weight: Optional[Tensor] = None, eps: Optional[float] = None,
             residual: Optional[Tensor] = None):
    """:func:`normlib.functional.rms_norm`, by the implementation the plan picks.

    With ``residual``: ``(y, residual_out)`` as :func:`add_norm` (normalized over the last dimension).
    """
    if residual is not None:
        return add_norm(input, residual, weight, None, eps, rms=True, normalized_shape=normalized_shape)
    if any_autocast():
        (ctx, input, weight), amp = autocast_float32("rms_norm", input, weight), None
    else:
        ctx, amp = _NO_AUTOCAST, False
    shape, eps = check_rms_norm_args(input, normalized_shape, weight, eps)
    with ctx:
        how = plan("rms_norm", input, None, weight, rows=len(shape) == 1, autocast=amp)
        if how == NATIVE:
            y = native.rms_norm(input, shape, weight, eps)
            if y is not None:
                return y
        elif how != REFERENCE:
            return fused(input, None, weight, None, eps, rms=True, how=how)[0]
        return F._rms_norm(input, shape, weight, eps)


def group_norm(input: Tensor, num_groups: int, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """:func:`normlib.functional.group_norm`, by the implementation the plan picks."""
    if any_autocast():
        (ctx, input, weight, bias), amp = autocast_float32("group_norm", input, weight, bias), None
    else:
        ctx, amp = _NO_AUTOCAST, False
    G, eps = check_group_norm_args(input, num_groups, weight, bias, eps)
    with ctx:
        if plan("group_norm", input, None, weight, bias, rows=False, autocast=amp) == NATIVE:
            y = native.group_norm(input, G, weight, bias, eps)
            if y is not None:
                return y
        return F._group_norm(input, G, weight, bias, eps)


def batch_norm(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
               weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """:func:`normlib.functional.batch_norm`, by the implementation the plan picks."""
    if any_autocast():
        (ctx, input, running_mean, running_var, weight, bias), amp = autocast_float32(
            "batch_norm", input, running_mean, running_var, weight, bias
        ), None
    else:
        ctx, amp = _NO_AUTOCAST, False
    momentum, eps = check_batch_norm_args(input, running_mean, running_var, weight, bias, training, momentum, eps)
    with ctx:
        op = "batch_norm" if training else "batch_norm_eval"
        if plan(op, input, None, weight, bias, rows=False, autocast=amp) == NATIVE:
            y = native.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
            if y is not None:
                return y
        return F._batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


def instance_norm(input: Tensor, running_mean: Optional[Tensor] = None, running_var: Optional[Tensor] = None,
                  weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """:func:`normlib.functional.instance_norm`, by the implementation the plan picks.

    Without running statistics to record, InstanceNorm is GroupNorm with one
    channel per group, and runs as torch's ``native_group_norm``.
    """
    ctx, amp, input, running_mean, running_var, weight, bias = _autocast(
        "instance_norm", input, running_mean, running_var, weight, bias
    )
    momentum, eps = check_instance_norm_args(input, running_mean, running_var, weight, bias, use_input_stats,
                                             momentum, eps)
    with ctx:
        if (use_input_stats and running_mean is None
                and plan("instance_norm", input, None, weight, bias, rows=False, autocast=amp) == NATIVE):
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
             *, rms: bool, normalized_shape=None) -> tuple[Tensor, Tensor]:
    """``(norm(x + residual), x + residual)``: the residual sum in the residual's dtype, ``y`` in ``x``'s.

    Normalized over the last dimension (``normalized_shape``, where a module
    passes its own, must be that). Under autocast γ/β are taken in float32
    and ``y`` is float32 where torch runs the norm in float32, as torch's
    autocast does for the unfused pair.
    """
    op = "rms_norm" if rms else "layer_norm"
    check_float_tensor(x)
    check_float_tensor(residual, "residual")
    if x.dim() == 0:
        raise NormValueError("input must have at least one dimension (got a 0-D tensor)")
    if residual.shape != x.shape:
        raise NormValueError(f"residual must have the shape of input {list(x.shape)} (got {list(residual.shape)})")
    if residual.device != x.device:
        raise NormValueError(f"residual must be on the input's device {x.device} (got {residual.device})")
    shape = tuple(x.shape[-1:])
    if normalized_shape is not None and tuple(normalized_shape) != shape:
        raise NormValueError(f"a residual is added to norms over the last dimension alone: normalized_shape must be "
                         f"{list(shape)} for input of shape {list(x.shape)} (got {list(normalized_shape)})")
    f32 = runs_in_float32(op, x)
    if f32:
        weight, bias = _to_float32(weight), _to_float32(bias)
    if rms:
        _, eps = check_rms_norm_args(x, shape, weight, eps)
    else:
        _, eps = check_layer_norm_args(x, shape, weight, bias, eps)
    rounding = FLOAT32_OUT if f32 and x.dtype in _HALF else TORCH
    how = plan(op, x, residual, weight, bias)
    if how not in (NATIVE, REFERENCE):
        y_fused, fused_sum = fused(x, residual, weight, bias, eps, rms=rms, rounding=rounding, how=how)
        return y_fused, cast(Tensor, fused_sum)  # never None: a residual was given
    res_out = _reference_add(x, residual)
    y = None
    if how == NATIVE:
        y = native.rms_norm(res_out, shape, weight, eps) if rms else native.layer_norm(res_out, shape, weight, bias, eps)
    if y is None:
        y = F._rms_norm(res_out, shape, weight, eps) if rms else F._layer_norm(res_out, shape, weight, bias, eps)
    return y.to(rounding.out_dtype(x.dtype)), res_out
