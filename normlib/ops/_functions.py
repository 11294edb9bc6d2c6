"""Autograd Functions around the Triton launchers (the third tier)."""

from __future__ import annotations

import torch

from . import _kernels


def _as_rows(t: torch.Tensor, N: int) -> torch.Tensor:
    """View ``t`` as (M, N) rows with unit column stride, copying only if needed."""
    t2 = t.reshape(-1, N)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


class FusedNormFunction(torch.autograd.Function):
    """y = norm(x [+ residual]) * weight [+ bias], and residual_out = x + residual.

    ``is_rms`` selects RMSNorm (no mean, no bias) over LayerNorm.
    """

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms):
        shape = x.shape
        N = shape[-1]
        x2 = _as_rows(x, N)
        r2 = _as_rows(residual, N) if residual is not None else None
        w = weight.contiguous() if weight is not None else None
        b = bias.contiguous() if bias is not None else None
        y, res_out, mean, rstd = _kernels.norm_fwd(x2, r2, w, b, eps, is_rms)
        normalized = res_out if res_out is not None else x2
        ctx.save_for_backward(normalized, w, mean, rstd)
        ctx.is_rms = is_rms
        ctx.shape = shape
        ctx.x_dtype = x.dtype
        ctx.residual_dtype = residual.dtype if residual is not None else None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.has_residual = residual is not None
        y = y.view(shape)
        if res_out is None:
            return y, None
        return y, res_out.view(shape)

    @staticmethod
    def backward(ctx, dy, dres_out):
        normalized, w, mean, rstd = ctx.saved_tensors
        N = ctx.shape[-1]
        dy2 = _as_rows(dy, N)
        dres2 = _as_rows(dres_out, N) if (ctx.has_residual and dres_out is not None) else None
        dx, dresidual, dweight, dbias = _kernels.norm_bwd(
            dy2,
            dres2,
            normalized,
            w,
            ctx.bias_dtype,
            mean,
            rstd,
            ctx.is_rms,
            ctx.x_dtype,
            ctx.residual_dtype,
        )
        dx = dx.view(ctx.shape)
        if dresidual is not None:
            dresidual = dresidual.view(ctx.shape)
        return dx, dresidual, dweight, dbias, None, None
