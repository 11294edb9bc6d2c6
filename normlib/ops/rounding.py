"""Where a fused norm rounds: one named value instead of positional flags.

Libraries agree on what LayerNorm and RMSNorm compute but not on where the
values are rounded (see :mod:`normlib.interop`): Llama's RMSNorm casts x̂
back to the input's dtype before γ multiplies it, Gemma's multiplies by
``1 + γ``, T5's rounds x̂ to γ's dtype, DeBERTa-v1's returns the promoted
dtype of x, γ and β. A :class:`Rounding` names one such order; the kernels,
their autograd Function, the custom operator and the plain-PyTorch twins all
take it (the operator by its ``name``), so the order is decided
once, where a class is recognised.

Example:
    >>> LLAMA.out_dtype(torch.bfloat16, torch.ones(4))
    torch.float32
    >>> ROUNDINGS["gemma"] is GEMMA
    True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor
from ..errors import NormValueError

__all__ = ["Rounding", "TORCH", "FLOAT32_OUT", "LLAMA", "GEMMA", "T5", "T5_HALF", "DEBERTA", "ROUNDINGS", "round_xhat"]

_XHAT = ("acc", "input", "weight")
_OUT = ("input", "float32", "weight", "promote_weight", "promote_all")


@dataclass(frozen=True)
class Rounding:
    """One library's rounding order for ``y = x̂ · γ + β``.

    Attributes:
        name: the key in ``ROUNDINGS`` (what the custom operator receives).
        xhat: where x̂ is rounded before γ multiplies it: ``"acc"`` (kept in
            the accumulation dtype), ``"input"`` (to the input's dtype) or
            ``"weight"`` (to γ's dtype).
        weight_plus_one: multiply by ``1 + γ`` instead of γ (Gemma).
        product: round ``γ · x̂`` to the promoted dtype of γ and the input
            before β is added (DeBERTa's ``weight * x̂ + bias`` in PyTorch ops,
            two roundings where the others make one).
        out: the output's dtype: ``"input"``, ``"float32"``, ``"weight"``
            (γ's), ``"promote_weight"`` (of γ and the input) or
            ``"promote_all"`` (of γ, β and the input).
    """

    name: str
    xhat: str = "acc"
    weight_plus_one: bool = False
    out: str = "input"
    product: bool = False
    # the kernels' compile-time ROUND_XHAT: 0 (accumulation dtype), 1 (input's), 2 (γ's)
    xhat_code: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.xhat not in _XHAT:
            raise NormValueError(f"xhat must be one of {_XHAT} (got {self.xhat!r})")
        if self.out not in _OUT:
            raise NormValueError(f"out must be one of {_OUT} (got {self.out!r})")
        object.__setattr__(self, "xhat_code", _XHAT.index(self.xhat))

    def product_dtype(self, x_dtype: torch.dtype, weight: Optional[Tensor]) -> Optional[torch.dtype]:
        """The dtype ``γ · x̂`` is rounded to before β is added, or ``None`` where it is not rounded apart."""
        if not self.product or weight is None:
            return None
        return torch.promote_types(weight.dtype, x_dtype)

    def out_dtype(self, x_dtype: torch.dtype, weight: Optional[Tensor] = None,
                  bias: Optional[Tensor] = None) -> torch.dtype:
        """The output's dtype for input of ``x_dtype`` and these γ, β (a missing one counts as the input's)."""
        w = x_dtype if weight is None else weight.dtype
        bias_dtype = None if bias is None else bias.dtype
        if self.out == "input":
            return x_dtype
        if self.out == "float32":
            return torch.float32
        if self.out == "weight":
            return w
        out = torch.promote_types(w, x_dtype)
        return torch.promote_types(out, bias_dtype) if self.out == "promote_all" and bias_dtype is not None else out


TORCH = Rounding("torch")  # torch.nn's: x̂·γ + β in the accumulation dtype, one cast to the input's dtype
FLOAT32_OUT = Rounding("float32_out", out="float32")  # the same, returned in float32 (autocast's policy)
LLAMA = Rounding("llama", xhat="input", out="promote_weight")  # γ * x̂.to(input dtype)
GEMMA = Rounding("gemma", weight_plus_one=True)  # x̂ · (1 + γ) in float32, then one cast
T5 = Rounding("t5", out="weight")  # T5's with a float32/float64 γ: returned in γ's dtype
T5_HALF = Rounding("t5_half", xhat="weight", out="weight")  # with a float16/bfloat16 γ: x̂ rounded to it first
# x̂ cast to the input's dtype, then γ · x̂ and + β each rounded: torch ops on that dtype
DEBERTA = Rounding("deberta", xhat="input", out="promote_all", product=True)

ROUNDINGS: dict[str, Rounding] = {r.name: r for r in (TORCH, FLOAT32_OUT, LLAMA, GEMMA, T5, T5_HALF, DEBERTA)}


def round_xhat(xhat: Tensor, rounding: Rounding, x_dtype: torch.dtype, weight: Optional[Tensor]) -> Tensor:
    """``xhat`` rounded where ``rounding`` says, returned in its own dtype (the kernels' ``ROUND_XHAT`` in PyTorch ops)."""
    if rounding.xhat == "input":
        return xhat.to(x_dtype).to(xhat.dtype)
    if rounding.xhat == "weight" and weight is not None:
        return xhat.to(weight.dtype).to(xhat.dtype)
    return xhat
