r"""Checkers for your own implementations of the book's layers.

Write a layer yourself, then ask whether it computes what PyTorch's does::

    import normlib as nl

    def my_layer_norm(x, normalized_shape, weight, bias, eps):
        dims = tuple(range(-len(normalized_shape), 0))
        mean = x.mean(dims, keepdim=True)
        var = ((x - mean) ** 2).mean(dims, keepdim=True)
        y = (x - mean) / torch.sqrt(var + eps)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    report = nl.testing.check_layer_norm(my_layer_norm)   # raises AssertionError if a case fails
    print(report)                                          # every case that was run

Each checker calls your implementation on many cases — shapes (one element,
non-powers of two, 3-D and 4-D), dtypes (float32, float64, and bfloat16 for
the forward pass), weight and bias present or absent, and adversarial inputs
(values far from zero with a small spread, constant rows, non-contiguous
tensors, a large ``eps``) — and compares the output, and the gradients when
your output is differentiable, with a float64 evaluation of
:mod:`normlib.functional` on the same inputs. It also checks that the input
was not modified in place and that the output has the input's shape and
dtype.

Every checker returns a :class:`CheckReport`. By default
(``raise_on_failure=True``) it raises ``AssertionError`` describing the first
case that failed in plain words: the input, what was expected, what came and
by how much. With ``raise_on_failure=False`` it only returns the report;
``report.passed`` says whether every case passed and ``print(report)`` lists
them.

Tolerances follow the dtype: ``|got - expected| <= atol + rtol * |expected|``
with ``atol = rtol = 1e-9`` for float64, ``1e-5`` for float32 (``1e-4`` for
gradients) and ``4e-2`` for bfloat16 (a few of its rounding steps). Where the
mean is ``κ`` times larger than the spread, any float arithmetic loses about
``log10 κ`` digits, so those cases allow ``32 κ`` units in the last place;
computing the variance as ``E[x²] - E[x]²`` loses all of them and still fails.

The checkers draw their inputs from their own seeded generator: they do not
touch PyTorch's global random state, and they give the same report every run.
"""

from __future__ import annotations

import math
import os
import sys
import traceback
import types
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, overload

import torch

from . import functional as _F

__all__ = [
    "check_layer_norm",
    "check_rms_norm",
    "check_group_norm",
    "check_batch_norm",
    "CheckReport",
    "CaseResult",
]

# (atol, rtol) for the forward output and for gradients, per dtype.
_TOL = {
    torch.float64: ((1e-9, 1e-9), (1e-9, 1e-9)),
    torch.float32: ((1e-5, 1e-5), (1e-4, 1e-4)),
    torch.bfloat16: ((4e-2, 4e-2), (4e-2, 4e-2)),
}
_ULPS_PER_KAPPA = 32  # allowed units in the last place per unit of condition number κ = |mean| / spread


# ---------------------------------------------------------------- the report


@dataclass
class CaseResult:
    """One case a checker ran: what was called, and whether the result matched."""

    name: str  #: a short title, e.g. ``"large offset, float32"``
    call: str  #: the inputs, in words
    passed: bool
    message: str = ""  #: why it failed, in plain words (empty when it passed)
    why: str = ""  #: what the case is there to catch
    note: str = ""  #: e.g. ``"forward only"`` when gradients could not be checked
    skipped: bool = False  #: not run because an earlier case it builds on failed (counts as not passed)

    def describe(self) -> str:
        """The full account of a failed case (or a one-line summary of a passed one)."""
        if self.passed:
            return f"passed: {self.name}"
        text = f"{self.name}\n  input: {self.call}\n  {self.message.replace(chr(10), chr(10) + '  ')}"
        if self.why:
            text += f"\n  what this case checks: {self.why}"
        return text


@dataclass
class CheckReport:
    """What a checker found: every case it ran, in order.

    ``passed`` is True when every case passed; ``failures`` lists the others;
    ``str(report)`` (or ``print(report)``) shows one line per case and the
    details of each failure.
    """

    checker: str
    subject: str
    cases: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def failures(self) -> list:
        return [c for c in self.cases if not c.passed]

    def __bool__(self) -> bool:
        return self.passed

    def summary(self) -> str:
        n, bad = len(self.cases), len(self.failures)
        verdict = "all passed" if not bad else f"{bad} failed"
        return f"{self.checker}({self.subject}): {n} cases, {verdict}"

    def __str__(self) -> str:
        lines = [self.summary()]
        for c in self.cases:
            mark = "ok  " if c.passed else ("skip" if c.skipped else "FAIL")
            lines.append(f"  {mark} {c.name}" + (f" ({c.note})" if c.note else ""))
        for note in self.notes:
            lines.append(f"note: {note}")
        for c in self.failures:
            if not c.skipped:
                lines.append("")
                lines.append("FAILED " + c.describe())
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<CheckReport {self.summary()}>"

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the whole report
        p.text(str(self))

    def _raise_if_failed(self) -> None:
        bad = self.failures
        if not bad:
            return
        first = next(c for c in bad if not c.skipped) if any(not c.skipped for c in bad) else bad[0]
        index = self.cases.index(first) + 1
        msg = (
            f"{self.checker}({self.subject}) failed case {index} of {len(self.cases)}: "
            + first.describe()
        )
        if len(bad) > 1:
            msg += (
                f"\n({len(bad) - 1} more case(s) failed: call {self.checker}(..., "
                "raise_on_failure=False) and print the report to see them all)"
            )
        raise AssertionError(msg)


