r"""torch's own norm ops, used where their statistics can be trusted.

torch's CPU kernels compute a slice's mean and variance in one pass, in
the input's precision (float32 for float32 input). That is fast and, for
values near zero, as accurate as normlib's two-pass reference. But the
variance loses digits in proportion to :math:`|\mu|/\sigma`: a row of
``1e4 + 1e-3 * randn`` comes out wrong in the second decimal (LayerNorm,
GroupNorm and BatchNorm alike), with AVX2/AVX-512 kernels a constant
BatchNorm channel of 3e5 is normalized to ±3 instead of 0, and a slice
whose squares overflow float32 (values beyond ~1.8e19) is normalized to
zeros (to ``bias``) or NaN. normlib never returns such a number.

So each function here runs torch's op, which also returns the per-slice
mean and :math:`1/\sqrt{\sigma^2+\epsilon}`, and looks at them: if for
every slice :math:`|\mu| \cdot \mathrm{rstd} \le` ``TRUST`` (4) and
:math:`\mathrm{rstd} > 0`, torch's answer is within a few float32
roundings of the exact one (book chapter 07 measures it) and is returned;
otherwise the function returns ``None`` and the caller computes the call
with the reference math. The look costs three small ops on the statistics
(one value per slice), never a pass over the input.

Only called by :mod:`normlib.ops` on arguments it has validated, on CPU,
outside ``torch.compile`` and the ``torch.func`` transforms (see
:func:`normlib.ops.routing.route`).
"""

from __future__ import annotations

from itertools import chain
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

_np: Optional[ModuleType]
try:  # torch >= 2.15 no longer requires numpy
    import numpy as _np
except ImportError:  # pragma: no cover - depends on the installation
    _np = None

__all__ = ["TRUST", "HAS_RMS_NORM", "trusted", "trusted_scale", "layer_norm", "rms_norm", "group_norm", "batch_norm"]



def _has_rms_norm() -> bool:
    """Whether this torch has an RMSNorm op that returns its rstd and computes it on CPU (asked once)."""
    op = getattr(torch, "_fused_rms_norm", None)
    if op is None:
        return False
    try:
        y, rstd = op(torch.ones(1, 2), [2], None, 0.0)
        return bool(y.shape == (1, 2) and rstd.shape == (1, 1))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


HAS_RMS_NORM = _has_rms_norm()

# |mean| * rstd up to which torch's single-pass statistics are trusted. Measured on CPU (float32,
# rows of 64 to 8192 values; chapter 07 shows it for 768): torch's LayerNorm/GroupNorm error grows
# as about 2e-7 * |mean|/sigma; up to 4 it stays within 3x the two-pass reference's own error.
TRUST = 4.0

_TINY = 1e-30  # 1e-30 / rstd is negligible for every finite rstd, and NaN (0/0) where rstd == 0
_INF = float("inf")
_chain = chain.from_iterable


# Up to this many slices the statistics are looked at as Python floats: two tolist() calls and a
# loop cost less than converting to numpy (about 0.7 us a tensor) or any torch op's dispatch.
_FEW = 64


def trusted(mean: Tensor, rstd: Tensor) -> bool:
    """Whether every slice has ``|mean| * rstd <= TRUST`` and ``rstd > 0`` (no NaN, no overflowed variance)."""
    n = rstd.numel()
    if n == 0:
        return True
    if n <= _FEW and rstd.is_cpu:
        dim = rstd.dim()
        if dim == 2 and rstd.shape[1] == 1:  # LayerNorm's (M, 1): one value per nested list
            for (mu,), (r,) in zip(mean.tolist(), rstd.tolist()):
                if not (abs(mu * r) <= TRUST and r > 0.0):  # NaN compares False: not trusted
                    return False
            return True
        ms, rs = mean.tolist(), rstd.tolist()
        for _ in range(dim - 1):  # nested lists, flattened a level at a time (no Python frames)
            ms, rs = list(_chain(ms)), list(_chain(rs))
        for mu, r in zip(ms, rs):
            if not (abs(mu * r) <= TRUST and r > 0.0):
                return False
        return True
    m, r = mean.detach(), rstd.detach()
    if _np is not None and m.is_cpu:  # many slices: numpy's loop beats torch's dispatch
        mn, rn = m.numpy(), r.numpy()
        with _np.errstate(all="ignore"):  # 0 * inf (a constant slice with eps = 0) is NaN: untrusted, quietly
            return bool((_np.abs(mn) * rn).max() <= TRUST and rn.min() > 0)  # NaN compares False
    # |m r + 1e-30 / r|: beyond TRUST, infinite or NaN exactly when the slice is not to be trusted.
    worst_t = torch.linalg.vector_norm(torch.addcdiv(m * r, m.new_full((), _TINY), r), float("inf"))
    return bool(worst_t <= TRUST)


