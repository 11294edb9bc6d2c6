"""Checker for a BatchNorm module class: training steps, evaluation, running statistics.

:func:`check_batch_norm` is a table, ``_BN_CASES``: each case says which module it
starts from, what it sets on it, which calls it makes (mode and input batch)
and the words of its line in the report. One loop runs the table for every
input layout and dtype; every call compares the output and the running
statistics afterwards, and in training the gradients of x, weight and bias,
with a float64 reference.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .. import functional as _F
from ._cases import _HALF, _WHY, _check_options, _constant_kappa, _dtypes, _leaf, _params
from .tolerance import tolerance
from ._report import (
    ROUNDINGS,
    CaseResult,
    CheckReport,
    _compare,
    _dtype_name,
    _exception_text,
    _Failed,
    _Skipped,
    _subject_name,
    _gradient_allowed,
    _normwise,
    _output_allowed,
    _tensor_words,
)
from ..errors import NormValueError, NormTypeError

_C = 3  # every module is built as cls(_C)
_BN_ATTRS = ("weight", "bias", "running_mean", "running_var")
_BN_LAYOUT = {
    2: ("(N, C)", "statistics per channel over the N samples, like torch.nn.BatchNorm1d"),
    3: ("(N, C, L)", "statistics per channel over N and L, like torch.nn.BatchNorm1d"),
    4: ("(N, C, H, W)", "statistics per channel over N, H and W, like torch.nn.BatchNorm2d"),
}
_BN_SHAPES = {2: (10, 3), 3: (4, 3, 5), 4: (3, 3, 4, 5)}
# 16 values per channel (a power of two, so even a mean taken as sum * (1/n) is exact)
_BN_CONSTANT_SHAPES = {2: (16, 3), 3: (4, 3, 4), 4: (2, 3, 2, 4)}


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class _Batch:
    """How one input is drawn: channel c = 1, ..., C holds ``mean + 0.5·c + std·c·N(0, 1)``.

    Each channel has its own mean and spread, so that per-channel statistics matter.
    """

    mean: float = 0.0
    std: float = 1.0
    shape: str = "batch"  # "batch" (_BN_SHAPES), "one sample" (N = 1) or "16 per channel" (_BN_CONSTANT_SHAPES)
    constant: Optional[float] = None  # channel 1 set to this one value: its variance is 0
    transposed: bool = False  # stored with the first and last dimensions swapped: non-contiguous
    kappa: float = 1.0  # |mean| / spread, for the tolerance

    def draw(self, gen: torch.Generator, nd: int, dtype: torch.dtype) -> torch.Tensor:
        full = _BN_SHAPES[nd]
        shape = {"batch": full, "one sample": (1,) + full[1:], "16 per channel": _BN_CONSTANT_SHAPES[nd]}[self.shape]
        ch = torch.arange(1, _C + 1, dtype=torch.float64).reshape((1, _C) + (1,) * (nd - 2))
        z = torch.randn(*shape, generator=gen, dtype=torch.float64)
        x = (self.mean + ch * 0.5 + self.std * ch * z).to(dtype)
        if self.constant is not None:
            x[:, 1] = self.constant
        if self.transposed:
            x = x.transpose(0, -1).contiguous().transpose(0, -1)
        return x

    def condition(self, eps: float) -> float:
        """κ for the tolerance (a constant channel's spread is in effect sqrt(eps))."""
        return self.kappa if self.constant is None else _constant_kappa((self.constant,), eps)


@dataclass(frozen=True)
class _Call:
    """One ``module(x)`` in a case."""

    training: bool  # its mode: module.train() or module.eval() is called first when the mode changes
    batch: _Batch
    what: str = ""  # how the messages name this call ({shape}: its input's shape); empty: the case's name


@dataclass(frozen=True)
class _BNCase:
    """One row of the table, run for every layout (2-, 3-, 4-D) and each of its dtypes.

    ``module`` is where the case starts: ``"new"``, a module as ``cls(C)``
    builds it, whose weight, bias and running statistics are compared with
    torch's initial 1, 0, 0 and 1 (no calls); ``"fresh"``, a new module with
    random γ and β in training mode; ``"carried"``, the module the case before
    left (the case is skipped, with ``skip`` as its message, when that one
    failed). Each call then compares the output and ``running_mean`` and
    ``running_var`` afterwards with the reference, and in training (with
    ``gradients=True``) the gradients of x, weight and bias.

    ``call`` and ``why`` are templates: ``{C}`` the channels, ``{d}`` the dtype,
    ``{shape}`` and ``{layout}`` the batch's shape and its letters, ``{stats}``
    the axes of the statistics, ``{hint}`` advice on ``ndims`` (when the
    layouts were probed), ``{x}`` the first call's input in words.
    """

    name: str  # the report's title, after "{nd}-D, {dtype}: "
    call: str  # the inputs, in words
    why: str  # what the case is there to catch
    module: str  # "new", "fresh" or "carried"
    calls: tuple[_Call, ...] = ()
    sets: tuple[tuple[str, float], ...] = ()  # set on the module and on the reference before the calls
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float64)
    needs: Optional[tuple[str, tuple[type, ...]]] = None  # run only where a new module's attribute has these types
    values: str = ""  # for {x}: the input's values in words (drawn once for the words, again for the call)
    forward_only_note: bool = True  # note "forward only" when a call's output does not require grad
    skip: str = ""


