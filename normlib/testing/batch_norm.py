"""Checker for a BatchNorm module class: training steps, evaluation, running statistics."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import functional as _F
from ._cases import _WHY, _constant_kappa, _leaf, _params
from ._report import (
    CaseResult,
    CheckReport,
    _compare,
    _dtype_name,
    _exception_text,
    _Failed,
    _Skipped,
    _subject_name,
    _tensor_words,
    _tolerances,
)

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
        (atol, rtol), (gatol, grtol) = _tolerances(dtype, kappa)
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
                        kappa=lambda eps: _constant_kappa((3.25,), eps))

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
