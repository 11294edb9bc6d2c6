"""Checker for GroupNorm: each sample's groups of consecutive channels."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import functional as _F
from ._cases import (
    _CONSTANTS,
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

def _constant_groups(shape, dtype):
    """(N, C, L) input whose pairs of consecutive channels (the groups of 2) each hold one repeated value."""
    x = _constant_rows(shape, dtype)  # each (sample, channel) one value
    x[:, 1::2] = x[:, 0::2]
    return x


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
    (torch 2.13's own ``F.group_norm`` fails one case, "bias only (weight
    None)": on CPU its backward raises when β is given without γ.)

    Example:
        >>> from normlib import functional
        >>> check_group_norm(functional.group_norm).passed
        True
    """
    _check_options("check_group_norm", fn, gradients, raise_on_failure)
    gen = torch.Generator().manual_seed(2)
    whys = dict(_WHY)
    whys["basic"] = (
        "each (sample, group of consecutive channels) normalized over its channels and positions together, "
        "then γ and β per channel"
    )
    whys["g1"] = "num_groups=1: one group holds every channel (LayerNorm over (C, *))"
    whys["gC"] = "num_groups=C: one channel per group (InstanceNorm)"
    whys["noncontig"] = "a channels_last (non-contiguous) input: .view() fails on it, .reshape() works"
    whys["constant"] = "groups whose values are all equal: the variance is 0, the output must be β, and eps must keep it finite"
    cases = []
    for dt in _dtypes(dtypes):
        d = _dtype_name(dt)

        def add(name, x, values, G, weight=True, bias=True, eps=1e-5, why="basic", kappa=1.0):
            C = x.shape[1]
            w, b = _params(gen, (C,), dt, weight, bias)
            cases.append(_FnCase(f"{name}, {d}", x, values, {"weight": w, "bias": b}, (G,), eps, whys[why], kappa,
                                 (C,) + (1,) * (x.dim() - 2)))

        add("3-D input, 3 groups of 2 channels", _randn(gen, 2, 6, 5, dtype=dt), "N(0, 1) values", 3)
        add("4-D input, 2 groups of 3 channels", _randn(gen, 2, 6, 3, 4, dtype=dt, mean=1.0, std=2.0), "N(1, 2²) values", 2)
        if dt in _HALF:  # forward only: chapter 05d's mistakes, on 2 groups of 2 channels of 16 positions
            _low_precision_cases(lambda name, x, values, **kw: add(name, x, values, 2, **kw), gen, dt, (2, 4, 16),
                                 constant=_constant_groups, constant_words="every group one repeated value")
            continue
        add("1 group", _randn(gen, 3, 4, 7, dtype=dt), "N(0, 1) values", 1, why="g1")
        add("one channel per group", _randn(gen, 2, 4, 3, 3, dtype=dt), "N(0, 1) values", 4, why="gC")
        add("large offset", _randn(gen, 2, 4, 25, dtype=dt, mean=1e4), "1e4 + N(0, 1) values", 2, why="offset", kappa=1e4)
        add("constant groups", _constant_groups((2, 4, 8), dt), "every group one repeated value", 2, why="constant",
            kappa=_constant_kappa(_CONSTANTS, 1e-5))
        cl = _randn(gen, 2, 6, 4, 4, dtype=dt).contiguous(memory_format=torch.channels_last)
        add("channels_last input", cl, "N(0, 1) values", 3, why="noncontig")
        add("eps = 0.1", _randn(gen, 2, 4, 5, dtype=dt), "N(0, 1) values", 2, eps=0.1, why="eps")
        add("weight and bias None", _randn(gen, 2, 6, 5, dtype=dt), "N(0, 1) values", 3, weight=False, bias=False, why="noaffine")
        add("weight only (bias None)", _randn(gen, 2, 6, 5, dtype=dt), "N(0, 1) values", 3, bias=False, why="weightonly")
        add("bias only (weight None)", _randn(gen, 2, 6, 5, dtype=dt), "N(0, 1) values", 3, weight=False, why="biasonly")

    def words(c):
        w, b = c.params["weight"], c.params["bias"]
        aff = f"{'weight' if w is not None else 'weight=None'}, {'bias' if b is not None else 'bias=None'}"
        return f"fn(x, num_groups={c.middle[0]}, {aff} of shape ({c.x.shape[1]},), eps={c.eps:g}) with x a {_tensor_words(c.x, c.values)}"

    return _run_fn_cases("check_group_norm", fn, cases, _F.group_norm, words, gradients, raise_on_failure, gen)