_F32 = (torch.float32,)  # the cases after evaluation run in float32 only
_TRAINING_BATCHES = (_Batch(2.0, 3.0), _Batch(-1.0, 0.5), _Batch(0.0, 1.0))
_ADVERSARIAL_CALL = "module.train(); module(x) with x a {x}"

_BN_CASES: tuple[_BNCase, ...] = (
    _BNCase("initial weight, bias and running statistics", "cls({C})",
            "a new module starts with weight 1, bias 0, running_mean 0, running_var 1", module="new"),
    *(
        _BNCase(f"training step {k}",
                f"module.train(); module(x) with x a {{d}} batch of shape {{shape}} {{layout}}, "
                f"values ≈ N({b.mean:g}, {b.std:g}²)·channel",
                "training: batch statistics ({stats}), then the running-statistics update{hint}",
                module="fresh" if k == 1 else "carried", calls=(_Call(True, b),),
                skip="not run: an earlier training step failed")
        for k, b in enumerate(_TRAINING_BATCHES, start=1)
    ),
    _BNCase("evaluation, then training again",
            "after the training steps: module.eval(); module(x) on a batch of shape {shape} and on one sample; "
            "then module.train(); module(x)",
            "evaluation normalizes with the running statistics (not the batch's) and does not update them; "
            "module.train() switches back",
            module="carried",
            calls=(_Call(False, _Batch(5.0, 2.0), "evaluation"),
                   _Call(False, _Batch(-3.0, 1.0, shape="one sample"), "evaluation on one sample {shape}"),
                   _Call(True, _Batch(1.0, 2.0), "training again after module.train()")),
            forward_only_note=False, skip="not run: the training steps before it failed"),
    _BNCase("momentum = 0.5", "module.momentum = 0.5, then two training steps",
            "forward reads self.momentum, with torch's convention: new = (1 - momentum)·old + momentum·batch",
            module="fresh", sets=(("momentum", 0.5),),
            calls=(_Call(True, _Batch(2.0, 1.5), "step 1 with momentum 0.5"),
                   _Call(True, _Batch(3.0, 1.5), "step 2 with momentum 0.5")),
            dtypes=_F32, needs=("momentum", (float, type(None))), forward_only_note=False),
    _BNCase("eps = 0.1", "module.eps = 0.1, then a training step and an evaluation",
            "forward reads self.eps and adds it to the variance inside the square root "
            "(0.1 is large enough to show an eps ignored or added outside)",
            module="fresh", sets=(("eps", 0.1),),
            calls=(_Call(True, _Batch(0.0, 0.5), "training with eps 0.1"),
                   _Call(False, _Batch(0.0, 0.5), "evaluation with eps 0.1")),
            dtypes=_F32, needs=("eps", (float,)), forward_only_note=False),
    _BNCase("large offset", _ADVERSARIAL_CALL, _WHY["offset"], module="fresh",
            calls=(_Call(True, _Batch(1e4, 0.3, kappa=1e4)),), dtypes=_F32,
            values="values ≈ 1e4 + N(0, 0.3²)·channel"),
    _BNCase("a constant channel", _ADVERSARIAL_CALL,
            "a channel whose values are all equal: its variance is 0, its output must be β, eps must keep it finite",
            module="fresh", calls=(_Call(True, _Batch(shape="16 per channel", constant=3.25)),), dtypes=_F32,
            values="channel 1 all 3.25"),
    _BNCase("non-contiguous input", _ADVERSARIAL_CALL, _WHY["noncontig"], module="fresh",
            calls=(_Call(True, _Batch(transposed=True)),), dtypes=_F32, values="values ≈ N(0, 1)·channel"),
    # 16 bits (asked for with dtypes=...): chapter 05d's mistakes, forward only
    _BNCase("mean 100 times the spread", _ADVERSARIAL_CALL, _WHY["lowoffset"], module="fresh",
            calls=(_Call(True, _Batch(100.0, 1.0, kappa=100.0)),), dtypes=_HALF,
            values="values ≈ 100 + N(0, 1)·channel"),
    # channel c has spread 60·c: values beyond 256 in channels 2 and 3, a variance float16 still holds
    _BNCase("values beyond 256", _ADVERSARIAL_CALL, _WHY["overflow"], module="fresh",
            calls=(_Call(True, _Batch(0.0, 60.0)),), dtypes=(torch.float16,),
            values="values ≈ N(0, 60²)·channel"),
)