def trusted_scale(rstd: Tensor) -> bool:
    """Whether every ``rstd`` is positive and finite: RMSNorm's statistics, where no mean can cancel; what
    fails is a slice whose squares overflow (``rstd`` 0) or that is all zeros with ``eps = 0`` (infinite)."""
    n = rstd.numel()
    if n == 0:
        return True
    if n <= _FEW and rstd.is_cpu:
        rs = rstd.tolist()
        for _ in range(rstd.dim() - 1):
            rs = list(_chain(rs))
        for r in rs:
            if not 0.0 < r < _INF:  # NaN compares False
                return False
        return True
    r = rstd.detach()
    if _np is not None and r.is_cpu:
        rn = r.numpy()
        return bool(rn.min() > 0 and rn.max() < _INF)  # NaN compares False
    return bool(((r > 0) & (r < _INF)).all())


def _saveable(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """An inference tensor ``x`` (made under ``torch.inference_mode``), copied where γ or β will want a gradient.

    torch's ops save their input for the backward, which autograd refuses for an
    inference tensor; normlib trains on one, as on any batch
    (:func:`normlib.numerics.for_backward` does the same for normlib's own Functions).
    """
    if torch.is_grad_enabled() and ((weight is not None and weight.requires_grad)
                                    or (bias is not None and bias.requires_grad)):
        return x.clone()
    return x


def layer_norm(x: Tensor, shape: tuple[int, ...], weight: Optional[Tensor], bias: Optional[Tensor],
               eps: float) -> Optional[Tensor]:
    """``torch.native_layer_norm``'s output, or ``None`` where its statistics are not to be trusted."""
    if x.is_inference():  # a method of the tensor, not a Python call: the common call pays nothing more
        x = _saveable(x, weight, bias)
    y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
    return y if trusted(mean, rstd) else None


def rms_norm(x: Tensor, shape: tuple[int, ...], weight: Optional[Tensor], eps: float) -> Optional[Tensor]:
    """``torch._fused_rms_norm``'s output, or ``None`` where a slice's rstd is zero or infinite."""
    if x.is_inference():
        x = _saveable(x, weight, None)
    y, rstd = torch._fused_rms_norm(x, shape, weight, eps)  # only called where HAS_RMS_NORM
    return y if trusted_scale(rstd) else None


def group_norm(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
               eps: float) -> Optional[Tensor]:
    """``torch.native_group_norm``'s output for ``(N, C, *)`` input, or ``None``.

    torch's CPU kernel reads γ and β as contiguous whatever their strides (a strided or expanded γ gives
    a plausible wrong answer) and refuses an input that is not contiguous in its own memory format, so
    both are made so first (no copy where they already are).
    """
    if not (x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
            or (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))):
        x = x.contiguous()
    weight = None if weight is None else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    N, C = x.shape[:2]
    if x.is_inference():
        x = _saveable(x, weight, bias)
    y, mean, rstd = torch.native_group_norm(x, weight, bias, N, C, x.numel() // max(N * C, 1), num_groups, eps)
    return y if trusted(mean, rstd) else None


def batch_norm(x: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
               weight: Optional[Tensor], bias: Optional[Tensor], training: bool, momentum: float,
               eps: float) -> Optional[Tensor]:
    """``torch.native_batch_norm``'s output, or ``None`` with the running statistics untouched.

    In evaluation torch only applies the running statistics (nothing to
    trust). In training it updates them in place as it computes the batch's:
    they are kept aside (two ``(C,)`` copies) and put back when the batch's
    statistics turn out untrustworthy, so that the reference's update is the
    only one.
    """
    if x.is_inference():
        x = _saveable(x, weight, bias)
    if not training:
        return torch.native_batch_norm(x, weight, bias, running_mean, running_var, False, momentum, eps)[0]
    saved = None if running_mean is None or running_var is None else (running_mean.clone(), running_var.clone())
    y, mean, invstd = torch.native_batch_norm(x, weight, bias, running_mean, running_var, True, momentum, eps)
    if trusted(mean, invstd):
        return y
    if saved is not None and running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.copy_(saved[0])
            running_var.copy_(saved[1])
    return None
