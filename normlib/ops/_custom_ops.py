"""The fused norms as ``torch.library`` custom ops, so that ``torch.compile`` keeps the kernels.

Dynamo cannot trace into a Triton launcher written in Python, so without this
module a compiled model traces normlib's reference math and lets inductor
generate its own kernels. Registered as opaque operators with fake (shape-only)
implementations and an autograd formula, the fused kernels stay in the compiled
graph as single nodes::

    normlib::fused_norm(x, residual?, weight?, bias?, eps, is_rms, out_dtype?, w_plus_one, round_xhat)
        -> (y, residual_out, mean, rstd)
    normlib::fused_norm_backward(dy, dresidual_out?, normalized, weight?, mean, rstd,
                                 is_rms, x_dtype, residual_dtype?, bias_dtype?, w_plus_one, round_xhat)
        -> (dx, dresidual, dweight, dbias)

(``out_dtype``, ``w_plus_one`` and ``round_xhat`` are the rounding-order
switches of :mod:`normlib.interop`.)

An operator cannot return ``None``: an output that does not exist (no
residual, no mean for RMSNorm, no weight or bias gradient) is an empty
tensor, and :func:`fused_norm` maps it back to ``None``.

On tensors the kernels do not run on (see
:func:`normlib.ops.routing.kernels_run_on`: CPU tensors, unless inside
``force_path("fused")`` with Triton's interpreter) the operators compute
the same outputs, with the same per-row statistics, in plain PyTorch, so
they are correct on every device.
"""

# No `from __future__ import annotations` here: torch 2.4-2.5 infer an
# operator's schema from real annotation objects, not strings.
from typing import Any, Optional, Tuple

import torch
from torch import Tensor

from ._rounding import round_xhat as _rounded
from .routing import kernels_run_on

# Importing this module registers the operators; it does not import Triton
# (the kernels are imported when an operator first runs on a device that has them).

