"""Autograd Functions around the Triton launchers (the third tier)."""

from __future__ import annotations

import torch

from . import _kernels
from ._rounding import round_xhat


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
        ctx.eps, ctx.out_dtype = eps, out_dtype
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
    def backward(ctx, dy, dres_out):
        normalized, w, mean, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the gradient must itself be differentiable
            return _differentiable_backward(ctx, normalized, w, dy, dres_out)
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


def _differentiable_backward(ctx, normalized, weight, dy, dres_out):
    """The gradients as a graph of PyTorch ops, for a second derivative (``create_graph=True``).

    The kernels' gradients are plain numbers with no graph behind them. When
    autograd asks for a differentiable gradient, the backward formula runs in
    PyTorch ops instead, with the statistics recomputed from the saved input,
    so that a gradient of the gradient (``gradgradcheck``, gradient penalties,
    Hessian-vector products) follows how they depend on it. Same formula and
    rounding points as the kernels' backward (x̂ rounded only where γ's
    gradient sees it).
    """
    need_x, need_res, need_w, need_b = ctx.needs_input_grad[:4]
    has_res = ctx.residual_dtype is not None
    N = normalized.shape[-1]
    acc = torch.float64 if normalized.dtype == torch.float64 else torch.float32
    xa = normalized.reshape(-1, N).to(acc)  # (M, N)
    if ctx.is_rms:
        rstd = torch.rsqrt((xa * xa).mean(-1, keepdim=True) + ctx.eps)  # rrms
        xhat = xa * rstd
    else:
        xc = xa - xa.mean(-1, keepdim=True)
        rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + ctx.eps)
        xhat = xc * rstd
    dx = dweight = dbias = None
    if dy is not None:
        g = dy.reshape(-1, N).to(acc)  # (M, N)
        w = None if weight is None else weight.to(acc) + (1.0 if ctx.w_plus_one else 0.0)
        ghat = g if w is None else g * w  # ĝ = γ ⊙ dy
        c2 = (ghat * xhat).mean(-1, keepdim=True)
        if ctx.is_rms:
            dx = (ghat - xhat * c2) * rstd
        else:
            dx = (ghat - ghat.mean(-1, keepdim=True) - xhat * c2) * rstd  # rstd · (ĝ − c1 − x̂ c2)
        if need_w and weight is not None:
            dweight = (g * round_xhat(xhat, ctx.round_xhat, ctx.x_dtype, weight)).sum(0).to(weight.dtype)
        if need_b and ctx.bias_dtype is not None:
            dbias = g.sum(0).to(ctx.bias_dtype)
    if has_res and dres_out is not None:
        d = dres_out.reshape(-1, N).to(acc)
        dx = d if dx is None else dx + d
    dresidual = None
    if dx is not None:
        dx = dx.reshape(normalized.shape)
        dresidual = dx.to(ctx.residual_dtype) if has_res and need_res else None
        dx = dx.to(ctx.x_dtype) if need_x else None
    if dweight is None and need_w and weight is not None:
        dweight = torch.zeros_like(weight)
    if dbias is None and need_b and ctx.bias_dtype is not None:
        dbias = torch.zeros(N, dtype=ctx.bias_dtype, device=normalized.device)
    return dx, dresidual, dweight, dbias, None, None, None, None, None