# ---------------------------------------------------------------- the loop


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


@dataclass
class _Live:
    """The module the cases run on, its reference, and the mode the checker last put it in."""

    module: Any  # the reader's: a torch.nn.Module, or anything with its train(), eval() and attributes
    ref: _BNState
    training: bool = True


def _per_channel(x: torch.Tensor) -> tuple:
    """The shape a per-channel (C,) tensor is viewed as to broadcast against ``x`` of shape (N, C, *)."""
    return (x.shape[1],) + (1,) * (x.dim() - 2)


def _bn_tensor(m, name):
    t = getattr(m, name, None)
    if not isinstance(t, torch.Tensor):
        raise _Failed(
            f"the module has no tensor attribute {name!r} (got {type(t).__name__}); the checker needs "
            f"weight, bias, running_mean and running_var, named as in torch.nn.BatchNorm1d"
        )
    return t


def _hyper(m) -> tuple:
    """The module's momentum and eps (torch's 0.1 and 1e-5 where it has none)."""
    mom = getattr(m, "momentum", 0.1)
    eps = getattr(m, "eps", 1e-5)
    if mom is not None and (isinstance(mom, bool) or not isinstance(mom, numbers.Real)):
        raise _Failed(f"the module's momentum is {mom!r}: expected a number in [0, 1] or None")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise _Failed(f"the module's eps is {eps!r}: expected a number")
    return (None if mom is None else float(mom)), float(eps)


def _check_initial(m) -> None:
    for name, want in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
        t = _bn_tensor(m, name).detach().to(torch.float64)
        if not torch.all(t == want):
            raise _Failed(f"a new module's {name} is {t.tolist()}, expected all {want:g} (torch's initial value)")


_ABSENT = object()


