"""Checker for GroupNorm: each sample's groups of consecutive channels."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .. import functional as _F
from ._cases import _CONSTANTS, _WHY, _constant_kappa, _constant_rows, _dtypes, _FnCase, _params, _randn, _run_fn_cases
from ._report import CheckReport, _dtype_name, _tensor_words

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
            kappa=_constant_kappa(_CONSTANTS, 1e-5))
        cl = _randn(gen, 2, 6, 4, 4, dtype=dt).contiguous(memory_format=torch.channels_last)
        add("channels_last input", cl, "N(0, 1) values", 3, w_="noncontig")
        add("eps = 0.1", _randn(gen, 2, 4, 5, dtype=dt), "N(0, 1) values", 2, eps=0.1, w_="eps")
        add("weight and bias None", _randn(gen, 2, 6, 5, dtype=dt), "N(0, 1) values", 3, weight=False, bias=False, w_="noaffine")

    def words(c):
        w, b = c.params["weight"], c.params["bias"]
        aff = "weight and bias" if w is not None and b is not None else "weight=None, bias=None"
        return f"fn(x, num_groups={c.middle[0]}, {aff} of shape ({c.x.shape[1]},), eps={c.eps:g}) with x a {_tensor_words(c.x, c.values)}"

    return _run_fn_cases("check_group_norm", fn, cases, _F.group_norm, words, gradients, raise_on_failure, gen)
