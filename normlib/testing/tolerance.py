r"""How far apart two correct computations of one value may be: the one rule the checkers and the tests use.

Two implementations of the same normalization compute the same exact value and
round differently on the way: another summation order (vector width, threads,
a fused kernel), another place where a value is rounded to the output dtype.
Each result is the exact one times :math:`(1 + \delta)` with

.. math:: |\delta| \le r \, u_\text{out} + \kappa \, \lambda \sqrt{n} \, u_\text{acc}

where :math:`u = \epsilon / 2` is the unit roundoff (:func:`unit_roundoff`) of
the output dtype and of the accumulation dtype (float32 for half-precision
inputs, see :func:`normlib.numerics.acc_dtype`); :math:`r` is the number of
roundings to the output dtype on the way (1 for torch's norms, which round once
at the end); :math:`\lambda \sqrt{n}\, u` is the probabilistic bound on a sum of
:math:`n` terms (Higham & Mary, *A new approach to probabilistic rounding error
analysis*, SIAM J. Sci. Comput. 2019: it holds with probability at least
:math:`1 - 2\exp(-\lambda^2/2)` per sum; :math:`\lambda = 4` here); and
:math:`\kappa` is the condition number of the value with respect to those sums
(1 for a normalized output of a well-spread row; :math:`|\text{mean}| /
\text{spread}` where the mean dominates; larger for a gradient through several
reductions). The sums run in the accumulation dtype, so κ multiplies their
error only: a bfloat16 row far from zero, normalized with float32 statistics,
is still rounded once, to bfloat16, at the end. The difference of two such
results is at most twice that: :func:`tolerance` returns

.. math:: 2 \, (r \, u_\text{out} + \kappa \, \lambda \sqrt{n} \, u_\text{acc}),

to be used as both ``rtol`` and ``atol`` (values of order one). ``n`` defaults
to :data:`N_MAX`, the longest reduction the checkers and tests run.
"""

from __future__ import annotations

import math

import torch

from ..numerics import acc_dtype
from ..errors import NormValueError

#: λ of the probabilistic bound: a sum's error exceeds λ√n·u with probability below 2·exp(-λ²/2) ≈ 3e-4.
LAMBDA = 4.0
#: The longest reduction (elements per normalized slice, or inner dimension of a product) that the checkers
#: and the tests run; the default ``n`` of :func:`tolerance`.
N_MAX = 4096
#: κ of a normalization's gradient: dx = rstd·(ĝ − mean(ĝ) − x̂·mean(ĝ·x̂)) adds two reductions to the forward's
#: statistics and subtracts terms of order one from each other, so its rounding is up to about four times the
#: forward's (one unit for each reduction and one for the cancellation).
KAPPA_GRADIENT = 4.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next float of ``dtype``: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def bound(dtype: torch.dtype, *, n: int = N_MAX, kappa: float = 1.0, roundings: int = 1) -> tuple[float, float]:
    """The two terms of :func:`tolerance`: ``(2·r·u_out, 2·κ·λ√n·u_acc)``, the roundings' and the sums'.

    A caller that knows the size of what each term applies to scales them
    apart (the checkers: the roundings relative to ``|x̂·γ| + |β|``, the sums'
    error relative to ``|γ|``); :func:`tolerance` is their sum.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise NormValueError(f"tolerance: n must be a positive int (got {n!r})")
    if not (isinstance(kappa, (int, float)) and not isinstance(kappa, bool) and math.isfinite(kappa) and kappa >= 1):
        raise NormValueError(f"tolerance: kappa must be a finite number >= 1 (got {kappa!r})")
    if not isinstance(roundings, int) or isinstance(roundings, bool) or roundings < 1:
        raise NormValueError(f"tolerance: roundings must be a positive int (got {roundings!r})")
    return 2 * roundings * unit_roundoff(dtype), 2 * kappa * LAMBDA * math.sqrt(n) * unit_roundoff(acc_dtype(dtype))


def tolerance(dtype: torch.dtype, *, n: int = N_MAX, kappa: float = 1.0, roundings: int = 1) -> float:
    r"""The largest relative difference allowed between two correct ``dtype`` results: 2(r·u_out + κλ√n·u_acc).

    Args:
        dtype: the results' dtype.
        n: the length of the longest sum behind the value (default :data:`N_MAX`).
        kappa: the value's condition number with respect to those sums (default 1).
        roundings: how many times the value may have been rounded to ``dtype`` (default 1).

    Example:
        >>> round(tolerance(torch.float32, n=4096) / unit_roundoff(torch.float32))
        514
    """
    rounding, sums = bound(dtype, n=n, kappa=kappa, roundings=roundings)
    return rounding + sums


def close(dtype: torch.dtype, *, n: int = N_MAX, kappa: float = 1.0, roundings: int = 1) -> dict:
    """``dict(rtol=..., atol=...)`` of :func:`tolerance`, for ``torch.testing.assert_close(a, b, **close(dtype))``."""
    t = tolerance(dtype, n=n, kappa=kappa, roundings=roundings)
    return {"rtol": t, "atol": t}
