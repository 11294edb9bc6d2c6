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

# (atol, rtol) for the forward output and for gradients, per dtype.
_TOL = {
    torch.float64: ((1e-9, 1e-9), (1e-9, 1e-9)),
    torch.float32: ((1e-5, 1e-5), (1e-4, 1e-4)),
    torch.bfloat16: ((4e-2, 4e-2), (4e-2, 4e-2)),
}
_ULPS_PER_KAPPA = 32  # allowed units in the last place per unit of condition number κ = |mean| / spread


def _tolerances(dtype: torch.dtype, kappa: float = 1.0) -> tuple:
    """``((atol, rtol), (gradient atol, gradient rtol))`` for ``dtype`` and an input of condition number ``kappa``.

    Where the mean is κ > 1 times the spread, each tolerance is at least
    ``32 κ`` units in the last place of ``dtype``.
    """
    (atol, rtol), (gatol, grtol) = _TOL[dtype]
    if kappa > 1:
        slack = _ULPS_PER_KAPPA * kappa * torch.finfo(dtype).eps
        atol, rtol, gatol, grtol = (max(t, slack) for t in (atol, rtol, gatol, grtol))
    return (atol, rtol), (gatol, grtol)


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


def _stride_note(x: torch.Tensor) -> str:
    return "" if x.is_contiguous() else f", non-contiguous (strides {tuple(x.stride())})"


def _tensor_words(x: torch.Tensor, values: str) -> str:
    return f"{_dtype_name(x.dtype)} input of shape {tuple(x.shape)}{_stride_note(x)}, {values}"
