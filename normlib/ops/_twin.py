"""The fused norm's twin in PyTorch ops, and what its autograd wrappers keep for the backward.

The kernels compute ``y = norm(x [+ residual]) * γ [+ β]`` with per-row
statistics in the accumulation dtype. Three places need the same numbers
without the kernels: the custom operator on a device the kernels do not run
on, and the backward of either wrapper when autograd asks for a
differentiable gradient (``create_graph=True``). They all use the functions
here: same statistics (LayerNorm's mean shifted by the row's first element,
as the kernel computes it), same rounding points (a
:class:`~normlib.ops.rounding.Rounding`), same backward formula.

:func:`save` is the one decision of what a fused call keeps for its
backward, used by :class:`~normlib.ops._functions.FusedNormFunction` and by
the custom operator's ``setup_context``: the tensor that was normalized
(``x``, or ``residual_out`` when a residual was added), γ, and the per-row
statistics; x̂ is rebuilt from them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..numerics import acc_dtype, for_backward
from .rounding import Rounding, round_xhat

__all__ = ["forward", "backward", "row_stats", "save", "differentiable_backward"]


def row_stats(xa: Tensor, eps: float, rms: bool) -> tuple[Optional[Tensor], Tensor]:
    """``(mean, rstd)`` per row of ``xa`` ``(M, N)`` as the forward kernel computes them.

    ``mean`` is the mean of ``x - x[:, :1]`` (``None`` for RMSNorm); ``rstd``
    is NaN, not 0, where the mean square overflowed, as in the kernel.
    Differentiable.
    """
    if rms:
        mean = None
        var = (xa * xa).mean(-1)
    else:
        d = xa - xa[:, :1]  # shifted by the row's first element, as the kernel does
        mean = d.mean(-1)  # (M,)
        xc = d - mean[:, None]
        var = (xc * xc).mean(-1)
    rstd = 1.0 / torch.sqrt(var + eps)
    return mean, torch.where(torch.isinf(var), torch.full_like(rstd, float("nan")), rstd)


def _xhat(xa: Tensor, mean: Optional[Tensor], rstd: Tensor) -> Tensor:
    r = rstd[:, None]
    return xa * r if mean is None else ((xa - xa[:, :1]) - mean[:, None]) * r


def _gamma(weight: Optional[Tensor], acc: torch.dtype, rounding: Rounding) -> Optional[Tensor]:
    if weight is None:
        return None
    w = weight.to(acc)
    return w + 1.0 if rounding.weight_plus_one else w


def forward(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
            rms: bool, rounding: Rounding) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Tensor]:
    """What the forward kernel computes: ``(y, residual_out, mean, rstd)``."""
    N = x.shape[-1]
    acc = acc_dtype(x.dtype)
    xa = x.reshape(-1, N).to(acc)  # (M, N)
    res_out = None
    if residual is not None:
        res_out = (xa + residual.reshape(-1, N).to(acc)).to(residual.dtype)
        xa = res_out.to(acc)
    mean, rstd = row_stats(xa, eps, rms)
    y = round_xhat(_xhat(xa, mean, rstd), rounding, x.dtype, weight)
    w = _gamma(weight, acc, rounding)
    if w is not None:
        y = y * w
        product = rounding.product_dtype(x.dtype, weight)
        if product is not None:  # γ · x̂ rounded on its own (DeBERTa), then + β
            y = y.to(product).to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    y = y.to(rounding.out_dtype(x.dtype, weight, bias)).reshape(x.shape)
    return y, (res_out.reshape(x.shape) if res_out is not None else None), mean, rstd


def backward(dy: Optional[Tensor], dres: Optional[Tensor], normalized: Tensor, weight: Optional[Tensor],
             mean: Optional[Tensor], rstd: Tensor, rms: bool, x_dtype: torch.dtype,
             residual_dtype: Optional[torch.dtype], bias_dtype: Optional[torch.dtype], rounding: Rounding):
    """The backward kernel's formulas: ``(dx, dresidual, dweight, dbias)``.

    With ĝ = γ ⊙ dy, c1 = mean(ĝ), c2 = mean(ĝ ⊙ x̂) per row:
    ``dx = rstd · (ĝ − c1 − x̂ c2)`` (RMSNorm: no c1), plus the gradient of
    ``residual_out``; γ's gradient sees x̂ rounded as the forward rounded it.
    ``dy=None`` (only ``residual_out`` was used) counts as zeros.
    """
    N = normalized.shape[-1]
    acc = acc_dtype(normalized.dtype)
    xa = normalized.reshape(-1, N).to(acc)  # (M, N)
    xhat = _xhat(xa, None if rms else mean, rstd)
    g = dy.reshape(-1, N).to(acc) if dy is not None else torch.zeros_like(xa)
    w = _gamma(weight, acc, rounding)
    ghat = g if w is None else g * w  # ĝ = γ ⊙ dy
    dweight = (g * round_xhat(xhat, rounding, x_dtype, weight)).sum(0).to(weight.dtype) if weight is not None else None
    dbias = g.sum(0).to(bias_dtype) if bias_dtype is not None else None
    c2 = (ghat * xhat).mean(-1, keepdim=True)
    dx = (ghat - xhat * c2) if rms else (ghat - ghat.mean(-1, keepdim=True) - xhat * c2)
    dx = dx * rstd[:, None]
    if dres is not None:
        dx = dx + dres.reshape(-1, N).to(acc)
    dresidual = dx.to(residual_dtype, copy=True).reshape(normalized.shape) if residual_dtype is not None else None
    return dx.to(x_dtype).reshape(normalized.shape), dresidual, dweight, dbias


def save(ctx, x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
         rms: bool, rounding: Rounding, res_out: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor) -> None:
    """Keep on ``ctx`` what a fused call's backward needs, for either wrapper.

    Saved tensors: the normalized tensor (``residual_out`` when a residual
    was added, else ``x``), γ, ``mean`` and ``rstd``; plain attributes: the
    dtypes the gradients must have, ``eps``, the norm and its rounding.
    """
    # residual_out where a residual was added (the custom operator passes an empty one otherwise)
    normalized = x if residual is None or res_out is None else res_out
    # Only a tensor that needs no gradient can have been made under inference mode (and cannot be saved as
    # it is); asked through requires_grad first, an attribute: a call with gradients pays no extra call.
    if (not normalized.requires_grad or (weight is not None and not weight.requires_grad)):
        normalized, weight = for_backward(normalized, weight)
    ctx.save_for_backward(normalized, weight, mean, rstd)
    ctx.eps, ctx.rms, ctx.rounding = eps, rms, rounding
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def differentiable_backward(ctx, dy: Optional[Tensor], dres: Optional[Tensor]):
    """The gradients as a graph of PyTorch ops, for a second derivative (``create_graph=True``).

    The kernels' gradients are plain numbers with no graph behind them. When
    autograd asks for a differentiable gradient, :func:`backward` runs on
    statistics recomputed from the saved input with differentiable ops, so
    that a gradient of the gradient (``gradgradcheck``, gradient penalties,
    Hessian-vector products) follows how they depend on it. Returns the four
    gradients :func:`save`'s wrapper hands back, ``None`` where not needed.
    """
    normalized, weight, _, _ = ctx.saved_tensors
    need_x, need_res, need_w, need_b = ctx.needs_input_grad[:4]
    has_res = ctx.residual_dtype is not None
    N = normalized.shape[-1]
    mean, rstd = row_stats(normalized.reshape(-1, N).to(acc_dtype(normalized.dtype)), ctx.eps, ctx.rms)
    dx, dresidual, dweight, dbias = backward(
        dy, dres if has_res else None, normalized, weight, mean, rstd, ctx.rms, ctx.x_dtype,
        ctx.residual_dtype, ctx.bias_dtype, ctx.rounding,
    )
    return (dx if need_x else None, dresidual if has_res and need_res else None,
            dweight if need_w else None, dbias if need_b else None)
