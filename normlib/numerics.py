r"""The numerics every implementation in normlib shares, each rule written once.

:mod:`normlib.functional` (the reference math), :mod:`normlib.ops` (the
kernels' launchers and their plain-PyTorch twins) and
:mod:`normlib.distributed` (SyncBatchNorm) import these instead of keeping
copies:

* **Accumulation dtype** (:func:`acc_dtype`): statistics are accumulated in
  float32, in float64 when any operand is float64; float16/bfloat16 values are
  up-cast before they are summed.
* **Shifted two-pass moments** (:func:`shifted_moments`): each slice is shifted
  by one of its own elements, ``x - x_0``, then centred, and the variance is
  the mean of squared deviations, never :math:`E[x^2] - E[x]^2`. A constant
  slice gives exact zeros; values far from zero lose no digits.
* **rstd that survives overflowing squares** (:func:`safe_rstd`).
* **Running statistics** (:func:`update_running`, :func:`momentum_for_step`):
  PyTorch's convention ``new = (1 - momentum) * old + momentum * batch``,
  computed in the accumulation dtype and rounded once into the buffer;
  ``momentum=None`` is a cumulative average (the k-th batch weighs 1/k).

Nothing here checks its arguments: the public entries do that once.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

__all__ = [
    "acc_dtype",
    "channel_view",
    "numel",
    "sum_of_squares",
    "first",
    "centre",
    "recentre",
    "shifted_moments",
    "safe_rstd",
    "update_running",
    "momentum_for_step",
]


def acc_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Accumulate in float64 where any operand is float64, float32 for everything narrower.

    Example:
        >>> acc_dtype(torch.bfloat16), acc_dtype(torch.float32, torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float64 if torch.float64 in dtypes else torch.float32


def channel_view(p: Tensor, ndim: int) -> Tensor:
    """(C,) -> (1, C, 1, ..., 1) so that it broadcasts against (N, C, *)."""
    return p.reshape((1, -1) + (1,) * (ndim - 2))


def numel(x: Tensor, dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= x.shape[d]
    return n


# torch.linalg.vector_norm reads a tensor once without a temporary, but each
# SIMD lane accumulates its share of a slice one element after another: its
# relative error grows with the slice (measured in float32: 4e-7 at 3136
# elements, 2e-5 at 10^6). Longer slices are summed as (xc * xc).sum, which
# torch accumulates pairwise.
_VECTOR_NORM_MAX = 16384


def sum_of_squares(xc: Tensor, dims: tuple[int, ...]) -> Tensor:
    r""":math:`\sum x_c^2` over ``dims`` (non-negative, sorted), with ``keepdim``.

    The trailing block of ``dims`` (all of them for LayerNorm and GroupNorm,
    the spatial ones for BatchNorm) is reduced by ``vector_norm`` in one read;
    the rest (BatchNorm's batch dimension) by a sum of those partial results.
    Squaring a norm can land one rounding away from the exact sum (the
    variance of ``[0, 2]`` comes out as ``1 - 2**-24``); the kernels and
    torch's own reductions differ from the exact value by as much.
    """
    inner: list[int] = []
    for d in reversed(range(xc.dim())):
        if d not in dims:
            break
        inner.insert(0, d)
    if inner and numel(xc, inner) <= _VECTOR_NORM_MAX:
        ss = torch.linalg.vector_norm(xc, dim=tuple(inner), keepdim=True).square()
        outer = tuple(d for d in dims if d not in inner)
        return ss.sum(outer, keepdim=True) if outer else ss
    return (xc * xc).sum(dims, keepdim=True)


def first(x: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``x_0``, the first element of each slice over ``dims`` (``keepdim``, detached).

    Zeros where a slice is empty (there is nothing to shift by).
    """
    x0 = x.detach()
    if any(x.shape[d] == 0 for d in dims):
        shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
        return x.new_zeros(shape)
    for d in dims:
        x0 = x0.narrow(d, 0, 1)
    return x0


def centre(x: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """``(xc, x0, shifted_mean)``: ``xc = (x - x0) - mean(x - x0)``, a fresh tensor."""
    x0 = first(x, dims)
    xc = x - x0  # exact zeros for a constant slice
    shifted_mean = xc.mean(dims, keepdim=True)
    return xc.sub_(shifted_mean), x0, shifted_mean


def recentre(x: Tensor, dims: tuple[int, ...], shifted_mean: Tensor) -> Tensor:
    """``xc`` again from the saved ``shifted_mean``: bit for bit the forward's."""
    return (x - first(x, dims)).sub_(shifted_mean)


def shifted_moments(x: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(xc, mean, shifted_mean, var)`` over ``dims`` (non-negative), all ``keepdim``."""
    xc, x0, shifted_mean = centre(x, dims)
    var = sum_of_squares(xc, dims) / numel(x, dims)
    return xc, x0 + shifted_mean, shifted_mean, var


def safe_rstd(xc: Tensor, var: Tensor, dims: tuple[int, ...], eps: float) -> Tensor:
    r""":math:`1/\sqrt{\sigma^2 + \epsilon}` per slice, right also where :math:`\sigma^2` overflowed.

    ``xc`` holds the centred values (the raw ones for RMSNorm) and ``var`` the
    mean of their squares. In float32, squares of values beyond about 1.8e19
    overflow: ``var`` becomes ``inf``, ``rsqrt`` gives 0 and the slice would be
    normalized to exactly zero (``bias`` after the affine step), a finite and
    plausible wrong answer. Such slices are recomputed from ``xc / s``, ``s``
    being the slice's largest :math:`|x_c|`:
    :math:`\mathrm{rstd} = 1 / \big(s\,\sqrt{\overline{(x_c/s)^2} + \epsilon/s^2}\big)`.
    Slices that hold ``inf`` or NaN stay NaN, as in torch. On CPU in eager
    mode the rescaled pass runs only when some ``var`` overflowed. Elsewhere
    both are computed and selected per slice: ``torch.compile`` and the
    ``torch.func`` transforms cannot branch on a value, and on a GPU looking at
    one would make the host wait for the device on every call (and break CUDA
    graph capture).
    """
    rstd = torch.rsqrt(var + eps)
    if xc.numel() == 0:
        return rstd
    branch_free = (
        xc.device.type != "cpu"
        or torch.compiler.is_compiling()
        or torch._C._are_functorch_transforms_active()
    )
    if not branch_free and not bool(torch.isinf(var).any()):  # the common case: one look at the statistics
        return rstd
    s = torch.linalg.vector_norm(xc, ord=float("inf"), dim=dims, keepdim=True)  # max |xc|
    s = torch.where((s > 0) & torch.isfinite(s), s, torch.ones_like(s))
    mean_sq = sum_of_squares(xc / s, dims) / numel(xc, dims)
    scaled = torch.rsqrt(mean_sq + eps / (s * s)) / s
    return torch.where(torch.isinf(var), scaled, rstd)


@torch.no_grad()
def update_running(running: Tensor, batch_value: Tensor, momentum: float) -> None:
    """PyTorch's convention: ``new = (1 - momentum) * old + momentum * batch``, in place.

    Computed in the accumulation dtype, then rounded once into the buffer.
    """
    acc = acc_dtype(running.dtype)
    new = running.to(acc) * (1.0 - momentum) + batch_value.to(acc) * momentum
    running.copy_(new)


def momentum_for_step(momentum: Optional[float], batches: Union[int, Tensor], uncounted: int = 0) -> float:
    """The weight this step's batch gets in the running statistics.

    ``momentum`` itself, or for ``momentum=None`` the cumulative (equal-weight)
    average's ``1 / k``, this batch being the ``k = batches + uncounted``-th
    (``uncounted=1`` where the batch is counted only after the step).
    ``batches`` may be the ``num_batches_tracked`` buffer: its value is read
    only for ``momentum=None`` (reading it would wait for the device, and
    cannot be traced by ``torch.export``).

    Example:
        >>> momentum_for_step(0.1, 7), momentum_for_step(None, 4), momentum_for_step(None, 3, uncounted=1)
        (0.1, 0.25, 0.25)
    """
    return 1.0 / (float(batches) + uncounted) if momentum is None else momentum


def for_backward(*tensors: Optional[Tensor]) -> tuple:
    """``tensors`` as an autograd Function may save them for its backward.

    A tensor made under ``torch.inference_mode`` cannot be saved ("Inference
    tensors cannot be saved for backward"), yet torch's own norms train on one
    (e.g. a batch created under inference mode, with trainable γ): such a
    tensor is copied to a normal one. Every other tensor is kept as it is.
    """
    if torch.compiler.is_compiling():  # a traced graph holds no inference tensor (and cannot ask is_inference)
        return tensors
    return tuple(t.clone() if t is not None and t.is_inference() else t for t in tensors)
