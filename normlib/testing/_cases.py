"""Running cases of a functional implementation, and the inputs the cases are made of."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, overload

import torch

from ._report import (
    DTYPES,
    CaseResult,
    CheckReport,
    _compare,
    _exception_text,
    _Failed,
    _gradient_allowed,
    _output_allowed,
    _subject_name,
)
from ..errors import NormValueError, NormTypeError


@overload
def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor: ...
@overload
def _leaf(t: None, requires_grad: bool) -> None: ...
def _leaf(t: Optional[torch.Tensor], requires_grad: bool) -> Optional[torch.Tensor]:
    """A fresh leaf with ``t``'s values *and strides* (non-contiguous stays non-contiguous)."""
    if t is None:
        return None
    c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    c.copy_(t)
    return c.requires_grad_(requires_grad)


@dataclass
class _FnCase:
    """One call of a functional implementation: ``fn(x, *args)`` with tensors named in ``tensors``."""

    name: str
    x: torch.Tensor
    values: str  # how x was drawn, in words
    params: dict  # name -> tensor or None (weight, bias), in call order after ``middle``
    middle: tuple  # positional arguments between x and the params (normalized_shape / num_groups)
    eps: float
    why: str = ""
    kappa: float = 1.0  # |mean| / spread of the rows, for the tolerance
    pview: tuple = ()  # the shape γ and β are viewed as to broadcast against x (e.g. (C, 1, 1) for GroupNorm)


def _output_terms(case: _FnCase, reference, rx: torch.Tensor) -> tuple:
    """``(|x̂·γ| + |β|, |γ|)`` per element (|γ| = 1 without γ): what an output's roundings and its
    statistics' error are relative to (see :func:`._report._output_allowed`)."""
    with torch.no_grad():
        xhat = reference(rx.detach(), *case.middle, *([None] * len(case.params)), case.eps)
        w, b = case.params.get("weight"), case.params.get("bias")
        gain = torch.ones_like(xhat) if w is None else w.detach().to(torch.float64).abs().reshape(case.pview).expand_as(xhat)
        terms = xhat.abs() * gain
        if b is not None:
            terms = terms + b.detach().to(torch.float64).abs().reshape(case.pview)
    return terms, gain


def _run_fn_cases(checker, fn, cases, reference, call_words, gradients, raise_on_failure, gen):
    report = CheckReport(checker, _subject_name(fn))
    no_grad_seen = False
    for case in cases:
        dtype = case.x.dtype
        want_grad = gradients and dtype in (torch.float32, torch.float64)
        words = call_words(case)
        result = CaseResult(case.name, words, True, why=case.why)
        try:
            x = _leaf(case.x, want_grad)
            params = {k: _leaf(v, want_grad) for k, v in case.params.items()}
            before = [t.detach().clone() for t in [x, *params.values()] if t is not None]
            try:
                out = fn(x, *case.middle, *params.values(), case.eps)
            except Exception as e:  # the reader's code raised: report it, don't crash the check
                raise _Failed(f"your implementation raised {_exception_text(e)}") from None
            # float64 reference on the same (already rounded) values
            rx = case.x.detach().to(torch.float64).requires_grad_(want_grad)
            rp = {k: None if v is None else v.detach().to(torch.float64).requires_grad_(want_grad) for k, v in case.params.items()}
            expected = reference(rx, *case.middle, *rp.values(), case.eps)
            n = case.x.numel()  # no sum in the case is longer
            _compare(out, expected, "the output", dtype,
                     _output_allowed(dtype, n, case.kappa, *_output_terms(case, reference, rx)))
            after = [t.detach() for t in [x, *params.values()] if t is not None]
            names = ["x"] + [k for k, v in params.items() if v is not None]
            for name, b, a in zip(names, before, after):
                if not torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)):
                    raise _Failed(f"your implementation modified its argument {name} in place")
            if want_grad:
                if not out.requires_grad:
                    result.note = "forward only: the output does not require grad"
                    no_grad_seen = True
                else:
                    dy = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
                    try:
                        out.backward(dy.to(dtype))
                    except Exception as e:
                        raise _Failed(f"backward through your implementation raised {_exception_text(e)}") from None
                    expected.backward(dy)
                    for name, mine, ref in [("x", x, rx)] + [(k, params[k], rp[k]) for k in params]:
                        if mine is None:
                            continue
                        if mine.grad is None:
                            raise _Failed(
                                f"the gradient with respect to {name} is None: the output does not depend "
                                f"on {name} through autograd (was it detached, or not used?)"
                            )
                        _compare(
                            mine.grad, ref.grad,
                            f"the gradient with respect to {name} (for a random upstream gradient)",
                            dtype, _gradient_allowed(dtype, n, case.kappa, ref.grad),
                        )
        except _Failed as f:
            result.passed = False
            result.message = str(f)
        except Exception as e:  # something about the result the checker could not handle
            result.passed = False
            result.message = f"the check could not complete: {_exception_text(e)}"
        report.cases.append(result)
    if no_grad_seen:
        report.notes.append(
            "gradients were not checked where the output does not require grad "
            "(computed outside autograd, or detached)"
        )
    if raise_on_failure:
        report._raise_if_failed()
    return report


