"""Autograd Functions around the Triton launchers (the third tier)."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import _kernels


def _rows(t: torch.Tensor, N: int) -> tuple[torch.Tensor, int]:
    """``t`` and the stride between its rows, copying only when rows are not evenly spaced."""
    rs = _kernels.row_stride(t, N)
    if rs is None:
        t = t.contiguous()
        rs = N
    return t, rs


class FusedNormFunction(torch.autograd.Function):
    """y = norm(x [+ residual]) * weight [+ bias], and residual_out = x + residual.

    ``is_rms`` selects RMSNorm (no mean, no bias) over LayerNorm. Saves the
    normalized tensor (``x``, or ``residual_out``), the weight and the per-row
    statistics: the backward pass recomputes x̂ from them.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms, out_dtype=None, w_plus_one=False, round_xhat=0):
        N = x.shape[-1]
        x, sx = _rows(x, N)
        sr = 0
        if residual is not None:
            residual, sr = _rows(residual, N)
        y, res_out, mean, rstd = _kernels.norm_fwd(
            x, residual, weight, bias, eps, is_rms, strides=(sx, sr),
            out_dtype=out_dtype, w_plus_one=w_plus_one, round_xhat=round_xhat,
        )
        ctx.w_plus_one, ctx.round_xhat = w_plus_one, round_xhat
        if res_out is not None:
            ctx.save_for_backward(res_out, weight, mean, rstd)
            ctx.stride = N
        else:
            ctx.save_for_backward(x, weight, mean, rstd)
            ctx.stride = sx
        ctx.is_rms = is_rms
        ctx.x_dtype = x.dtype
        ctx.residual_dtype = residual.dtype if residual is not None else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y, res_out

    @staticmethod
    @once_differentiable  # the kernels' gradients have no graph of their own: double backward raises
    def backward(ctx, dy, dres_out):
        normalized, w, mean, rstd = ctx.saved_tensors
        N = normalized.shape[-1]
        if dy is None:  # only residual_out was used
            dy = torch.zeros_like(normalized, dtype=ctx.x_dtype)
        dy, sdy = _rows(dy, N)
        sdres = 0
        if ctx.residual_dtype is not None and dres_out is not None:
            dres_out, sdres = _rows(dres_out, N)
        else:
            dres_out = None
        dx, dresidual, dweight, dbias = _kernels.norm_bwd(
            dy,
            dres_out,
            normalized,
            w,
            ctx.bias_dtype,
            mean,
            rstd,
            ctx.is_rms,
            ctx.x_dtype,
            ctx.residual_dtype,
            strides=(ctx.stride, sdy, sdres),
            w_plus_one=ctx.w_plus_one,
            round_xhat=ctx.round_xhat,
        )
        return dx, dresidual, dweight, dbias, None, None, None, None, None