class _Run:
    """One run of check_batch_norm: the class under test, the options, and the generator of every input."""

    def __init__(self, cls: Callable, gradients: bool, probe: bool):
        self.cls, self.gradients, self.probe = cls, gradients, probe
        self.gen = torch.Generator().manual_seed(3)
        self.live: Optional[_Live] = None  # the module a "carried" case goes on with

    def layouts(self, ndims: Optional[Sequence[int]], report: CheckReport) -> list:
        """``ndims``, or (when probing) the layouts the module accepts, with a note for each it refuses."""
        if ndims is not None and (isinstance(ndims, (int, str)) or not isinstance(ndims, (list, tuple))):
            raise NormTypeError(f"ndims must be a list or tuple of ints from 2, 3 and 4, e.g. (2, 3) "
                            f"(got {type(ndims).__name__} {ndims!r})")
        if ndims is not None and not ndims:
            raise NormValueError("ndims must name at least one layout (got an empty sequence): a check of nothing "
                             "would pass anything")
        candidates = list(ndims) if ndims is not None else [2, 3, 4]
        for nd in candidates:
            if isinstance(nd, bool) or not isinstance(nd, numbers.Integral) or nd not in _BN_LAYOUT:
                raise NormValueError(f"ndims may hold the ints 2, 3 and 4 (got {nd!r})")
        candidates = [int(nd) for nd in candidates]
        if len(set(candidates)) != len(candidates):
            raise NormValueError(f"ndims names a layout twice ({candidates}): each runs once")
        if not self.probe:
            return candidates
        layouts, refused = [], {}
        for nd in candidates:
            try:
                m = self.cls(_C)
                m.train()
                m(_Batch().draw(self.gen, nd, torch.float32))
                layouts.append(nd)
            except Exception as e:
                refused[nd] = _exception_text(e)
        if not layouts:
            # report why (the first layout's error) as a failed case
            layouts = [2]
        for nd, err in refused.items():
            if nd not in layouts:
                report.notes.append(f"{nd}-D input {_BN_LAYOUT[nd][0]} not tested: your module refused it ({err})")
        return layouts

    def applies(self, case: _BNCase) -> bool:
        """Whether a new module has what ``case.needs`` (a module that cannot be built has nothing)."""
        if case.needs is None:
            return True
        name, types = case.needs
        try:
            new = self.cls(_C)
        except Exception:
            new = None
        return isinstance(getattr(new, name, _ABSENT), types)

    def build(self, dtype: torch.dtype):
        try:
            m = self.cls(_C)
        except Exception as e:
            raise _Failed(f"building the module raised {_exception_text(e)}") from None
        for name in ("train", "eval"):
            if not callable(getattr(m, name, None)):
                raise _Failed(
                    f"cls({_C}) has no {name}() method: make it a torch.nn.Module subclass "
                    "(super().__init__() first), so that model.train()/model.eval() switch it"
                )
        for name in _BN_ATTRS:
            t = _bn_tensor(m, name)
            if tuple(t.shape) != (_C,):
                raise _Failed(f"cls({_C}).{name} has shape {tuple(t.shape)}, expected ({_C},)")
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

    def fresh(self, dtype: torch.dtype) -> _Live:
        """A new module with random γ and β, in training mode, and its reference."""
        m = self.build(dtype)
        mom, eps = _hyper(m)
        live = self.live = _Live(m, _BNState(m, mom, eps))
        with torch.no_grad():
            w, b = _params(self.gen, (_C,), torch.float64)
            m.weight.copy_(w.to(dtype))
            m.bias.copy_(b.to(dtype))
        m.train()
        return live

    def case(self, case: _BNCase, nd: int, dtype: torch.dtype) -> CaseResult:
        """Run one row of the table on ``nd``-D input of ``dtype``: its line in the report."""
        layout, stats = _BN_LAYOUT[nd]
        d = _dtype_name(dtype)
        hint = f"; if your module is not meant for {nd}-D input, pass ndims=(...) with the layouts it supports"
        words = dict(C=_C, d=d, shape=_BN_SHAPES[nd], layout=layout, stats=stats, hint=hint if self.probe else "")
        if case.values:
            words["x"] = _tensor_words(case.calls[0].batch.draw(self.gen, nd, dtype), case.values)
        result = CaseResult(f"{nd}-D, {d}: {case.name}", case.call.format(**words), True, why=case.why.format(**words))
        try:
            notes = [n for n in self.run(case, nd, dtype) if n]
            if notes and case.forward_only_note:
                result.note = notes[0]
        except _Failed as f:
            result.passed = False
            result.skipped = isinstance(f, _Skipped)
            result.message = str(f)
        except Exception as e:  # something about the module the checker could not handle
            result.passed = False
            result.message = f"the check could not complete: {_exception_text(e)}"
        if not result.passed:  # a module a case failed on is not carried on with
            self.live = None
        return result

    def run(self, case: _BNCase, nd: int, dtype: torch.dtype) -> list:
        """The module, settings and calls of one case; the calls' notes."""
        if case.module == "new":
            _check_initial(self.build(dtype))
            return []
        if case.module == "fresh":
            live = self.fresh(dtype)
        elif self.live is None:
            raise _Skipped(case.skip)
        else:
            live = self.live
        m, ref = live.module, live.ref
        for name, value in case.sets:
            setattr(m, name, value)
            setattr(ref, name, value)
        notes = []
        for c in case.calls:
            if c.training != live.training:
                if c.training:
                    m.train()
                else:
                    m.eval()
                live.training = c.training
            x = c.batch.draw(self.gen, nd, dtype)
            what = c.what.format(shape=tuple(x.shape)) if c.what else case.name
            notes.append(self.call(m, ref, x, c.training, what, dtype, c.batch.condition(ref.eps)))
        return notes

    def call(self, m, ref: _BNState, x, training: bool, what: str, dtype: torch.dtype, kappa: float) -> str:
        """Run ``m(x)`` (and backward in training); compare output, running statistics and gradients.

        Returns a note for the report ("forward only" where the output does
        not require grad), or "".
        """
        n = x.numel()  # no sum in the call is longer
        want_grad = self.gradients and training and dtype in (torch.float32, torch.float64)
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
        beta = rb.detach().reshape(_per_channel(x))
        terms = (expected.detach() - beta).abs() + beta.abs()  # |x̂·γ| + |β|
        gain = rw.detach().abs().reshape(_per_channel(x)).expand_as(terms)
        _compare(out, expected, f"{what}: the output", dtype, _output_allowed(dtype, n, kappa, terms, gain))
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
                    f"with n = {x.numel() // _C} values per channel)"
                )
            try:
                t = tolerance(dtype, n=n, kappa=kappa, roundings=ROUNDINGS)
                _compare(got, want, f"{what}: {name} afterwards", dtype,
                         (_normwise(t, want), f"{t:.3g}·(|expected| + the largest |expected|, at least 1)"))
            except _Failed as f:
                raise _Failed(str(f) + extra) from None
        if want_grad:
            if not out.requires_grad:
                return "forward only: the output does not require grad"
            dy = torch.randn(expected.shape, generator=self.gen, dtype=torch.float64)
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
                _compare(mine.grad, r.grad, f"{what}: the gradient with respect to {name}", dtype,
                         _gradient_allowed(dtype, n, kappa, r.grad))
        return ""