def _randn(gen, *shape, dtype=torch.float32, mean=0.0, std=1.0):
    return (mean + std * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)


def _params(gen, shape, dtype, weight=True, bias=True):
    w = (1.0 + 0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype) if weight else None
    b = (0.5 * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype) if bias else None
    return w, b


_CONSTANTS = (0.0, 1.0, -2.5, 0.375, 3.25, -1.0, 2.0, -0.125)
_CONSTANTS_WORDS = "each row one repeated value (0, 1, -2.5, 0.375, 3.25, -1, 2, -0.125)"


def _constant_rows(shape, dtype):
    """Rows that each hold one value repeated (variance exactly 0).

    The correct output is exactly β, and an implementation that forgets eps
    divides 0 by 0. A computed mean may still miss the value by a rounding
    step, which 1/sqrt(eps) then magnifies: such a row's spread is in effect
    sqrt(eps), so its condition number is |value| / sqrt(eps). The values are
    small and exact in float32, and rows hold a power of two of them, to keep
    that small.
    """
    values = torch.tensor(_CONSTANTS, dtype=torch.float64)
    rows = int(torch.tensor(shape[:-1]).prod()) if len(shape) > 1 else 1
    v = values.repeat(rows // len(values) + 1)[:rows]
    return v.reshape(*shape[:-1], 1).expand(shape).to(dtype).contiguous()


def _constant_kappa(values, eps: float) -> float:
    """The condition number allowed for slices of one repeated value each (see :func:`_constant_rows`):
    the largest ``|value|`` over ``sqrt(eps)``, at least 1. ``values`` is one number or several."""
    largest = max(map(abs, values)) if isinstance(values, (list, tuple)) else abs(values)
    return max(1.0, largest / math.sqrt(eps)) if eps > 0 else 1.0


def _check_options(checker: str, subject, gradients, raise_on_failure, what: str = "fn") -> None:
    """A checker's own arguments, refused up front with the argument's name (never a report of 30 failures)."""
    if not callable(subject):
        raise NormTypeError(f"{checker}: {what} must be your implementation, a callable (got {type(subject).__name__} "
                        f"{subject!r})")
    for name, value in (("gradients", gradients), ("raise_on_failure", raise_on_failure)):
        if not isinstance(value, bool):
            raise NormTypeError(f"{checker}: {name} must be True or False (got {type(value).__name__} {value!r})")


def _dtypes(dtypes, default=DTYPES):
    """The dtypes a checker runs: ``None`` for its default, else a non-empty sequence of known dtypes."""
    if dtypes is None:
        return list(default)
    if isinstance(dtypes, (torch.dtype, str)) or not isinstance(dtypes, (list, tuple)):
        raise NormTypeError(f"dtypes must be a list or tuple of torch dtypes, e.g. (torch.float32,) "
                        f"(got {type(dtypes).__name__} {dtypes!r})")
    out = list(dtypes)
    if not out:
        raise NormValueError("dtypes must name at least one dtype (got an empty sequence): a check of nothing "
                         "would pass anything")
    for d in out:
        if d not in DTYPES:
            raise NormValueError(f"dtypes may hold {', '.join(map(str, DTYPES))} (got {d!r})")
    if len(set(out)) != len(out):
        raise NormValueError(f"dtypes names a dtype twice ({', '.join(map(str, out))}): each runs once")
    return out


_WHY = {
    "basic": "the formula itself: mean, biased variance (divide by n), eps inside the square root, then γ and β",
    "4d": "normalizing over every dimension in normalized_shape, not only the last one",
    "one": "a single element per row: its variance is 0, so the output is β (an unbiased n - 1 divides by zero)",
    "offset": (
        "values far from zero with a small spread: the variance computed as E[x²] - E[x]² cancels "
        "catastrophically; compute it as the mean of squared deviations from the mean"
    ),
    "constant": "rows whose values are all equal: the variance is 0, the output must be β, and eps must keep it finite",
    "noncontig": "a non-contiguous input (a permuted view): .view() fails on it, .reshape() works",
    "eps": "a large eps (0.1), so that an implementation that ignores eps, or adds it outside the square root, shows",
    "noaffine": "weight and bias may be None, as in torch.nn.functional",
    "weightonly": "weight given, bias None",
    "bf16": "a low-precision dtype: the output must keep the input's dtype (statistics best accumulated in float32)",
    "biasonly": "bias given, weight None: β is still added",
    "lowoffset": (
        "a 16-bit input far from zero: the statistics must be computed in float32. In the input's dtype the mean "
        "alone is rounded by up to half a unit in the last place of 100 (0.25 in bfloat16, 0.03 in float16), "
        "a large part of the spread, and E[x²] - E[x]² loses every digit"
    ),
    "overflow": (
        "float16 values beyond 256: their squares exceed float16's largest number (65504) and become inf, so "
        "squares and their sums must be taken in float32"
    ),
    "tinyeps": (
        "eps = 1e-12 rounds to 0 in float16: added to a float16 variance it leaves 0/0 (NaN) on a constant row; "
        "add it to a float32 variance"
    ),
}

_HALF = (torch.float16, torch.bfloat16)
_LOW_OFFSET = 100.0  # the 16-bit inputs' mean, in units of their spread
_TINY_EPS = 1e-12


def _low_precision_cases(add, gen, dt, shape, constant=None, constant_words=_CONSTANTS_WORDS, offset=True) -> None:
    """The cases of chapter 05d's mistakes in 16 bits, through ``add(name, x, values, eps=..., why=..., kappa=...)``.

    ``shape`` is the input's shape; ``constant(shape, dtype)`` makes an input
    whose normalized slices each hold one repeated value (default: rows, by
    :func:`_constant_rows`); ``offset=False`` leaves out the input far from
    zero (a norm that subtracts no mean has nothing to cancel).
    """
    if offset:
        add(f"mean {_LOW_OFFSET:g} times the spread", _randn(gen, *shape, dtype=dt, mean=_LOW_OFFSET),
            f"{_LOW_OFFSET:g} + N(0, 1) values", why="lowoffset", kappa=_LOW_OFFSET)
    if dt == torch.float16:
        add("values beyond 256", _randn(gen, *shape, dtype=dt, std=300.0), "N(0, 300²) values", why="overflow")
        add(f"constant slices, eps = {_TINY_EPS:g}", (constant or _constant_rows)(shape, dt), constant_words,
            eps=_TINY_EPS, why="tinyeps", kappa=_constant_kappa(_CONSTANTS, _TINY_EPS))
