"""Multi-head attention written out step by step (Vaswani et al., 2017).

This is the hand-written attention of the book's attention chapter, made
correct and general: the causal mask is applied only when asked for, keys and
values may be longer or shorter than the queries, and padding and attention
masks follow :class:`torch.nn.MultiheadAttention`'s conventions. Masked scores
are set to ``-inf``, so a masked key gets exactly zero weight whatever the
scores; a query left with no key at all attends to nothing (its heads output
zeros) instead of producing NaN.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._autocast import autocast_enabled
from ._checks import check_float_tensor, check_positive_int
from .errors import NormValueError, NormTypeError

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    r"""Multi-head scaled dot-product attention.

    .. math::
        \mathrm{head}_h = \mathrm{softmax}\!\left(\frac{Q_h K_h^\top}{\sqrt{d_k}} + M\right) V_h,
        \qquad \mathrm{out} = \mathrm{Concat}(\mathrm{head}_1, \dots, \mathrm{head}_{n_h})\, W_o^\top + b_o

    where :math:`Q = q W_q^\top + b_q` (likewise K, V) is split into ``n_head``
    heads of ``d_k = d_model / n_head`` features, and ``M`` is the sum of the
    masks given to :meth:`forward`: 0 where attention is allowed, ``-inf``
    where it is not, or any additive float values.

    A query whose every key is masked (``-inf`` in all of its row of ``M``)
    attends to nothing: its heads output zeros, so the module outputs the bias
    ``b_o`` there, and no gradient flows from that row. This is what
    :func:`torch.nn.functional.scaled_dot_product_attention` gives on CPU and
    what :class:`torch.nn.MultiheadAttention` gives with ``need_weights=False``
    in training; ``need_weights=True`` and its inference fast path give NaN
    instead (checked with torch 2.13). A plain softmax of an all ``-inf`` row
    is NaN, and one NaN value row would reach every query of the next layer
    through ``0 * NaN``; ``normlib`` never lets it appear. Both ``impl``\ s
    handle such rows the same way.

    Args:
        d_model: model width; the last dimension of ``q``, ``k``, ``v``.
        n_head: number of heads; must divide ``d_model``.
        bias: give the four projections a bias.
        impl: ``"math"`` (default) computes the scores, mask and softmax step by
            step as written above; ``"sdpa"`` hands the same computation to
            :func:`torch.nn.functional.scaled_dot_product_attention`, which
            never materialises the ``(T, S)`` score matrix (flash attention on
            GPUs when no mask other than ``causal`` is given) and gives the
            same result up to rounding.

    Shape:
        ``q``: ``(B, T, d_model)``; ``k``, ``v``: ``(B, S, d_model)``;
        ``key_padding_mask``: ``(B, S)``; ``attn_mask``: ``(T, S)`` or
        ``(B * n_head, T, S)``; output ``(B, T, d_model)``.

    Example:
        >>> attn = MultiHeadAttention(16, 4)
        >>> x = torch.randn(2, 5, 16)
        >>> attn(x, x, x, causal=True).shape
        torch.Size([2, 5, 16])
        >>> pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])  # True = padding
        >>> attn(x, x, x, key_padding_mask=pad).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, d_model: int, n_head: int, bias: bool = True, device=None, dtype=None, *, impl: Literal["math", "sdpa"] = "math") -> None:
        super().__init__()
        if impl not in ("math", "sdpa"):
            raise NormValueError(f'impl must be "math" or "sdpa" (got {impl!r})')
        self.impl = impl
        self.d_model = check_positive_int(d_model, "d_model")
        self.n_head = check_positive_int(n_head, "n_head")
        if d_model % n_head != 0:
            raise NormValueError(
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
            raise NormValueError(
                f"{name} must have shape (B, T, d_model={self.d_model}) "
                f"(got {list(t.shape)})"
            )
        w = self.w_q.weight
        if t.device != w.device:
            raise NormValueError(f"{name} is on device {t.device} but the module's weights are on {w.device}")
        # The projections are matrix products: torch needs one dtype for both operands
        # (autocast casts them to a common one itself).
        if t.dtype != w.dtype and not autocast_enabled(t.device.type):
            raise NormTypeError(
                f"{name} has dtype {t.dtype} but the module's weights have dtype {w.dtype}; convert one of "
                f"them (module.to({t.dtype}) or {name}.to({w.dtype})), or run under torch.autocast"
            )

    def _mask(
        self,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        causal: bool,
        q: Tensor,
        B: int,
        T: int,
        S: int,
    ) -> Tensor | None:
        """All masks as one additive float mask ``(B or 1, nh or 1, T, S)``, or None."""
        if key_padding_mask is None and attn_mask is None and not causal:
            return None
        nh = self.n_head
        mask = torch.zeros(1, 1, T, S, dtype=q.dtype, device=q.device)
        if causal:
            # query i may attend to keys 0..i (top-left aligned, as in
            # F.scaled_dot_product_attention(is_causal=True))
            allowed = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
            mask = mask.masked_fill(~allowed, float("-inf"))
        if attn_mask is not None:
            _check_mask(attn_mask, "attn_mask", q, [(T, S), (B * nh, T, S)], "(T, S) or (B * n_head, T, S)")
            m = _additive(attn_mask, q.dtype)
            mask = mask + (m.view(1, 1, T, S) if m.dim() == 2 else m.view(B, nh, T, S))
        if key_padding_mask is not None:
            _check_mask(key_padding_mask, "key_padding_mask", q, [(B, S)], "(B, S)")
            mask = mask + _additive(key_padding_mask, q.dtype).view(B, 1, 1, S)
        return mask

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        causal: bool = False,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """Attend from the queries ``q`` ``(B, T, d_model)`` to keys ``k`` and values ``v`` ``(B, S, d_model)``.

        Self-attention passes the same tensor three times. The masks follow
        :class:`torch.nn.MultiheadAttention` (with ``batch_first=True``), and
        all of them may be combined:

        * ``causal=True``: query ``i`` sees keys ``0..i`` only.
        * ``key_padding_mask`` ``(B, S)``: ``True`` marks a key to ignore (a
          padding token) for every query of that sequence; a float mask is
          added to the scores instead.
        * ``attn_mask`` ``(T, S)``, or ``(B * n_head, T, S)`` with one mask per
          sequence and head (index ``b * n_head + h``): ``True`` marks a pair
          that may not attend; a float mask is added to the scores.

        A query left with no allowed key outputs ``w_o``'s bias (its heads
        are zero; see the class docstring). Returns ``(B, T, d_model)``.
        """
        if not isinstance(causal, bool):
            raise NormTypeError(
                f"causal must be a bool (got {type(causal).__name__}); pass masks by "
                f"keyword: key_padding_mask=..., attn_mask=..."
            )
        for name, t in (("q", q), ("k", k), ("v", v)):
            self._check(name, t)
        if k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[0]:
            raise NormValueError(
                f"q, k, v must share the batch size and k, v the length "
                f"(got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)})"
            )
        B, T, C = q.shape
        S = k.shape[1]
        nh, hs = self.n_head, C // self.n_head
        mask = self._mask(key_padding_mask, attn_mask, causal, q, B, T, S)  # (B|1, nh|1, T, S)
        q = self.w_q(q).view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.w_k(k).view(B, S, nh, hs).transpose(1, 2)  # (B, nh, S, hs)
        v = self.w_v(v).view(B, S, nh, hs).transpose(1, 2)  # (B, nh, S, hs)
        if mask is not None:
            # A query with no key left gets a neutral row here and zero weights
            # below. SDPA's backends disagree on rows that are all -inf (zeros from the
            # math and memory-efficient kernels, other values from cuDNN in bf16
            # on an H100, torch 2.11), so no backend is handed one.
            empty = torch.isneginf(mask).all(-1, keepdim=True)  # (B|1, nh|1, T, 1)
            mask = mask.masked_fill(empty, 0.0)
        if self.impl == "sdpa":
            if mask is None or (causal and key_padding_mask is None and attn_mask is None):
                heads = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # (B, nh, T, hs)
            else:
                heads = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
                heads = heads.masked_fill(empty, 0.0)
            return self.w_o(heads.transpose(1, 2).reshape(B, T, C))
        scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, nh, T, S)
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)  # (B, nh, T, S)
        if mask is not None:
            weights = weights.masked_fill(empty, 0.0)
        heads = weights @ v  # (B, nh, T, hs)
        out = heads.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.w_o(out)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_head={self.n_head}" + (", impl='sdpa'" if self.impl == "sdpa" else "")


def _check_mask(mask: object, name: str, q: Tensor, shapes: list[tuple[int, ...]], expected: str) -> None:
    """A mask must be a bool or float tensor of one of ``shapes``, on ``q``'s device."""
    if not isinstance(mask, torch.Tensor):
        raise NormTypeError(f"{name} must be a torch.Tensor (got {type(mask).__name__})")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise NormTypeError(
            f"{name} must be a bool tensor (True = may not attend) or a float tensor "
            f"added to the scores (got dtype {mask.dtype}); convert it first, e.g. "
            f"{name}.bool()"
        )
    if tuple(mask.shape) not in shapes:
        raise NormValueError(f"{name} must have shape {expected} = {' or '.join(str(list(s)) for s in shapes)} (got {list(mask.shape)})")
    if mask.device != q.device:
        raise NormValueError(f"{name} must be on the device of q ({q.device}), got {mask.device}")


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = may not attend) as 0 / -inf; a float mask as it is, in ``dtype``."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)
