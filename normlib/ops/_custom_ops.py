"""The fused norms as ``torch.library`` custom ops, so that ``torch.compile`` keeps the kernels.

Dynamo cannot trace into a Triton launcher written in Python, so without this
module a compiled model traces normlib's reference math and lets inductor
generate its own kernels. Registered as opaque operators with fake (shape-only)
implementations and an autograd formula, the fused kernels stay in the compiled
graph as single nodes::

    normlib::fused_norm(x, residual?, weight?, bias?, eps, rms, rounding)
        -> (y, residual_out, mean, rstd)
    normlib::fused_norm_backward(dy, dresidual_out?, normalized, weight?, mean, rstd,
                                 rms, x_dtype, residual_dtype?, bias_dtype?, rounding)
        -> (dx, dresidual, dweight, dbias)

(``rounding`` is the name of a :class:`~normlib.ops.rounding.Rounding`:
where values are rounded, and the output's dtype.)

An operator cannot return ``None``: an output that does not exist (no
residual, no mean for RMSNorm, no weight or bias gradient) is an empty
tensor, and :func:`fused_norm` maps it back to ``None``.

On tensors the kernels do not run on (see
:func:`normlib.ops.routing.kernels_run_on`: CPU tensors, unless inside
``force_path("fused")`` with Triton's interpreter) the operators compute
the same outputs, with the same per-row statistics, in plain PyTorch
(:mod:`normlib.ops._twin`), so they are correct on every device.
"""

# No `from __future__ import annotations` here: torch 2.4-2.5 infer an
# operator's schema from real annotation objects, not strings.
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..numerics import acc_dtype
from . import _twin
from .rounding import ROUNDINGS, TORCH, Rounding
from .routing import kernels_run_on

# Importing this module registers the operators; it does not import Triton
# (the kernels are imported when an operator first runs on a device that has them).

__all__ = ["fused_norm"]


def _empty(like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty((0,), dtype=dtype or like.dtype, device=like.device)


def _or_empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    return t if t is not None else _empty(like)


@torch.library.custom_op("normlib::fused_norm", mutates_args=())
def _fused_norm_op(
    x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float, rms: bool,
    rounding: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    r = ROUNDINGS[rounding]
    if kernels_run_on(x):
        from . import _functions

        y, res_out, mean, rstd = _functions.forward(x, residual, weight, bias, eps, rms, r)
    else:
        y, res_out, mean, rstd = _twin.forward(x, residual, weight, bias, eps, rms, r)
    return y, _or_empty(res_out, x), _or_empty(mean, rstd), rstd


@_fused_norm_op.register_fake
def _(x, residual, weight, bias, eps, rms, rounding):
    M = x.numel() // x.shape[-1]
    acc = acc_dtype(x.dtype)
    out = ROUNDINGS[rounding].out_dtype(x.dtype, weight, bias)
    y = torch.empty(x.shape, dtype=out, device=x.device)
    res_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual is not None else _empty(x)
    rstd = x.new_empty((M,), dtype=acc)
    mean = _empty(rstd) if rms else x.new_empty((M,), dtype=acc)
    return y, res_out, mean, rstd


@torch.library.custom_op("normlib::fused_norm_backward", mutates_args=())
def _fused_norm_backward_op(
    dy: Tensor,
    dres: Optional[Tensor],
    normalized: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    rms: bool,
    x_dtype: torch.dtype,
    residual_dtype: Optional[torch.dtype],
    bias_dtype: Optional[torch.dtype],
    rounding: str,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    args = (dy, dres, normalized, weight, None if rms else mean, rstd, rms, x_dtype, residual_dtype, bias_dtype,
            ROUNDINGS[rounding])
    if kernels_run_on(normalized):
        from . import _functions

        dx, dresidual, dweight, dbias = _functions.backward(*args)
    else:
        dx, dresidual, dweight, dbias = _twin.backward(*args)
    return dx, _or_empty(dresidual, dx), _or_empty(dweight, dx), _or_empty(dbias, dx)


@_fused_norm_backward_op.register_fake
def _(dy, dres, normalized, weight, mean, rstd, rms, x_dtype, residual_dtype, bias_dtype, rounding):
    N = normalized.shape[-1]
    dx = torch.empty(normalized.shape, dtype=x_dtype, device=normalized.device)
    dres_in = torch.empty(normalized.shape, dtype=residual_dtype, device=dx.device) if residual_dtype else _empty(dx)
    dweight = torch.empty((N,), dtype=weight.dtype, device=dx.device) if weight is not None else _empty(dx)
    dbias = torch.empty((N,), dtype=bias_dtype, device=dx.device) if bias_dtype is not None else _empty(dx)
    return dx, dres_in, dweight, dbias


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, rms, rounding = inputs
    _, res_out, mean, rstd = output
    _twin.save(ctx, x, residual, weight, bias, eps, rms, ROUNDINGS[rounding], res_out, mean, rstd)


def _backward(ctx, dy, dres_out, _dmean, _drstd):
    if torch.is_grad_enabled():  # create_graph=True: a differentiable gradient, as FusedNormFunction gives
        return _twin.differentiable_backward(ctx, dy, dres_out) + (None, None, None)
    normalized, weight, mean, rstd = ctx.saved_tensors
    has_res = ctx.residual_dtype is not None
    dx, dres, dweight, dbias = _fused_norm_backward_op(
        dy, dres_out if has_res else None, normalized, weight, mean, rstd,
        ctx.rms, ctx.x_dtype, ctx.residual_dtype, ctx.bias_dtype, ctx.rounding.name,
    )
    return (
        dx,
        dres if has_res else None,
        dweight if weight is not None else None,
        dbias if ctx.bias_dtype is not None else None,
        None,
        None,
        None,
    )


_fused_norm_op.register_autograd(_backward, setup_context=_setup_context)


def fused_norm(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
               *, rms: bool, rounding: Rounding = TORCH) -> Tuple[Tensor, Optional[Tensor]]:
    """``(y, residual_out or None)`` through the ``normlib::fused_norm`` operator."""
    y, res_out, _, _ = _fused_norm_op(x, residual, weight, bias, eps, bool(rms), rounding.name)
    return y, (res_out if residual is not None else None)
