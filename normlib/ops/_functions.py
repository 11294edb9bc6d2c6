"""Autograd Functions around the Triton launchers (the third tier)."""

from __future__ import annotations

import torch

from . import _kernels, _twin
from .rounding import TORCH


def _rows(t: torch.Tensor, N: int) -> tuple[torch.Tensor, int]:
    """``t`` and the stride between its rows, copying only when rows are not evenly spaced."""
    rs = _kernels.row_stride(t, N)
    if rs is None:
        t = t.contiguous()
        rs = N
    return t, rs


def forward(x, residual, weight, bias, eps, rms, rounding=TORCH):
    """The forward kernel on any evenly spaced rows: ``(y, residual_out, mean, rstd)``."""
    N = x.shape[-1]
    if x.is_contiguous():  # the common call: its rows are N apart (what _rows answers, without its frames)
        sx = N
    else:
        x, sx = _rows(x, N)
    sr = 0
    if residual is not None:
        residual, sr = _rows(residual, N)
    return _kernels.norm_fwd(x, residual, weight, bias, eps, rms, strides=(sx, sr), rounding=rounding)


def backward(dy, dres, normalized, weight, mean, rstd, rms, x_dtype, residual_dtype, bias_dtype, rounding=TORCH):
    """The backward kernel on any evenly spaced rows: ``(dx, dresidual, dweight, dbias)``."""
    N = normalized.shape[-1]
    # the common call: both contiguous, rows N apart (what _rows answers, without its frames)
    if normalized.is_contiguous() and dy.is_contiguous():
        sx = sdy = N
    else:
        normalized, sx = _rows(normalized, N)
        dy, sdy = _rows(dy, N)
    sdres = 0
    if dres is not None:
        dres, sdres = _rows(dres, N)
    return _kernels.norm_bwd(dy, dres, normalized, weight, bias_dtype, mean, rstd, rms, x_dtype, residual_dtype,
                             strides=(sx, sdy, sdres), rounding=rounding)


class FusedNormFunction(torch.autograd.Function):
    """y = norm(x [+ residual]) * weight [+ bias], and residual_out = x + residual.

    ``forward(x, residual, weight, bias, eps, rms, rounding)``: ``rms``
    selects RMSNorm (no mean, no bias) over LayerNorm, ``rounding`` a
    :class:`~normlib.ops.rounding.Rounding`. What it saves is
    :func:`normlib.ops._twin.save`'s decision: the backward recomputes x̂.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, rms, rounding):
        y, res_out, mean, rstd = forward(x, residual, weight, bias, eps, rms, rounding)
        _twin.save(ctx, x, residual, weight, bias, eps, rms, rounding, res_out, mean, rstd)
        return y, res_out

    @staticmethod
    def backward(ctx, dy, dres_out):
        if torch.is_grad_enabled():  # create_graph=True: the gradient must itself be differentiable
            return _twin.differentiable_backward(ctx, dy, dres_out) + (None, None, None)
        normalized, weight, mean, rstd = ctx.saved_tensors
        if dy is None:  # only residual_out was used
            dy = torch.zeros_like(normalized, dtype=ctx.x_dtype)
        dres = dres_out if ctx.residual_dtype is not None else None
        grads = backward(dy, dres, normalized, weight, mean, rstd, ctx.rms, ctx.x_dtype, ctx.residual_dtype,
                         ctx.bias_dtype, ctx.rounding)
        return grads + (None, None, None)