__all__ = ["fused_norm"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty(like: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    return torch.empty((0,), dtype=dtype or like.dtype, device=like.device)


def _reference_forward(x, residual, weight, bias, eps, is_rms, out_dtype=None, w_plus_one=False, round_xhat=0):
    """What the forward kernel computes, in PyTorch ops: same rounding points, same statistics."""
    N = x.shape[-1]
    acc = _acc(x.dtype)
    xa = x.reshape(-1, N).to(acc)  # (M, N)
    res_out = None
    if residual is not None:
        res_out = (xa + residual.reshape(-1, N).to(acc)).to(residual.dtype)
        xa = res_out.to(acc)
    if is_rms:
        mean = None
        var = (xa * xa).mean(-1)
        xc = xa
    else:
        d = xa - xa[:, :1]  # shifted by the row's first element, as the kernel does
        mean = d.mean(-1)  # (M,) mean minus the first element
        xc = d - mean[:, None]
        var = (xc * xc).mean(-1)
    rstd = 1.0 / torch.sqrt(var + eps)
    rstd = torch.where(torch.isinf(var), torch.full_like(rstd, float("nan")), rstd)  # as the kernel: NaN, not 0
    y = xc * rstd[:, None]
    y = _rounded(y, round_xhat, x.dtype, weight)
    if weight is not None:
        y = y * (weight.to(acc) + 1.0 if w_plus_one else weight.to(acc))
    if bias is not None:
        y = y + bias.to(acc)
    y = y.to(out_dtype or x.dtype).reshape(x.shape)
    res_out = res_out.reshape(x.shape) if res_out is not None else None
    return y, res_out, mean, rstd


def _reference_backward(dy, dres, normalized, weight, mean, rstd, is_rms, x_dtype, residual_dtype, bias_dtype,
                        w_plus_one=False, round_xhat=0):
    """The backward kernel's formulas in PyTorch ops."""
    N = normalized.shape[-1]
    acc = _acc(normalized.dtype)
    xa = normalized.reshape(-1, N).to(acc)
    r = rstd[:, None]
    xhat = xa * r if is_rms else ((xa - xa[:, :1]) - mean[:, None]) * r
    g = dy.reshape(-1, N).to(acc)
    w = (weight.to(acc) + 1.0 if w_plus_one else weight.to(acc)) if weight is not None else None
    wdy = g * w if weight is not None else g  # ĝ = γ ⊙ dy
    dweight = (g * _rounded(xhat, round_xhat, x_dtype, weight)).sum(0).to(weight.dtype) if weight is not None else None
    dbias = g.sum(0).to(bias_dtype) if bias_dtype is not None else None
    c1 = (xhat * wdy).mean(-1, keepdim=True)
    dx = (wdy - xhat * c1) * r if is_rms else (wdy - (xhat * c1 + wdy.mean(-1, keepdim=True))) * r
    if dres is not None:
        dx = dx + dres.reshape(-1, N).to(acc)
    dresidual = dx.to(residual_dtype, copy=True).reshape(normalized.shape) if residual_dtype is not None else None
    return dx.to(x_dtype).reshape(normalized.shape), dresidual, dweight, dbias


@torch.library.custom_op("normlib::fused_norm", mutates_args=())
def _fused_norm_op(
    x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float, is_rms: bool,
    out_dtype: Optional[torch.dtype], w_plus_one: bool, round_xhat: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    opts: dict[str, Any] = dict(out_dtype=out_dtype, w_plus_one=w_plus_one, round_xhat=round_xhat)
    if kernels_run_on(x):
        from . import _functions, _kernels

        N = x.shape[-1]
        x, sx = _functions._rows(x, N)
        sr = 0
        if residual is not None:
            residual, sr = _functions._rows(residual, N)
        y, res_out, mean, rstd = _kernels.norm_fwd(x, residual, weight, bias, eps, is_rms, strides=(sx, sr), **opts)
    else:
        y, res_out, mean, rstd = _reference_forward(x, residual, weight, bias, eps, is_rms, **opts)
    return (
        y,
        res_out if res_out is not None else _empty(x),
        mean if mean is not None else _empty(rstd),
        rstd,
    )


@_fused_norm_op.register_fake
def _(x, residual, weight, bias, eps, is_rms, out_dtype, w_plus_one, round_xhat):
    M = x.numel() // x.shape[-1]
    acc = _acc(x.dtype)
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    res_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual is not None else _empty(x)
    rstd = x.new_empty((M,), dtype=acc)
    mean = _empty(rstd) if is_rms else x.new_empty((M,), dtype=acc)
    return y, res_out, mean, rstd


@torch.library.custom_op("normlib::fused_norm_backward", mutates_args=())
def _fused_norm_backward_op(
    dy: Tensor,
    dres: Optional[Tensor],
    normalized: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    is_rms: bool,
    x_dtype: torch.dtype,
    residual_dtype: Optional[torch.dtype],
    bias_dtype: Optional[torch.dtype],
    w_plus_one: bool,
    round_xhat: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    args = (dy, dres, normalized, weight, None if is_rms else mean, rstd, is_rms, x_dtype, residual_dtype, bias_dtype)
    opts: dict[str, Any] = dict(w_plus_one=w_plus_one, round_xhat=round_xhat)
    if kernels_run_on(normalized):
        from . import _functions, _kernels

        N = normalized.shape[-1]
        dy, sdy = _functions._rows(dy, N)
        normalized, sx = _functions._rows(normalized, N)
        sdres = 0
        if dres is not None:
            dres, sdres = _functions._rows(dres, N)
        dx, dresidual, dweight, dbias = _kernels.norm_bwd(
            dy, dres, normalized, weight, bias_dtype, args[4], rstd, is_rms, x_dtype, residual_dtype,
            strides=(sx, sdy, sdres), **opts,
        )
    else:
        dx, dresidual, dweight, dbias = _reference_backward(*args, **opts)
    return (
        dx,
        dresidual if dresidual is not None else _empty(dx),
        dweight if dweight is not None else _empty(dx),
        dbias if dbias is not None else _empty(dx),
    )


@_fused_norm_backward_op.register_fake
def _(dy, dres, normalized, weight, mean, rstd, is_rms, x_dtype, residual_dtype, bias_dtype, w_plus_one, round_xhat):
    N = normalized.shape[-1]
    dx = torch.empty(normalized.shape, dtype=x_dtype, device=normalized.device)
    dres_in = torch.empty(normalized.shape, dtype=residual_dtype, device=dx.device) if residual_dtype else _empty(dx)
    dweight = torch.empty((N,), dtype=weight.dtype, device=dx.device) if weight is not None else _empty(dx)
    dbias = torch.empty((N,), dtype=bias_dtype, device=dx.device) if bias_dtype is not None else _empty(dx)
    return dx, dres_in, dweight, dbias


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, is_rms, out_dtype, w_plus_one, round_xhat = inputs
    ctx.w_plus_one, ctx.round_xhat = w_plus_one, round_xhat
    y, res_out, mean, rstd = output
    ctx.save_for_backward(res_out if residual is not None else x, weight, mean, rstd)
    ctx.is_rms = is_rms
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.has_weight = weight is not None


def _backward(ctx, dy, dres_out, _dmean, _drstd):
    normalized, weight, mean, rstd = ctx.saved_tensors
    has_res = ctx.residual_dtype is not None
    dx, dres, dweight, dbias = _fused_norm_backward_op(
        dy, dres_out if has_res else None, normalized, weight, mean, rstd,
        ctx.is_rms, ctx.x_dtype, ctx.residual_dtype, ctx.bias_dtype, ctx.w_plus_one, ctx.round_xhat,
    )
    return (
        dx,
        dres if has_res else None,
        dweight if ctx.has_weight else None,
        dbias if ctx.bias_dtype is not None else None,
        None,
        None,
        None,
        None,
        None,
    )


_fused_norm_op.register_autograd(_backward, setup_context=_setup_context)


def fused_norm(x, residual, weight, bias, eps, is_rms, out_dtype=None, w_plus_one=False, round_xhat=0):
    """``(y, residual_out or None)`` through the ``normlib::fused_norm`` operator."""
    y, res_out, _, _ = _fused_norm_op(x, residual, weight, bias, eps, bool(is_rms), out_dtype, bool(w_plus_one),
                                      int(round_xhat))
    return y, (res_out if residual is not None else None)