class _Failed(Exception):
    """Raised inside a case to stop it with a message for the reader."""


class _Skipped(_Failed):
    """Raised inside a case that cannot run because one it builds on failed."""


# ---------------------------------------------------------------- helpers


def _subject_name(obj) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.6g}"


def _index(flat: int, shape: Sequence[int]) -> tuple:
    idx = []
    for s in reversed(shape):
        idx.append(flat % s)
        flat //= s
    return tuple(reversed(idx))


def _package_dir(module: types.ModuleType) -> str:
    if module.__file__ is None:  # torch and normlib are regular packages: never the case
        raise ImportError(f"{module.__name__} has no __file__ to find its directory from")
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


_LIBRARY_DIRS = tuple(_package_dir(m) for m in (torch, sys.modules[__name__.rsplit(".", 1)[0]]))


def _exception_text(e: BaseException) -> str:
    """``TypeError: ...`` and the line of the reader's own code it came from (not torch's, not normlib's)."""
    where = ""
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        if not os.path.abspath(fr.filename).startswith(_LIBRARY_DIRS):
            where = f" (in {fr.name}: {fr.line})" if fr.line else f" (in {fr.name})"
            break
    return f"{type(e).__name__}: {e}{where}"


def _compare(got, expected: torch.Tensor, what: str, dtype: torch.dtype, tol: tuple) -> None:
    """Raise _Failed describing how ``got`` differs from the float64 ``expected``."""
    if not isinstance(got, torch.Tensor):
        raise _Failed(f"{what}: expected a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        raise _Failed(f"{what}: expected shape {tuple(expected.shape)}, got shape {tuple(got.shape)}")
    if got.dtype != dtype:
        raise _Failed(
            f"{what}: expected dtype {_dtype_name(dtype)} (the input's), got {_dtype_name(got.dtype)}"
        )
    g = got.detach().to(torch.float64).cpu().reshape(-1)
    e = expected.detach().to(torch.float64).reshape(-1)
    if g.numel() == 0:
        return
    atol, rtol = tol
    bad_nonfinite = ~torch.isfinite(g) & torch.isfinite(e)
    if bad_nonfinite.any():
        k = int(bad_nonfinite.nonzero()[0])
        raise _Failed(
            f"{what}: got {int(bad_nonfinite.sum())} non-finite value(s) of {g.numel()}; the first at index "
            f"{_index(k, expected.shape)}: expected {_fmt(float(e[k]))}, got {_fmt(float(g[k]))}"
        )
    diff = (g - e).abs()
    allowed = atol + rtol * e.abs()
    bad = diff > allowed
    if bad.any():
        k = int(torch.argmax(torch.where(bad, diff / allowed, torch.zeros_like(diff))))
        raise _Failed(
            f"{what} differs at {int(bad.sum())} of {g.numel()} elements. The worst, at index "
            f"{_index(k, expected.shape)}: expected {_fmt(float(e[k]))}, got {_fmt(float(g[k]))} "
            f"(off by {_fmt(float(diff[k]))}; allowed: {atol:.3g} + {rtol:.3g}·|expected| = "
            f"{_fmt(float(allowed[k]))})"
        )


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


def _stride_note(x: torch.Tensor) -> str:
    return "" if x.is_contiguous() else f", non-contiguous (strides {tuple(x.stride())})"


def _tensor_words(x: torch.Tensor, values: str) -> str:
    return f"{_dtype_name(x.dtype)} input of shape {tuple(x.shape)}{_stride_note(x)}, {values}"


# ---------------------------------------------------------------- functional checkers


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
            (atol, rtol), (gatol, grtol) = _TOL[dtype]
            if case.kappa > 1:
                slack = _ULPS_PER_KAPPA * case.kappa * torch.finfo(dtype).eps
                atol, rtol, gatol, grtol = (max(t, slack) for t in (atol, rtol, gatol, grtol))
            _compare(out, expected, "the output", dtype, (atol, rtol))
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
                            dtype, (gatol, grtol),
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


def _dtypes(dtypes, default):
    if dtypes is None:
        return list(default)
    out = list(dtypes)
    for d in out:
        if d not in _TOL:
            raise ValueError(f"dtypes may hold torch.float32, torch.float64 and torch.bfloat16 (got {d})")
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
}


