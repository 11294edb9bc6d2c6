"""Multi-head attention written out step by step (Vaswani et al., 2017).

This is the hand-written attention of the book's attention chapter, made
correct: masked scores are set to ``-inf`` (not a large negative number, which
leaks probability), and the causal mask is applied only when asked for.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import check_float_tensor, check_positive_int

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    r"""Multi-head scaled dot-product attention.

    .. math::
        \mathrm{head}_h = \mathrm{softmax}\!\left(\frac{Q_h K_h^\top}{\sqrt{d_k}} + M\right) V_h,
        \qquad \mathrm{out} = \mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_{n_h})\, W_o^\top + b_o

    where :math:`Q = q W_q^\top + b_q` (likewise K, V) is split into ``n_head``
    heads of ``d_k = d_model / n_head`` features, and ``M`` is 0 where
    attention is allowed and ``-inf`` where it is masked.

    Args:
        d_model: model width; the last dimension of ``q``, ``k``, ``v``.
        n_head: number of heads; must divide ``d_model``.
        bias: give the four projections a bias.
        impl: ``"math"`` (default) computes the scores, mask and softmax step by
            step as written above; ``"sdpa"`` hands the same computation to
            :func:`torch.nn.functional.scaled_dot_product_attention`, which
            never materialises the ``(T, S)`` score matrix (flash attention on
            GPUs) and gives the same result up to rounding.

    Shape:
        ``q``: ``(B, T, d_model)``; ``k``, ``v``: ``(B, S, d_model)``;
        output ``(B, T, d_model)``.

    Example:
        >>> attn = MultiHeadAttention(16, 4)
        >>> x = torch.randn(2, 5, 16)
        >>> attn(x, x, x, causal=True).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, d_model: int, n_head: int, bias: bool = True, device=None, dtype=None, *, impl: str = "math") -> None:
        super().__init__()
        if impl not in ("math", "sdpa"):
            raise ValueError(f'impl must be "math" or "sdpa" (got {impl!r})')
        self.impl = impl
        self.d_model = check_positive_int(d_model, "d_model")
        self.n_head = check_positive_int(n_head, "n_head")
        if d_model % n_head != 0:
            raise ValueError(
                f"d_model must be divisible by n_head (got d_model={d_model}, n_head={n_head})"
            )
        factory = {"device": device, "dtype": dtype}
        self.w_q = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.w_k = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.w_v = nn.Linear(d_model, d_model, bias=bias, **factory)
        self.w_o = nn.Linear(d_model, d_model, bias=bias, **factory)

    def _check(self, name: str, t: Tensor) -> None:
        check_float_tensor(t, name)
        if t.dim() != 3 or t.shape[-1] != self.d_model:
            raise ValueError(
                f"{name} must have shape (B, T, d_model={self.d_model}) "
                f"(got {list(t.shape)})"
            )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
        """Attend from the queries ``q`` ``(B, T, d_model)`` to keys ``k`` and values ``v`` ``(B, S, d_model)``.

        Self-attention passes the same tensor three times. With ``causal=True``
        query ``i`` sees keys ``0..i`` only (masked scores are ``-inf``).
        Returns ``(B, T, d_model)``.
        """
        for name, t in (("q", q), ("k", k), ("v", v)):
            self._check(name, t)
        if k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[0]:
            raise ValueError(
                f"q, k, v must share the batch size and k, v the length "
                f"(got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)})"
            )
        B, T, C = q.shape
        S = k.shape[1]
        nh, hs = self.n_head, C // self.n_head
        q = self.w_q(q).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.w_k(k).view(B, S, nh, hs).transpose(1, 2)  # (B, nh, S, hs)
        v = self.w_v(v).view(B, S, nh, hs).transpose(1, 2)  # (B, nh, S, hs)
        if self.impl == "sdpa":
            heads = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, nh, T, hs)
            return self.w_o(heads.transpose(1, 2).reshape(B, T, C))
        scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, nh, T, S)
        if causal:
            # query i may attend to keys 0..i (top-left aligned, as in
            # F.scaled_dot_product_attention(is_causal=True))
            allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # (B, nh, T, S)
        heads = weights @ v  # (B, nh, T, hs)
        out = heads.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.w_o(out)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_head={self.n_head}" + (", impl='sdpa'" if self.impl == "sdpa" else "")