def check_batch_norm(
    cls: Callable,
    *,
    ndims: Optional[Sequence[int]] = None,
    dtypes: Optional[Sequence[torch.dtype]] = None,
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
        dtypes: the dtypes to run (default float32 and float64). bfloat16
            and float16 run, forward only, the mistakes of chapter 05d: a
            batch far from zero (statistics kept in 16 bits) and, in float16,
            values whose squares overflow. (torch 2.13's own BatchNorm on CPU
            fails the first: in 16 bits it is off by up to a quarter of the
            spread there, where statistics in float32 are off by a rounding.)
        gradients: also compare gradients in training.
        raise_on_failure: raise ``AssertionError`` describing the first failing case.

    Example:
        >>> import torch
        >>> check_batch_norm(torch.nn.BatchNorm1d, ndims=(2, 3)).passed
        True
    """
    if isinstance(cls, torch.nn.Module):
        raise NormTypeError(f"check_batch_norm: cls must be your class (or a callable that builds a new module from "
                        f"num_features), e.g. check_batch_norm(MyBatchNorm); got the module {cls!r}")
    _check_options("check_batch_norm", cls, gradients, raise_on_failure, what="cls")
    run = _Run(cls, gradients, probe=ndims is None)
    report = CheckReport("check_batch_norm", _subject_name(cls))
    run_dtypes = _dtypes(dtypes, (torch.float32, torch.float64))
    for nd in run.layouts(ndims, report):
        for dtype in run_dtypes:
            run.live = None
            for case in _BN_CASES:
                if dtype in case.dtypes and run.applies(case):
                    report.cases.append(run.case(case, nd, dtype))
    if raise_on_failure:
        report._raise_if_failed()
    return report