def check_layer_norm(
    fn: Callable,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    gradients: bool = True,
    raise_on_failure: bool = True,
) -> CheckReport:
    r"""Check ``fn(x, normalized_shape, weight, bias, eps)`` against layer normalization.

    ``fn`` has the signature of :func:`torch.nn.functional.layer_norm` (called
    positionally; ``normalized_shape`` is a tuple of ints, ``weight`` and
    ``bias`` may be ``None``) and should return
    :math:`\frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta`
    over the trailing ``normalized_shape`` dimensions, with the biased variance.

    Args:
        fn: your implementation.
        dtypes: the dtypes to run (default float32, float64 and bfloat16; bfloat16 forward only).
        gradients: also compare the gradients of x, weight and bias (when the
            output requires grad).
        raise_on_failure: raise ``AssertionError`` describing the first failing case.

    Returns:
        a :class:`CheckReport`.

    Example:
        >>> import torch.nn.functional as F
        >>> check_layer_norm(F.layer_norm).passed
        True
    """
    gen = torch.Generator().manual_seed(0)
    cases = []
    for dt in _dtypes(dtypes, (torch.float32, torch.float64, torch.bfloat16)):
        d = _dtype_name(dt)

        def add(name, x, values, ns, weight=True, bias=True, eps=1e-5, why="basic", kappa=1.0):
            w, b = _params(gen, ns, dt, weight, bias)
            cases.append(_FnCase(f"{name}, {d}", x, values, {"weight": w, "bias": b}, (tuple(ns),), eps, _WHY[why], kappa))

        add("rows of 7", _randn(gen, 4, 7, dtype=dt), "N(0, 1) values", (7,))
        add("3-D input, rows of 33", _randn(gen, 2, 3, 33, dtype=dt, mean=1.0, std=2.0), "N(1, 2²) values", (33,))
        if dt == torch.bfloat16:
            continue
        add("4-D input normalized over its last two dimensions", _randn(gen, 2, 3, 4, 5, dtype=dt), "N(0, 1) values", (4, 5), why="4d")
        add("one element per row", _randn(gen, 5, 1, dtype=dt), "N(0, 1) values", (1,), why="one")
        add("a single row of 128", _randn(gen, 1, 128, dtype=dt, std=3.0), "N(0, 3²) values", (128,))
        add("large offset", _randn(gen, 8, 50, dtype=dt, mean=1e4), "1e4 + N(0, 1) values", (50,), why="offset", kappa=1e4)
        add("constant rows", _constant_rows((8, 16), dt), _CONSTANTS_WORDS, (16,), why="constant",
            kappa=max(map(abs, _CONSTANTS)) / math.sqrt(1e-5))
        add("non-contiguous input", _randn(gen, 24, 3, 2, dtype=dt).permute(2, 1, 0), "N(0, 1) values (a permuted view)", (24,), why="noncontig")
        add("eps = 0.1", _randn(gen, 4, 9, dtype=dt), "N(0, 1) values", (9,), eps=0.1, why="eps")
        add("weight and bias None", _randn(gen, 3, 12, dtype=dt), "N(0, 1) values", (12,), weight=False, bias=False, why="noaffine")
        add("weight only (bias None)", _randn(gen, 3, 12, dtype=dt), "N(0, 1) values", (12,), bias=False, why="weightonly")

    def words(c):
        w, b = c.params["weight"], c.params["bias"]
        aff = "weight and bias" if w is not None and b is not None else ("weight, bias=None" if w is not None else "weight=None, bias=None")
        return f"fn(x, normalized_shape={c.middle[0]}, {aff}, eps={c.eps:g}) with x a {_tensor_words(c.x, c.values)}"

    return _run_fn_cases("check_layer_norm", fn, cases, _F.layer_norm, words, gradients, raise_on_failure, gen)


