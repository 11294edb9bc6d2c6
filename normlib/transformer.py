"""A Transformer block with Pre-Norm or Post-Norm residual connections."""

from __future__ import annotations

import numbers
from typing import Literal

from torch import Tensor, nn

from ._checks import check_eps, check_positive_int
from .attention import MultiHeadAttention
from .normalization import LayerNorm, RMSNorm
from .errors import NormValueError, NormTypeError

__all__ = ["TransformerBlock"]


class TransformerBlock(nn.Module):
    r"""Self-attention and a feed-forward network, each in a residual branch.

    Pre-Norm (``norm_first=True``; GPT-2 and most models since, see Xiong et al. 2020):

    .. math:: x \leftarrow x + \mathrm{Attn}(\mathrm{Norm}_1(x)), \qquad
              x \leftarrow x + \mathrm{FFN}(\mathrm{Norm}_2(x))

    Post-Norm (``norm_first=False``; the original Transformer of Vaswani et al. 2017):

    .. math:: x \leftarrow \mathrm{Norm}_1(x + \mathrm{Attn}(x)), \qquad
              x \leftarrow \mathrm{Norm}_2(x + \mathrm{FFN}(x))

    Args:
        d_model: model width.
        n_head: attention heads; must divide ``d_model``.
        d_ff: hidden width of the feed-forward network (default ``4 * d_model``).
        norm_first: Pre-Norm (True) or Post-Norm (False).
        norm: ``"layer"`` for :class:`~normlib.LayerNorm`, ``"rms"`` for :class:`~normlib.RMSNorm`.
        dropout: dropout probability on each branch's output.
        eps: the norms' eps.
        attn_impl: ``"math"`` or ``"sdpa"``, see :class:`~normlib.MultiHeadAttention`.

    Shape:
        input ``(B, T, d_model)``; output the same.

    With ``norm_first=True`` on CUDA, the residual add after attention and
    ``norm2`` run as one call, ``norm2(branch, residual=x)`` (one fused kernel on GPU).

    Example:
        >>> import torch
        >>> block = TransformerBlock(32, 4, norm_first=False)
        >>> block(torch.randn(2, 7, 32)).shape
        torch.Size([2, 7, 32])
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        d_ff: int | None = None,
        norm_first: bool = True,
        norm: Literal["layer", "rms"] = "layer",
        dropout: float = 0.0,
        eps: float = 1e-5,
        device=None,
        dtype=None,
        *,
        attn_impl: Literal["math", "sdpa"] = "math",
    ) -> None:
        super().__init__()
        d_model = check_positive_int(d_model, "d_model")
        d_ff = 4 * d_model if d_ff is None else check_positive_int(d_ff, "d_ff")
        if norm not in ("layer", "rms"):
            raise NormValueError(f'norm must be "layer" or "rms" (got {norm!r})')
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
            raise NormTypeError(f"dropout must be a number in [0, 1) (got {type(dropout).__name__} {dropout!r})")
        if not 0.0 <= dropout < 1.0:
            raise NormValueError(f"dropout must be in [0, 1) (got {dropout})")
        if not isinstance(norm_first, bool):
            raise NormTypeError(f"norm_first must be a bool (got {type(norm_first).__name__} {norm_first!r})")
        eps = check_eps(eps)
        factory = {"device": device, "dtype": dtype}
        Norm = LayerNorm if norm == "layer" else RMSNorm
        self.norm_first: bool = norm_first
        self.norm: str = norm
        self.attn: MultiHeadAttention = MultiHeadAttention(d_model, n_head, impl=attn_impl, **factory)
        self.norm1: LayerNorm | RMSNorm = Norm(d_model, eps=eps, **factory)
        self.ff: nn.Sequential = nn.Sequential(
            nn.Linear(d_model, d_ff, **factory),
            nn.GELU(),
            nn.Linear(d_ff, d_model, **factory),
        )
        self.norm2: LayerNorm | RMSNorm = Norm(d_model, eps=eps, **factory)
        self.dropout: nn.Dropout = nn.Dropout(dropout)

    def _sa(self, x: Tensor, causal: bool) -> Tensor:
        return self.dropout(self.attn(x, x, x, causal=causal))

    def _ffn(self, x: Tensor) -> Tensor:
        return self.dropout(self.ff(x))

    def forward(self, x: Tensor, causal: bool = False) -> Tensor:
        """Apply the block to ``x`` ``(B, T, d_model)``; ``causal=True`` masks future positions."""
        if self.norm_first:
            y, x = self.norm2(self._sa(self.norm1(x), causal), residual=x)  # x + branch, and its norm
            return x + self._ffn(y)
        x = self.norm1(x + self._sa(x, causal))
        return self.norm2(x + self._ffn(x))

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, norm={self.norm!r}"
