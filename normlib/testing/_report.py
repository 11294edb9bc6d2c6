"""The report a checker returns, and how it compares what came with what was expected."""

from __future__ import annotations

import math
import os
import sys
import traceback
import types
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .tolerance import KAPPA_GRADIENT, bound, tolerance

#: The dtypes the checkers run: the 16-bit ones forward only.
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
#: Roundings to the output dtype an implementation may make on the way to ``y = x̂·γ + β``: one per step of
#: the formula written out in the input's dtype (x - mean, its square, their mean, + eps, the square root,
#: the division, × γ, + β). torch's own norms round once; Llama's and DeBERTa's orders three times.
ROUNDINGS = 8


def _output_allowed(dtype: torch.dtype, n: int, kappa: float, terms: torch.Tensor, gain) -> tuple:
    """How far each output element may be off, and those words: the one rule's two terms
    (:func:`normlib.testing.tolerance.bound`), each scaled by what it applies to.

    The roundings are relative to ``terms`` = ``|x̂·γ| + |β|``, the values added up
    last; an error in the statistics (``n`` bounds every sum's length, ``kappa`` is
    ``|mean| / spread``) moves x̂ by an amount of order one, times ``gain`` = ``|γ|``.
    """
    rounding, sums = bound(dtype, n=n, kappa=kappa, roundings=ROUNDINGS)
    return rounding * terms + sums * gain, f"{rounding:.3g}·(|x̂·γ| + |β|) + {sums:.3g}·|γ|"


def _gradient_allowed(dtype: torch.dtype, n: int, kappa: float, expected: torch.Tensor) -> tuple:
    """How far each gradient element may be off, and those words: :func:`tolerance` with
    :data:`KAPPA_GRADIENT` times the condition, relative to ``|expected| + max(1, max |expected|)``."""
    t = tolerance(dtype, n=n, kappa=KAPPA_GRADIENT * kappa, roundings=ROUNDINGS)
    return _normwise(t, expected), f"{t:.3g}·(|expected| + the largest |expected|, at least 1)"


def _normwise(t: float, expected: torch.Tensor) -> torch.Tensor:
    e = expected.detach().to(torch.float64)
    finite = e[torch.isfinite(e)].abs()
    return t * (e.abs() + max(1.0, float(finite.max()) if finite.numel() else 1.0))


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


_LIBRARY_DIRS = tuple(_package_dir(m) for m in (torch, sys.modules[__name__.split(".", 1)[0]]))


def _exception_text(e: BaseException) -> str:
    """``TypeError: ...`` and the line of the reader's own code it came from (not torch's, not normlib's)."""
    where = ""
    for fr in reversed(traceback.extract_tb(e.__traceback__)):
        if not os.path.abspath(fr.filename).startswith(_LIBRARY_DIRS):
            where = f" (in {fr.name}: {fr.line})" if fr.line else f" (in {fr.name})"
            break
    return f"{type(e).__name__}: {e}{where}"


def _compare(got, expected: torch.Tensor, what: str, dtype: torch.dtype, allowed: tuple) -> None:
    """Raise _Failed describing how ``got`` differs from the float64 ``expected``.

    ``allowed`` is ``(tensor, words)``: how far each element may be off, and how
    that was computed (see :func:`_output_allowed`, :func:`_gradient_allowed`).
    """
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
    bad_nonfinite = ~torch.isfinite(g) & torch.isfinite(e)
    if bad_nonfinite.any():
        k = int(bad_nonfinite.nonzero()[0])
        raise _Failed(
            f"{what}: got {int(bad_nonfinite.sum())} non-finite value(s) of {g.numel()}; the first at index "
            f"{_index(k, expected.shape)}: expected {_fmt(float(e[k]))}, got {_fmt(float(g[k]))}"
        )
    limit, words = allowed
    limit = torch.as_tensor(limit, dtype=torch.float64).expand(expected.shape).reshape(-1)
    diff = (g - e).abs()
    bad = diff > limit
    if bad.any():
        k = int(torch.argmax(torch.where(bad, diff / limit, torch.zeros_like(diff))))
        raise _Failed(
            f"{what} differs at {int(bad.sum())} of {g.numel()} elements. The worst, at index "
            f"{_index(k, expected.shape)}: expected {_fmt(float(e[k]))}, got {_fmt(float(g[k]))} "
            f"(off by {_fmt(float(diff[k]))}; allowed: {words} = {_fmt(float(limit[k]))})"
        )


def _stride_note(x: torch.Tensor) -> str:
    return "" if x.is_contiguous() else f", non-contiguous (strides {tuple(x.stride())})"


def _tensor_words(x: torch.Tensor, values: str) -> str:
    return f"{_dtype_name(x.dtype)} input of shape {tuple(x.shape)}{_stride_note(x)}, {values}"