def check_rms_norm(
    fn: Callable,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    gradients: bool = True,
    raise_on_failure: bool = True,
) -> CheckReport:
    r"""Check ``fn(x, normalized_shape, weight, eps)`` against RMS normalization.

    ``fn`` has the signature of :func:`torch.nn.functional.rms_norm` (called
    positionally, with a float ``eps``; ``weight`` may be ``None``) and should
    return :math:`\frac{x}{\sqrt{\frac1n\sum_i x_i^2 + \epsilon}} \odot \gamma`
    over the trailing ``normalized_shape`` dimensions: no mean subtracted, no bias.

    Args, return value and behaviour are those of :func:`check_layer_norm`.

    Example:
        >>> import torch.nn.functional as F
        >>> check_rms_norm(F.rms_norm).passed
        True
    """
    gen = torch.Generator().manual_seed(1)
    why = dict(_WHY)
    why["basic"] = "the formula itself: root of the mean of squares (no mean subtracted), eps inside the square root, then γ"
    why["one"] = "a single element per row: the output is sign(x)·γ (up to eps)"
    why["offset"] = "values far from zero with a small spread: nothing to subtract, the output is close to γ everywhere"
    why["constant"] = "rows whose values are all equal, one of them all zeros: eps must keep 0 / 0 from happening"
    why["noaffine"] = "weight may be None, as in torch.nn.functional.rms_norm"
    cases = []
    for dt in _dtypes(dtypes, (torch.float32, torch.float64, torch.bfloat16)):
        d = _dtype_name(dt)

        def add(name, x, values, ns, weight=True, eps=1e-6, w_="basic", kappa=1.0):
            w, _ = _params(gen, ns, dt, weight, False)
            cases.append(_FnCase(f"{name}, {d}", x, values, {"weight": w}, (tuple(ns),), eps, why[w_], kappa))

        add("rows of 7", _randn(gen, 4, 7, dtype=dt), "N(0, 1) values", (7,))
        add("3-D input, rows of 33", _randn(gen, 2, 3, 33, dtype=dt, mean=1.0, std=2.0), "N(1, 2²) values", (33,))
        if dt == torch.bfloat16:
            continue
        add("4-D input normalized over its last two dimensions", _randn(gen, 2, 3, 4, 5, dtype=dt), "N(0, 1) values", (4, 5), w_="4d")
        add("one element per row", _randn(gen, 5, 1, dtype=dt), "N(0, 1) values", (1,), w_="one")
        add("a single row of 128", _randn(gen, 1, 128, dtype=dt, std=3.0), "N(0, 3²) values", (128,))
        add("large offset", _randn(gen, 8, 50, dtype=dt, mean=1e4), "1e4 + N(0, 1) values", (50,), w_="offset")
        add("constant rows", _constant_rows((8, 16), dt), _CONSTANTS_WORDS, (16,), w_="constant")
        add("non-contiguous input", _randn(gen, 24, 3, 2, dtype=dt).permute(2, 1, 0), "N(0, 1) values (a permuted view)", (24,), w_="noncontig")
        add("eps = 0.1", _randn(gen, 4, 9, dtype=dt), "N(0, 1) values", (9,), eps=0.1, w_="eps")
        add("weight None", _randn(gen, 3, 12, dtype=dt), "N(0, 1) values", (12,), weight=False, w_="noaffine")

    def words(c):
        aff = "weight" if c.params["weight"] is not None else "weight=None"
        return f"fn(x, normalized_shape={c.middle[0]}, {aff}, eps={c.eps:g}) with x a {_tensor_words(c.x, c.values)}"

    return _run_fn_cases("check_rms_norm", fn, cases, _F.rms_norm, words, gradients, raise_on_failure, gen)


