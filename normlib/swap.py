"""Run a model's norm layers through normlib's fused kernels, in place, changing nothing else.

:func:`swap_norms` does not replace modules: it gives each recognised norm
module (see :mod:`normlib.interop`) a new ``forward`` on the instance, which
runs the fused kernels where they apply and the class's own ``forward``
everywhere else. The module object, its parameters (so their
``requires_grad``, sharing between modules and optimizer state), buffers,
hooks and ``state_dict`` are untouched. :func:`unswap_norms` removes the
instance ``forward`` again; swapping twice is a no-op.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from .interop import _UNKNOWN, KINDS, recognise

__all__ = ["swap_norms", "unswap_norms", "SwapReport"]

_ATTR = "_normlib_kind"


class _SwappedForward:
    """The ``forward`` of a swapped module: the fused kernels where they apply, the class's forward elsewhere.

    A plain object rather than a bound method, so that a swapped model can be
    pickled (``torch.save``) and deep-copied.
    """

    def __init__(self, module: nn.Module, kind: str):
        self.module = module
        self.kind = kind

    def __repr__(self) -> str:
        return f"<normlib fused forward ({self.kind}) of {type(self.module).__qualname__}>"

    def __call__(self, x, *args, **kwargs):
        if not args and not kwargs:
            y = KINDS[self.kind].fused(self.module, x)
            if y is not None:
                return y
        return type(self.module).forward(self.module, x, *args, **kwargs)


@dataclass
class SwapReport:
    """What :func:`swap_norms` did: swapped modules by class, and what it left alone and why."""

    swapped: Counter = field(default_factory=Counter)  # class name -> count
    kinds: dict = field(default_factory=dict)  # class name -> normlib kind(s), comma-separated
    already: Counter = field(default_factory=Counter)  # class name -> count swapped before
    left: dict = field(default_factory=dict)  # class name -> (count, reason)

    @property
    def count(self) -> int:
        """Modules that run through normlib now (swapped by this call or before)."""
        return sum(self.swapped.values()) + sum(self.already.values())

    def __str__(self) -> str:
        lines = [f"swap_norms: {sum(self.swapped.values())} norm module(s) swapped"
                 + (f", {sum(self.already.values())} already swapped" if self.already else "")]
        for name, n in sorted(self.swapped.items()):
            lines.append(f"  swapped  {n:4d} x {name} ({self.kinds[name]})")
        for name, n in sorted(self.already.items()):
            lines.append(f"  already  {n:4d} x {name}")
        for name, (n, why) in sorted(self.left.items()):
            lines.append(f"  left     {n:4d} x {name}: {why}")
        return "\n".join(lines)


def _looks_like_a_norm(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "norm" in name and not isinstance(module, nn.ModuleList)


def swap_norms(model: nn.Module, *, warn: bool = True) -> SwapReport:
    """Run every norm module of ``model`` that normlib recognises through its fused kernels, in place.

    Each recognised module keeps its class, parameters, buffers and hooks;
    only how its forward is computed changes: the fused kernels on CUDA
    tensors they cover, in the module's own rounding order
    (``normlib.interop``), and the class's own forward everywhere else
    (so on CPU the outputs are bit for bit the original's).
    Modules normlib does not recognise are left alone and listed in the
    report; with ``warn``, a model that has norm-like modules but none that
    could be swapped raises a ``UserWarning``. Undo with ``normlib.unswap_norms``.

    Args:
        model: any ``torch.nn.Module`` (a norm layer itself, or a model holding some).

    Returns:
        a ``normlib.SwapReport`` (``print`` it for a summary).

    Example:
        >>> enc = torch.nn.TransformerEncoderLayer(16, 4, batch_first=True)
        >>> swap_norms(enc).count
        2
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (got {type(model).__name__})")
    report = SwapReport()
    left = Counter()
    why = {}
    for module in model.modules():
        name = f"{type(module).__module__}.{type(module).__qualname__}"
        if getattr(module, _ATTR, None) is not None:
            report.already[name] += 1
            continue
        kind, reason = recognise(module)
        if kind is not None:
            module.forward = _SwappedForward(module, kind.name)
            setattr(module, _ATTR, kind.name)
            report.swapped[name] += 1
            kinds = set(report.kinds.get(name, "").split(", ")) - {""}
            report.kinds[name] = ", ".join(sorted(kinds | {kind.name}))
        elif not name.startswith("normlib.") and (_looks_like_a_norm(module) or reason != _UNKNOWN):
            left[name] += 1
            why[name] = reason
    report.left = {n: (c, why[n]) for n, c in left.items()}
    if warn and report.left and report.count == 0:
        warnings.warn(f"swap_norms swapped nothing in a model with norm-like modules:\n{report}", stacklevel=2)
    return report


def unswap_norms(model: nn.Module) -> int:
    """Undo :func:`swap_norms`: each swapped module runs its class's forward again. Returns how many."""
    n = 0
    for module in model.modules():
        if getattr(module, _ATTR, None) is not None:
            del module.forward
            delattr(module, _ATTR)
            n += 1
    return n
