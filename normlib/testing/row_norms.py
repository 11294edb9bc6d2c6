"""Checkers for the row norms: LayerNorm and RMSNorm over the trailing dimensions."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import functional as _F
from ._cases import (
    _CONSTANTS,
    _CONSTANTS_WORDS,
    _HALF,
    _WHY,
    _check_options,
    _constant_kappa,
    _constant_rows,
    _dtypes,
    _FnCase,
    _low_precision_cases,
    _params,
    _randn,
    _run_fn_cases,
)
from ._report import CheckReport, _dtype_name, _tensor_words

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
        dtypes: the dtypes to run (default float32, float64, bfloat16 and float16; the 16-bit ones forward only).
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
    _check_options("check_layer_norm", fn, gradients, raise_on_failure)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for dt in _dtypes(dtypes):
        d = _dtype_name(dt)

        def add(name, x, values, ns, weight=True, bias=True, eps=1e-5, why="basic", kappa=1.0):
            w, b = _params(gen, ns, dt, weight, bias)
            cases.append(_FnCase(f"{name}, {d}", x, values, {"weight": w, "bias": b}, (tuple(ns),), eps, _WHY[why],
                                 kappa, tuple(ns)))

        add("rows of 7", _randn(gen, 4, 7, dtype=dt), "N(0, 1) values", (7,))
        add("3-D input, rows of 33", _randn(gen, 2, 3, 33, dtype=dt, mean=1.0, std=2.0), "N(1, 2²) values", (33,))
        if dt in _HALF:  # forward only: chapter 05d's mistakes
            _low_precision_cases(lambda name, x, values, **kw: add(name, x, values, (64,), **kw), gen, dt, (8, 64))
            continue
        add("4-D input normalized over its last two dimensions", _randn(gen, 2, 3, 4, 5, dtype=dt), "N(0, 1) values", (4, 5), why="4d")
        one = _randn(gen, 5, 1, dtype=dt)  # a row of one value has spread 0: in effect sqrt(eps), as a constant row
        add("one element per row", one, "N(0, 1) values", (1,), why="one",
            kappa=_constant_kappa(one.abs().max().item(), 1e-5))
        add("a single row of 128", _randn(gen, 1, 128, dtype=dt, std=3.0), "N(0, 3²) values", (128,))
        add("large offset", _randn(gen, 8, 50, dtype=dt, mean=1e4), "1e4 + N(0, 1) values", (50,), why="offset", kappa=1e4)
        add("constant rows", _constant_rows((8, 16), dt), _CONSTANTS_WORDS, (16,), why="constant",
            kappa=_constant_kappa(_CONSTANTS, 1e-5))
        add("non-contiguous input", _randn(gen, 24, 3, 2, dtype=dt).permute(2, 1, 0), "N(0, 1) values (a permuted view)", (24,), why="noncontig")
        add("eps = 0.1", _randn(gen, 4, 9, dtype=dt), "N(0, 1) values", (9,), eps=0.1, why="eps")
        add("weight and bias None", _randn(gen, 3, 12, dtype=dt), "N(0, 1) values", (12,), weight=False, bias=False, why="noaffine")
        add("weight only (bias None)", _randn(gen, 3, 12, dtype=dt), "N(0, 1) values", (12,), bias=False, why="weightonly")
        add("bias only (weight None)", _randn(gen, 3, 12, dtype=dt), "N(0, 1) values", (12,), weight=False, why="biasonly")

    def words(c):
        w, b = c.params["weight"], c.params["bias"]
        aff = f"{'weight' if w is not None else 'weight=None'}, {'bias' if b is not None else 'bias=None'}"
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
    _check_options("check_rms_norm", fn, gradients, raise_on_failure)
    gen = torch.Generator().manual_seed(1)
    whys = dict(_WHY)
    whys["basic"] = "the formula itself: root of the mean of squares (no mean subtracted), eps inside the square root, then γ"
    whys["one"] = "a single element per row: the output is sign(x)·γ (up to eps)"
    whys["offset"] = "values far from zero with a small spread: nothing to subtract, the output is close to γ everywhere"
    whys["constant"] = "rows whose values are all equal, one of them all zeros: eps must keep 0 / 0 from happening"
    whys["noaffine"] = "weight may be None, as in torch.nn.functional.rms_norm"
    cases = []
    for dt in _dtypes(dtypes):
        d = _dtype_name(dt)

        def add(name, x, values, ns, weight=True, eps=1e-6, why="basic", kappa=1.0):
            w, _ = _params(gen, ns, dt, weight, False)
            cases.append(_FnCase(f"{name}, {d}", x, values, {"weight": w}, (tuple(ns),), eps, whys[why], kappa, tuple(ns)))

        add("rows of 7", _randn(gen, 4, 7, dtype=dt), "N(0, 1) values", (7,))
        add("3-D input, rows of 33", _randn(gen, 2, 3, 33, dtype=dt, mean=1.0, std=2.0), "N(1, 2²) values", (33,))
        if dt in _HALF:  # forward only: chapter 05d's mistakes
            _low_precision_cases(lambda name, x, values, **kw: add(name, x, values, (64,), **kw), gen, dt, (8, 64),
                                 offset=False)
            continue
        add("4-D input normalized over its last two dimensions", _randn(gen, 2, 3, 4, 5, dtype=dt), "N(0, 1) values", (4, 5), why="4d")
        add("one element per row", _randn(gen, 5, 1, dtype=dt), "N(0, 1) values", (1,), why="one")
        add("a single row of 128", _randn(gen, 1, 128, dtype=dt, std=3.0), "N(0, 3²) values", (128,))
        add("large offset", _randn(gen, 8, 50, dtype=dt, mean=1e4), "1e4 + N(0, 1) values", (50,), why="offset")
        add("constant rows", _constant_rows((8, 16), dt), _CONSTANTS_WORDS, (16,), why="constant")
        add("non-contiguous input", _randn(gen, 24, 3, 2, dtype=dt).permute(2, 1, 0), "N(0, 1) values (a permuted view)", (24,), why="noncontig")
        add("eps = 0.1", _randn(gen, 4, 9, dtype=dt), "N(0, 1) values", (9,), eps=0.1, why="eps")
        add("weight None", _randn(gen, 3, 12, dtype=dt), "N(0, 1) values", (12,), weight=False, why="noaffine")

    def words(c):
        aff = "weight" if c.params["weight"] is not None else "weight=None"
        return f"fn(x, normalized_shape={c.middle[0]}, {aff}, eps={c.eps:g}) with x a {_tensor_words(c.x, c.values)}"

    return _run_fn_cases("check_rms_norm", fn, cases, _F.rms_norm, words, gradients, raise_on_failure, gen)