def check_group_norm(
    fn: Callable,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    gradients: bool = True,
    raise_on_failure: bool = True,
) -> CheckReport:
    r"""Check ``fn(x, num_groups, weight, bias, eps)`` against group normalization.

    ``fn`` has the signature of :func:`torch.nn.functional.group_norm` (called
    positionally; ``weight`` and ``bias`` are per channel, shape ``(C,)``, and
    may be ``None``). Input is ``(N, C, *)``; each sample's ``C`` channels are
    split into ``num_groups`` groups of consecutive channels, and each group is
    normalized over its channels and all positions together.

    Args, return value and behaviour are those of :func:`check_layer_norm`.

    Example:
        >>> import torch.nn.functional as F
        >>> check_group_norm(F.group_norm).passed
        True
    """
    gen = torch.Generator().manual_seed(2)
    why = dict(_WHY)
    why["basic"] = (
        "each (sample, group of consecutive channels) normalized over its channels and positions together, "
        "then γ and β per channel"
    )
    why["g1"] = "num_groups=1: one group holds every channel (LayerNorm over (C, *))"
    why["gC"] = "num_groups=C: one channel per group (InstanceNorm)"
    why["noncontig"] = "a channels_last (non-contiguous) input: .view() fails on it, .reshape() works"
    why["constant"] = "groups whose values are all equal: the variance is 0, the output must be β, and eps must keep it finite"
    cases = []
    for dt in _dtypes(dtypes, (torch.float32, torch.float64, torch.bfloat16)):
        d = _dtype_name(dt)

        def add(name, x, values, G, weight=True, bias=True, eps=1e-5, w_="basic", kappa=1.0):
            w, b = _params(gen, (x.shape[1],), dt, weight, bias)
            cases.append(_FnCase(f"{name}, {d}", x, values, {"weight": w, "bias": b}, (G,), eps, why[w_], kappa))

        add("3-D input, 3 groups of 2 channels", _randn(gen, 2, 6, 5, dtype=dt), "N(0, 1) values", 3)
        add("4-D input, 2 groups of 3 channels", _randn(gen, 2, 6, 3, 4, dtype=dt, mean=1.0, std=2.0), "N(1, 2²) values", 2)
        if dt == torch.bfloat16:
            continue
        add("1 group", _randn(gen, 3, 4, 7, dtype=dt), "N(0, 1) values", 1, w_="g1")
        add("one channel per group", _randn(gen, 2, 4, 3, 3, dtype=dt), "N(0, 1) values", 4, w_="gC")
        add("large offset", _randn(gen, 2, 4, 25, dtype=dt, mean=1e4), "1e4 + N(0, 1) values", 2, w_="offset", kappa=1e4)
        const = _constant_rows((2, 4, 8), dt)  # each (sample, channel) constant; 2 groups of 2 channels
        const[:, 1] = const[:, 0]
        const[:, 3] = const[:, 2]
        add("constant groups", const, "every group one repeated value", 2, w_="constant",
            kappa=max(map(abs, _CONSTANTS)) / math.sqrt(1e-5))
        cl = _randn(gen, 2, 6, 4, 4, dtype=dt).contiguous(memory_format=torch.channels_last)
        add("channels_last input", cl, "N(0, 1) values", 3, w_="noncontig")
        add("eps = 0.1", _randn(gen, 2, 4, 5, dtype=dt), "N(0, 1) values", 2, eps=0.1, w_="eps")
        add("weight and bias None", _randn(gen, 2, 6, 5, dtype=dt), "N(0, 1) values", 3, weight=False, bias=False, w_="noaffine")

    def words(c):
        w, b = c.params["weight"], c.params["bias"]
        aff = "weight and bias" if w is not None and b is not None else "weight=None, bias=None"
        return f"fn(x, num_groups={c.middle[0]}, {aff} of shape ({c.x.shape[1]},), eps={c.eps:g}) with x a {_tensor_words(c.x, c.values)}"

    return _run_fn_cases("check_group_norm", fn, cases, _F.group_norm, words, gradients, raise_on_failure, gen)


# ---------------------------------------------------------------- BatchNorm


_BN_ATTRS = ("weight", "bias", "running_mean", "running_var")
_BN_LAYOUT = {
    2: ("(N, C)", "statistics per channel over the N samples, like torch.nn.BatchNorm1d"),
    3: ("(N, C, L)", "statistics per channel over N and L, like torch.nn.BatchNorm1d"),
    4: ("(N, C, H, W)", "statistics per channel over N, H and W, like torch.nn.BatchNorm2d"),
}
_BN_SHAPES = {2: (10, 3), 3: (4, 3, 5), 4: (3, 3, 4, 5)}
_BN_CONSTANT_SHAPES = {2: (16, 3), 3: (4, 3, 4), 4: (2, 3, 2, 4)}


class _BNState:
    """The reference: running statistics and the momentum rule of torch.nn.BatchNorm."""

    def __init__(self, m, momentum, eps):
        self.mean = m.running_mean.detach().to(torch.float64).clone()
        self.var = m.running_var.detach().to(torch.float64).clone()
        self.momentum, self.eps, self.steps = momentum, eps, 0

    def forward(self, x, w, b, training):
        if training:
            self.steps += 1
            momentum = 1.0 / self.steps if self.momentum is None else self.momentum
        else:
            momentum = 0.0
        return _F.batch_norm(x, self.mean, self.var, w, b, training, momentum, self.eps)


def _bn_tensor(m, name):
    t = getattr(m, name, None)
    if not isinstance(t, torch.Tensor):
        raise _Failed(
            f"the module has no tensor attribute {name!r} (got {type(t).__name__}); the checker needs "
            f"weight, bias, running_mean and running_var, named as in torch.nn.BatchNorm1d"
        )
    return t


def check_batch_norm(
    cls: Callable,
    *,
    ndims: Optional[Sequence[int]] = None,
    gradients: bool = True,
    raise_on_failure: bool = True,
) -> CheckReport:
    r"""Check a BatchNorm module class ``cls(num_features)`` against torch.nn.BatchNorm.

    ``cls(num_features)`` must build a module (an :class:`torch.nn.Module`, so
    that ``.train()``/``.eval()`` work) with ``weight`` and ``bias`` (γ, β) and
    the buffers ``running_mean`` and ``running_var``, all of shape
    ``(num_features,)`` and initialised to 1, 0, 0 and 1. In training it must
    normalize with the batch's per-channel mean and biased variance and update
    the running statistics as torch does,
    ``running = (1 - momentum) * running + momentum * batch`` with the
    *unbiased* batch variance (``momentum`` read from the module's
    ``momentum`` attribute, 0.1 if it has none; ``None`` meaning a cumulative
    average); in evaluation it must normalize with the running statistics and
    leave them alone. ``eps`` is read from the module's ``eps`` (1e-5 if none).

    The checker runs several training steps on batches with different
    statistics, then evaluation (also on a batch of one sample), then the
    adversarial batches, and compares outputs, running statistics and the
    gradients of x, weight and bias with a float64 reference.

    Args:
        cls: your module class (or any callable returning a fresh module).
        ndims: the input dimensionalities to test, from 2 ``(N, C)``, 3
            ``(N, C, L)`` and 4 ``(N, C, H, W)``. By default each is tried and
            those your module refuses with an exception are left out (it must
            accept at least one); pass ``ndims=(2,)`` for a module meant only
            for ``(N, C)``.
        gradients: also compare gradients in training.
        raise_on_failure: raise ``AssertionError`` describing the first failing case.

    Example:
        >>> import torch
        >>> check_batch_norm(torch.nn.BatchNorm1d, ndims=(2, 3)).passed
        True
    """
    gen = torch.Generator().manual_seed(3)
    report = CheckReport("check_batch_norm", _subject_name(cls))
    C = 3

    def case(name, call, why, body):
        result = CaseResult(name, call, True, why=why)
        try:
            note = body()
            if note:
                result.note = note
        except _Failed as f:
            result.passed = False
            result.skipped = isinstance(f, _Skipped)
            result.message = str(f)
        except Exception as e:  # something about the module the checker could not handle
            result.passed = False
            result.message = f"the check could not complete: {_exception_text(e)}"
        report.cases.append(result)
        return result.passed

    def build(dtype=torch.float32):
        try:
            m = cls(C)
        except Exception as e:
            raise _Failed(f"building the module raised {_exception_text(e)}") from None
        for name in ("train", "eval"):
            if not callable(getattr(m, name, None)):
                raise _Failed(
                    f"cls({C}) has no {name}() method: make it a torch.nn.Module subclass "
                    "(super().__init__() first), so that model.train()/model.eval() switch it"
                )
        for name in _BN_ATTRS:
            t = _bn_tensor(m, name)
            if tuple(t.shape) != (C,):
                raise _Failed(f"cls({C}).{name} has shape {tuple(t.shape)}, expected ({C},)")
        if dtype != torch.float32:
            try:
                m = m.to(dtype)
            except Exception as e:
                raise _Failed(f"module.to({_dtype_name(dtype)}) raised {_exception_text(e)}") from None
            for name in _BN_ATTRS:
                t = _bn_tensor(m, name)
                if t.dtype != dtype:
                    raise _Failed(
                        f"after module.to({_dtype_name(dtype)}) the module's {name} is still "
                        f"{_dtype_name(t.dtype)}: register it with self.register_buffer(...) "
                        "(or as an nn.Parameter) so that .to() moves it"
                    )
        return m

    def set_affine(m, dtype):
        with torch.no_grad():
            w, b = _params(gen, (C,), torch.float64)
            m.weight.copy_(w.to(dtype))
            m.bias.copy_(b.to(dtype))

    def hyper(m):
        mom = getattr(m, "momentum", 0.1)
        eps = getattr(m, "eps", 1e-5)
        if mom is not None and (isinstance(mom, bool) or not isinstance(mom, (int, float))):
            raise _Failed(f"the module's momentum is {mom!r}: expected a number in [0, 1] or None")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise _Failed(f"the module's eps is {eps!r}: expected a number")
        return mom, float(eps)

    def batch(nd, dtype, mean=0.0, std=1.0, shape=None):
        shape = shape or _BN_SHAPES[nd]
        # a different mean and spread per channel, so that per-channel statistics matter
        ch = torch.arange(1, C + 1, dtype=torch.float64).reshape((1, C) + (1,) * (nd - 2))
        z = torch.randn(*shape, generator=gen, dtype=torch.float64)
        return (mean + ch * 0.5 + std * ch * z).to(dtype)

    def step(m, ref, x, training, what, dtype, kappa=1.0):
        """Run one forward (and backward in training); compare output, stats and gradients."""
        (atol, rtol), (gatol, grtol) = _TOL[dtype]
        if kappa > 1:
            slack = _ULPS_PER_KAPPA * kappa * torch.finfo(dtype).eps
            atol, rtol, gatol, grtol = (max(t, slack) for t in (atol, rtol, gatol, grtol))
        want_grad = gradients and training
        xl = _leaf(x, want_grad)
        before = xl.detach().clone()
        for p in (m.weight, m.bias):
            p.grad = None
        try:
            out = m(xl)
        except Exception as e:
            raise _Failed(f"{what}: calling the module raised {_exception_text(e)}") from None
        rx = x.detach().to(torch.float64).requires_grad_(want_grad)
        rw = m.weight.detach().to(torch.float64).requires_grad_(want_grad)
        rb = m.bias.detach().to(torch.float64).requires_grad_(want_grad)
        expected = ref.forward(rx, rw, rb, training)
        _compare(out, expected, f"{what}: the output", dtype, (atol, rtol))
        if not torch.equal(xl.detach(), before):
            raise _Failed(f"{what}: the module modified its input in place")
        for name, want in (("running_mean", ref.mean), ("running_var", ref.var)):
            got = getattr(m, name, None)
            if isinstance(got, torch.Tensor) and got.requires_grad:
                raise _Failed(
                    f"{what}: {name} requires grad, so every step's graph stays alive; update it "
                    "under torch.no_grad() (or from detached statistics)"
                )
            extra = ""
            if name == "running_var" and training:
                extra = (
                    f" (torch records the unbiased batch variance, the biased one times n/(n-1) "
                    f"with n = {x.numel() // C} values per channel)"
                )
            try:
                _compare(got, want, f"{what}: {name} afterwards", dtype, (atol, rtol))
            except _Failed as f:
                raise _Failed(str(f) + extra) from None
        if want_grad:
            if not out.requires_grad:
                return "forward only: the output does not require grad"
            dy = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
            try:
                out.backward(dy.to(dtype))
            except Exception as e:
                raise _Failed(f"{what}: backward raised {_exception_text(e)}") from None
            expected.backward(dy)
            for name, mine, r in (("x", xl, rx), ("weight", m.weight, rw), ("bias", m.bias, rb)):
                if mine.grad is None:
                    raise _Failed(
                        f"{what}: the gradient with respect to {name} is None: the output does not "
                        f"depend on {name} through autograd"
                    )
                _compare(mine.grad, r.grad, f"{what}: the gradient with respect to {name}", dtype, (gatol, grtol))
        return ""

    # which layouts to run
    layouts = []
    probe_errors = {}
    candidates = list(ndims) if ndims is not None else [2, 3, 4]
    for nd in candidates:
        if nd not in _BN_LAYOUT:
            raise ValueError(f"ndims may hold 2, 3 and 4 (got {nd})")
    if ndims is None:
        for nd in candidates:
            try:
                m = cls(C)
                m.train()
                m(batch(nd, torch.float32))
                layouts.append(nd)
            except Exception as e:
                probe_errors[nd] = _exception_text(e)
        if not layouts:
            # report why (the first layout's error) as a failed case
            layouts = [2]
        for nd, err in probe_errors.items():
            if nd not in layouts:
                report.notes.append(f"{nd}-D input {_BN_LAYOUT[nd][0]} not tested: your module refused it ({err})")
    else:
        layouts = candidates

    for nd in layouts:
        shape_words, stats_words = _BN_LAYOUT[nd]
        hint = "" if ndims is not None else (
            f"; if your module is not meant for {nd}-D input, pass ndims=(...) with the layouts it supports"
        )
        why_train = f"training: batch statistics ({stats_words}), then the running-statistics update{hint}"

        def dtype_runs(dtype, nd=nd, shape_words=shape_words, why_train=why_train):
            d = _dtype_name(dtype)
            state = {}

            def fresh():
                m = build(dtype)
                mom, eps = hyper(m)
                state["m"], state["ref"] = m, _BNState(m, mom, eps)
                set_affine(m, dtype)
                m.train()
                return m

            def init():
                m = build(dtype)
                for name, want in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
                    t = _bn_tensor(m, name).detach().to(torch.float64)
                    if not torch.all(t == want):
                        raise _Failed(f"a new module's {name} is {t.tolist()}, expected all {want:g} (torch's initial value)")

            case(f"{nd}-D, {d}: initial weight, bias and running statistics", f"cls({C})",
                 "a new module starts with weight 1, bias 0, running_mean 0, running_var 1", init)
            x_shape = tuple(_BN_SHAPES[nd])
            for k, (mean, std) in enumerate([(2.0, 3.0), (-1.0, 0.5), (0.0, 1.0)], start=1):
                def body(k=k, mean=mean, std=std):
                    if k == 1:
                        fresh()
                    elif "m" not in state:
                        raise _Skipped("not run: an earlier training step failed")
                    return step(state["m"], state["ref"], batch(nd, dtype, mean, std), True, f"training step {k}", dtype)
                if not case(f"{nd}-D, {d}: training step {k}",
                            f"module.train(); module(x) with x a {d} batch of shape {x_shape} {shape_words}, values ≈ N({mean:g}, {std:g}²)·channel",
                            why_train, body):
                    state.pop("m", None)
            def eval_body():
                if "m" not in state:
                    raise _Skipped("not run: the training steps before it failed")
                m, ref = state["m"], state["ref"]
                m.eval()
                step(m, ref, batch(nd, dtype, 5.0, 2.0), False, "evaluation", dtype)
                one = (1,) + x_shape[1:]
                step(m, ref, batch(nd, dtype, -3.0, 1.0, shape=one), False, f"evaluation on one sample {one}", dtype)
                m.train()
                step(m, ref, batch(nd, dtype, 1.0, 2.0), True, "training again after module.train()", dtype)
            case(f"{nd}-D, {d}: evaluation, then training again", 
                 f"after the training steps: module.eval(); module(x) on a batch of shape {x_shape} and on one sample; then module.train(); module(x)",
                 "evaluation normalizes with the running statistics (not the batch's) and does not update them; "
                 "module.train() switches back", eval_body)
            if dtype != torch.float32:
                return

            mom_attr = getattr(build_quiet(), "momentum", "absent")

            def momentum_body():
                m = fresh()
                m.momentum = 0.5
                state["ref"].momentum = 0.5
                for k in (1, 2):
                    step(m, state["ref"], batch(nd, dtype, 1.0 + k, 1.5), True, f"step {k} with momentum 0.5", dtype)
            if isinstance(mom_attr, float) or mom_attr is None:
                case(f"{nd}-D, {d}: momentum = 0.5", "module.momentum = 0.5, then two training steps",
                     "forward reads self.momentum, with torch's convention: new = (1 - momentum)·old + momentum·batch",
                     momentum_body)

            def eps_body():
                m = fresh()
                m.eps = 0.1
                state["ref"].eps = 0.1
                step(m, state["ref"], batch(nd, dtype, 0.0, 0.5), True, "training with eps 0.1", dtype)
                m.eval()
                step(m, state["ref"], batch(nd, dtype, 0.0, 0.5), False, "evaluation with eps 0.1", dtype)
            if isinstance(getattr(build_quiet(), "eps", None), float):
                case(f"{nd}-D, {d}: eps = 0.1", "module.eps = 0.1, then a training step and an evaluation",
                     "forward reads self.eps and adds it to the variance inside the square root "
                     "(0.1 is large enough to show an eps ignored or added outside)", eps_body)

            def adversarial(name, make, values, why, kappa=1.0):
                def body():
                    m = fresh()
                    k = kappa(state["ref"].eps) if callable(kappa) else kappa
                    return step(m, state["ref"], make(), True, name, dtype, k)
                x = make()
                case(f"{nd}-D, {d}: {name}", f"module.train(); module(x) with x a {_tensor_words(x, values)}", why, body)

            adversarial("large offset", lambda: batch(nd, dtype, 1e4, 0.3), "values ≈ 1e4 + N(0, 0.3²)·channel",
                        _WHY["offset"], kappa=1e4)

            def constant():
                # 16 values per channel (a power of two, so even a mean taken as sum * (1/n) is exact)
                x = batch(nd, dtype, shape=_BN_CONSTANT_SHAPES[nd])
                x[:, 1] = 3.25
                return x
            adversarial("a constant channel", constant, "channel 1 all 3.25",
                        "a channel whose values are all equal: its variance is 0, its output must be β, eps must keep it finite",
                        kappa=lambda eps: 3.25 / math.sqrt(eps) if eps > 0 else 1.0)

            def noncontig():
                x = batch(nd, dtype)
                return x.transpose(0, -1).contiguous().transpose(0, -1)
            adversarial("non-contiguous input", noncontig, "values ≈ N(0, 1)·channel", _WHY["noncontig"])

        def build_quiet():
            try:
                return cls(C)
            except Exception:
                return None

        for dtype in (torch.float32, torch.float64):
            dtype_runs(dtype)

    if raise_on_failure:
        report._raise_if_failed()
    return report
