r"""The math of normalization, written out in plain PyTorch, forward and backward.

Every function here has the signature and semantics of its namesake in
:mod:`torch.nn.functional`, and is written so that one line of code maps to
one line of the book's equations:

.. math::

    \mu = \frac{1}{n}\sum_i x_i, \qquad
    \sigma^2 = \frac{1}{n}\sum_i (x_i - \mu)^2, \qquad
    \hat x = (x - \mu)\,\mathrm{rstd}, \quad \mathrm{rstd} = \frac{1}{\sqrt{\sigma^2 + \epsilon}}, \qquad
    y = \gamma \odot \hat x + \beta .

Each op is a :class:`torch.autograd.Function` whose backward is the textbook
formula, public here as :func:`layer_norm_backward`, :func:`rms_norm_backward`,
:func:`batch_norm_backward` and :func:`group_norm_backward` (InstanceNorm is
GroupNorm with one channel per group). The forward saves only the input and
the per-slice statistics, as :mod:`torch.nn` does, and recomputes
:math:`\hat x` in the backward. For a second derivative (``create_graph=True``)
the backward recomputes the statistics from the input with differentiable ops,
so that autograd sees how they depend on it.

Numerics, the same for every op:

* Statistics are accumulated in float32 (float64 for float64 input); float16
  and bfloat16 inputs are computed in float32 and the result is cast back.
* The variance is the mean of squared deviations (two passes), never
  :math:`E[x^2] - E[x]^2`, which cancels catastrophically when the mean is
  large compared with the spread.
* Before the first pass each slice is shifted by one of its own elements
  (``x - x_0``). That changes nothing mathematically, but makes the centred
  values exact for a constant slice (the output is then exactly ``bias``)
  and loses no digits when every value sits far from zero.

Speed on CPU: every full-size tensor an op allocates costs more than the
arithmetic on it (the memory is fresh, page by page), so each op allocates one
output-sized buffer in the forward and works in place on it (``sub_``,
``mul_``, ``addcmul``); each backward allocates two.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from ._autocast import autocast_float32
from .numerics import (
    for_backward,
    acc_dtype as _acc_dtype,
    channel_view as _channel_view,
    numel as _numel,
    recentre as _recentre,
    safe_rstd as _rstd,
    shifted_moments as _moments,
    sum_of_squares as _sum_of_squares,
    update_running as _update_running,
)
from ._checks import (
    _shape_t,
    check_batch_norm_args,
    check_group_norm_args,
    check_instance_norm_args,
    check_layer_norm_args,
    check_rms_norm_args,
    check_channels,
    check_float_tensor,
    check_param,
    check_positive_int,
    check_same_device,
    check_trailing_shape,
    normalize_shape,
)
from .errors import NormValueError, NormTypeError

__all__ = [
    "layer_norm",
    "rms_norm",
    "batch_norm",
    "group_norm",
    "instance_norm",
    "moments",
    "layer_norm_backward",
    "rms_norm_backward",
    "batch_norm_backward",
    "group_norm_backward",
]


def _as(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return None if t is None else t.to(dtype)


def _fresh(y: Tensor, dtype: torch.dtype) -> Tensor:
    """``y`` in ``dtype`` as an autograd Function's differentiable output: never an alias of ``y``.

    In eager mode the forward computes in place on one buffer and may return it
    as it is (``y.to(y.dtype)`` is ``y`` itself). While ``torch.compile`` or
    ``torch.export`` traces the Function, an output that aliases a tensor made
    inside its forward is not safe: dynamo returns every intermediate of the
    traced forward beside the outputs, and torch 2.11's AOT autograd replaces
    the gradient of an output that aliases one of them with zeros (the
    compiled model then trains with zero gradients for its input, γ and β).
    So a traced call returns a copy, which the compiler fuses away.
    """
    if y.dtype != dtype:
        return y.to(dtype)  # a new tensor already
    return y.clone() if torch.compiler.is_compiling() else y


def _xhat_for_backward(xa: Tensor, dims: tuple[int, ...], shifted_mean: Tensor, rstd: Tensor,
                       eps: float) -> tuple[Tensor, Tensor]:
    """``(xhat, rstd)`` for a backward pass, from the up-cast input ``xa`` and the saved statistics.

    Rebuilt from ``shifted_mean`` and ``rstd`` (``keepdim``), bit for bit the
    forward's; under ``create_graph`` (a second derivative) from statistics
    recomputed as differentiable functions of ``xa`` instead.
    """
    if torch.is_grad_enabled():
        xc, _mean, _shifted, var = _moments(xa, dims)
        rstd = _rstd(xc, var, dims, eps)
        return xc * rstd, rstd
    return _recentre(xa, dims, shifted_mean).mul_(rstd), rstd


def moments(x: Tensor, dims: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    r"""Mean and biased variance of ``x`` over ``dims`` by two passes.

    Returns ``(xc, mean, var)`` with ``xc = x - mean`` (all with ``keepdim``),
    computed in ``x``'s dtype: call it on an already up-cast tensor.
    Differentiable.

    The first pass runs on ``x - x_0``, where ``x_0`` is the first element of
    each slice (detached: it cancels exactly in ``xc``), so a constant slice
    gives ``xc == 0`` exactly. The second pass sums the squares of the
    centred values, never :math:`E[x^2] - E[x]^2`.

    Example:
        >>> xc, mean, var = moments(torch.tensor([[1e6, 1e6 + 2]]), (-1,))
        >>> mean, var  # the variance within one rounding of 1 (see numerics.sum_of_squares)
        (tensor([[1000001.]]), tensor([[1.0000]]))
    """
    check_float_tensor(x, "x")
    dims = _check_dims(dims, x.dim())
    xc, mean, _, var = _moments(x, dims)
    return xc, mean, var


def _check_dims(dims: object, ndim: int) -> tuple[int, ...]:
    """Reduction dimensions as sorted non-negative ints, each in ``[-ndim, ndim)`` and given once."""
    if isinstance(dims, int) and not isinstance(dims, bool):
        dims = (dims,)
    try:
        given: tuple[object, ...] = tuple(dims)  # type: ignore[arg-type]  # any iterable; TypeError below otherwise
    except TypeError:
        raise NormTypeError(f"dims must be an int or a sequence of ints (got {type(dims).__name__})") from None
    if not given:
        raise NormValueError("dims must name at least one dimension (got an empty sequence)")
    out = []
    for d in given:
        if isinstance(d, bool) or not isinstance(d, int):
            raise NormTypeError(f"dims must hold ints (got {d!r} of type {type(d).__name__})")
        if not -ndim <= d < ndim:
            raise IndexError(f"dims: dimension {d} is out of range for a {ndim}-D tensor (expected {-ndim} to {ndim - 1})")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise NormValueError(f"dims must not repeat a dimension (got {list(given)} for a {ndim}-D tensor)")
    return tuple(sorted(out))


def _in_place() -> bool:
    """Whether this call may write into its own buffers with ``weight``/``bias`` operands.

    Not under ``torch.func`` transforms: ``vmap`` over the parameters (an
    ensemble built with ``stack_module_state``) makes ``weight`` batched while
    the buffer computed from an unbatched input is not, and vmap cannot write
    a batched value into an unbatched tensor. Those calls compute out of place.
    """
    return not torch._C._are_functorch_transforms_active()


def _mul_(a: Tensor, b: Tensor) -> Tensor:
    """``a * b``, into ``a`` when :func:`_in_place` allows it."""
    return a.mul_(b) if _in_place() else a * b


def _affine_(y: Tensor, weight: Optional[Tensor], bias: Optional[Tensor]) -> Tensor:
    """``y ⊙ weight + bias``, in place where :func:`_in_place` allows (either may be ``None``)."""
    if weight is not None:
        y = _mul_(y, weight)
    if bias is not None:
        y = y.add_(bias) if _in_place() else y + bias
    return y


# ---------------------------------------------------------------------------
# The public backward functions check their arguments; the autograd Functions
# call the unchecked math (``f.__wrapped__``), whose arguments they built.
# ---------------------------------------------------------------------------


def _checked(check):
    """Decorate a public backward function with ``check(*args, **kwargs)``; ``__wrapped__`` skips it."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            check(*args, **kwargs)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def _check_same(name_a: str, a: object, name_b: str, b: object) -> None:
    ta = check_float_tensor(a, name_a)
    tb = check_float_tensor(b, name_b)
    if ta.shape != tb.shape:
        raise NormValueError(f"{name_b} must have the shape of {name_a} {list(ta.shape)} (got {list(tb.shape)})")
    check_same_device(ta, **{name_b: tb})


def _check_row_norm_backward(dy, xhat, stat, normalized_shape, weight=None, *, stat_name="rstd", x_name="xhat"):
    _check_same("dy", dy, x_name, xhat)
    shape = normalize_shape(normalized_shape)
    check_trailing_shape(dy, shape)
    check_float_tensor(stat, stat_name)
    want = tuple(dy.shape[: dy.dim() - len(shape)]) + (1,) * len(shape)
    if tuple(stat.shape) != want:
        raise NormValueError(f"{stat_name} must have shape {list(want)}, one value per row with keepdim (got {list(stat.shape)})")
    check_same_device(dy, **{stat_name: stat})
    check_param(weight, "weight", shape, dy)


def _check_rms_norm_backward(dy, x, rrms, normalized_shape, weight=None):
    _check_row_norm_backward(dy, x, rrms, normalized_shape, weight, stat_name="rrms", x_name="x")


def _check_batch_norm_backward(dy, xhat, rstd, weight=None, training=True):
    _check_same("dy", dy, "xhat", xhat)
    C = check_channels(dy, "batch_norm_backward")
    check_param(rstd, "rstd", (C,), dy)
    check_param(weight, "weight", (C,), dy)
    if not isinstance(training, bool):
        raise NormTypeError(f"training must be a bool (got {type(training).__name__})")


def _check_group_norm_backward(dy, xhat, rstd, num_groups, weight=None):
    _check_same("dy", dy, "xhat", xhat)
    C = check_channels(dy, "group_norm_backward")
    G = check_positive_int(num_groups, "num_groups")
    if C % G:
        raise NormValueError(f"num_groups must divide the number of channels (got num_groups={G} for {C} channels)")
    check_float_tensor(rstd, "rstd")
    if rstd.numel() != dy.shape[0] * G:
        raise NormValueError(f"rstd must hold N * num_groups = {dy.shape[0] * G} values (got shape {list(rstd.shape)})")
    check_same_device(dy, rstd=rstd)
    check_param(weight, "weight", (C,), dy)


def _pick(
    plain: type[torch.autograd.Function], with_jvp: type[torch.autograd.Function]
) -> type[torch.autograd.Function]:
    """The op's autograd Function: with its ``jvp`` where forward-mode AD may reach it.

    Forward-mode AD (``torch.autograd.forward_ad``, ``torch.func.jvp``,
    ``jacfwd``, ``hessian``) needs the Function's ``jvp``; ``torch.compile``
    cannot trace a Function that has one. So the ``jvp`` lives in a subclass,
    used inside a dual level or a ``torch.func`` transform.
    """
    forward_ad = torch.autograd.forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active()
    return with_jvp if forward_ad else plain


# ---------------------------------------------------------------------------
# Forward-mode derivatives (torch.func.jvp, jacfwd, hessian, forward_ad)
# ---------------------------------------------------------------------------


def _xhat_tangent(xhat: Tensor, tx: Tensor, rstd: Tensor, dims: tuple[int, ...], centre: bool = True) -> Tensor:
    r"""Directional derivative of :math:`\hat x` along ``tx``, in the compute dtype.

    With :math:`\hat x = (x - \mu)\,\mathrm{rstd}` and
    :math:`d\,\mathrm{rstd} = -\mathrm{rstd}^2 \cdot \overline{\hat x\, dx_c}`:

    .. math:: d\hat x = \mathrm{rstd}\,\big(dx_c - \hat x\,\overline{\hat x\, dx_c}\big),
              \qquad dx_c = dx - \overline{dx},

    the forward-mode twin of the backward's :math:`\hat g - c_1 - \hat x c_2`.
    RMSNorm (``centre=False``) subtracts no mean.
    """
    if centre:
        tx = tx - tx.mean(dims, keepdim=True)
    return (tx - xhat * (xhat * tx).mean(dims, keepdim=True)) * rstd


def _affine_tangent(xhat: Tensor, dxhat: Optional[Tensor], weight: Optional[Tensor], tw: Optional[Tensor],
                    tb: Optional[Tensor], view=lambda t: t) -> Tensor:
    """Tangent of ``y = γ ⊙ x̂ + β`` from those of x̂, γ and β (``None``: no tangent)."""
    ty = torch.zeros_like(xhat)
    if dxhat is not None:
        ty = ty + (dxhat if weight is None else dxhat * view(weight.to(xhat.dtype)))
    if tw is not None:
        ty = ty + xhat * view(tw.to(xhat.dtype))
    if tb is not None:
        ty = ty + view(tb.to(xhat.dtype))
    return ty


# ---------------------------------------------------------------------------
# LayerNorm
# ---------------------------------------------------------------------------


@_checked(_check_row_norm_backward)
def layer_norm_backward(
    dy: Tensor,
    xhat: Tensor,
    rstd: Tensor,
    normalized_shape: _shape_t,
    weight: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor], Tensor]:
    r"""Gradients of :func:`layer_norm`, the textbook formula.

    With :math:`\hat g = \gamma \odot \partial L/\partial y` (the gradient
    reaching :math:`\hat x`), per row of ``n`` elements

    .. math::

        c_1 = \tfrac1n \textstyle\sum_i \hat g_i, \qquad
        c_2 = \tfrac1n \textstyle\sum_i \hat g_i \hat x_i, \qquad
        \frac{\partial L}{\partial x} = \mathrm{rstd}\,(\hat g - c_1 - \hat x\, c_2),

    and, summed over the rows, :math:`\partial L/\partial\gamma = \sum dy \odot \hat x`,
    :math:`\partial L/\partial\beta = \sum dy`.

    Args:
        dy: upstream gradient ``(*, *normalized_shape)``, in the compute dtype.
        xhat: the normalized input :math:`\hat x`, same shape.
        rstd: :math:`1/\sqrt{\sigma^2+\epsilon}` per row, ``(*, 1, ..., 1)`` (``keepdim``).
        normalized_shape: the trailing dimensions that were normalized.
        weight: γ of shape ``normalized_shape``, or ``None``.

    Returns:
        ``(dx, dweight, dbias)``: ``dx`` like ``dy``; ``dweight`` (``None``
        without ``weight``) and ``dbias`` of shape ``normalized_shape``.

    Differentiable (its in-place ops act on its own buffer), so a second
    derivative can run through it.

    Example:
        >>> xhat = torch.tensor([[-1., 1.]]); dy = torch.tensor([[1., 0.]])
        >>> layer_norm_backward(dy, xhat, torch.tensor([[1.]]), (2,))[0]
        tensor([[0., 0.]])
    """
    k = len(normalize_shape(normalized_shape))
    dims = tuple(range(-k, 0))  # one row
    rows = tuple(range(dy.dim() - k))  # γ and β are shared by every row
    dbias = dy.sum(rows)
    dy_xhat = dy * xhat  # the one full-size buffer this function allocates
    dweight = dy_xhat.sum(rows) if weight is not None else None
    if weight is not None:
        dy_xhat = _mul_(dy_xhat, weight)  # ĝ ⊙ x̂ = γ ⊙ dy ⊙ x̂
    c2 = dy_xhat.mean(dims, keepdim=True)
    if _in_place():
        ghat = dy_xhat.copy_(dy)  # the buffer is free again: ĝ = γ ⊙ dy goes in it
        if weight is not None:
            ghat.mul_(weight)
        c1 = ghat.mean(dims, keepdim=True)
        return ghat.sub_(c1).addcmul_(xhat, c2, value=-1).mul_(rstd), dweight, dbias  # rstd · (ĝ − c1 − x̂ c2)
    ghat = dy if weight is None else dy * weight
    c1 = ghat.mean(dims, keepdim=True)
    return (ghat - c1 - xhat * c2) * rstd, dweight, dbias



class _LayerNorm(torch.autograd.Function):
    """``y = γ ⊙ x̂ + β``; saves ``x`` and the row statistics; backward: :func:`layer_norm_backward`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, shape, weight, bias, eps):
        acc = _acc_dtype(x.dtype)
        dims = tuple(range(x.dim() - len(shape), x.dim()))
        xhat, _, shifted_mean, var = _moments(x.to(acc), dims)  # xhat holds x − μ for now
        rstd = _rstd(xhat, var, dims, eps)
        y = _affine_(xhat.mul_(rstd), _as(weight, acc), _as(bias, acc))  # in place
        return _fresh(y, x.dtype), shifted_mean, rstd

    @staticmethod
    def _saved(inputs, output) -> tuple:
        """What the backward (and the jvp) needs: the input, γ and the statistics."""
        x, shape, weight, bias, eps = inputs
        _, shifted_mean, rstd = output
        return (x, weight, shifted_mean, rstd)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, shape, weight, bias, eps = inputs
        _, shifted_mean, rstd = output
        ctx.mark_non_differentiable(shifted_mean, rstd)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*for_backward(*_LayerNorm._saved(inputs, output)))
        ctx.shape, ctx.eps = shape, eps
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, dy, *_):
        x, weight, shifted_mean, rstd = ctx.saved_tensors
        if dy is None:
            return (None,) * 5
        acc = _acc_dtype(x.dtype)
        dims = tuple(range(x.dim() - len(ctx.shape), x.dim()))
        xhat, rstd = _xhat_for_backward(x.to(acc), dims, shifted_mean, rstd, ctx.eps)
        dx, dweight, dbias = layer_norm_backward.__wrapped__(dy.to(acc), xhat, rstd, ctx.shape, _as(weight, acc))
        need = ctx.needs_input_grad
        return (
            dx.to(x.dtype) if need[0] else None,
            None,
            dweight.to(weight.dtype) if need[2] else None,
            dbias.to(ctx.bias_dtype) if need[3] else None,
            None,
        )


class _LayerNormJvp(_LayerNorm):
    """_LayerNorm with its forward-mode derivative, for ``torch.func.jvp``/``jacfwd``/``hessian`` and ``forward_ad``.

    A class apart because ``torch.compile`` cannot trace a Function that defines ``jvp``.
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        _LayerNorm.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*_LayerNorm._saved(inputs, output))

    @staticmethod
    def jvp(ctx, tx, _shape, tw, tb, _eps):
        x, weight, shifted_mean, rstd = ctx.saved_tensors
        acc = _acc_dtype(x.dtype)
        dims = tuple(range(x.dim() - len(ctx.shape), x.dim()))
        xhat = _recentre(x.to(acc), dims, shifted_mean) * rstd
        dxhat = None if tx is None else _xhat_tangent(xhat, tx.to(acc), rstd, dims)
        return _affine_tangent(xhat, dxhat, weight, tw, tb).to(x.dtype), None, None


def layer_norm(
    input: Tensor,
    normalized_shape: _shape_t,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Layer normalization over the last ``len(normalized_shape)`` dimensions.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta

    with the biased variance (divide by ``n``), as in Ba et al. (2016) and
    :func:`torch.nn.functional.layer_norm`. Gradients: :func:`layer_norm_backward`.

    Args:
        input: floating-point tensor ``(*, *normalized_shape)``.
        normalized_shape: the trailing dimensions to normalize over.
        weight: optional γ of shape ``normalized_shape``.
        bias: optional β of shape ``normalized_shape``.
        eps: added to the variance, ``>= 0``.

    Shape:
        output has the shape and dtype of ``input``.

    Example:
        >>> layer_norm(torch.tensor([[1., 3.], [5., 7.]]), (2,), eps=0.0)
        tensor([[-1.0000,  1.0000],
                [-1.0000,  1.0000]])
    """
    ctx, input, weight, bias = autocast_float32("layer_norm", input, weight, bias)
    shape, eps = check_layer_norm_args(input, normalized_shape, weight, bias, eps)
    with ctx:
        return _layer_norm(input, shape, weight, bias, eps)


def _layer_norm(input: Tensor, shape: tuple[int, ...], weight: Optional[Tensor], bias: Optional[Tensor],
                eps: float) -> Tensor:
    """:func:`layer_norm` on checked arguments (what :mod:`normlib.ops` runs as the reference)."""
    return _pick(_LayerNorm, _LayerNormJvp).apply(input, shape, weight, bias, eps)[0]


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------


def _rrms(x: Tensor, dims: tuple[int, ...], eps: float) -> Tensor:
    """``1 / sqrt(mean(x²) + eps)`` over ``dims`` (``keepdim``), right also where ``x²`` overflows."""
    return _rstd(x, _sum_of_squares(x, dims) / _numel(x, dims), dims, eps)


@_checked(_check_rms_norm_backward)
def rms_norm_backward(
    dy: Tensor,
    x: Tensor,
    rrms: Tensor,
    normalized_shape: _shape_t,
    weight: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor]]:
    r"""Gradients of :func:`rms_norm`: LayerNorm's formula without the mean.

    With :math:`\hat x = x\,\mathrm{rrms}`, :math:`\mathrm{rrms} = 1/\sqrt{\overline{x^2}+\epsilon}`
    and :math:`\hat g = \gamma \odot \partial L/\partial y`, per row of ``n`` elements

    .. math::

        c_2 = \tfrac1n \textstyle\sum_i \hat g_i \hat x_i, \qquad
        \frac{\partial L}{\partial x} = \mathrm{rrms}\,(\hat g - \hat x\, c_2),

    and :math:`\partial L/\partial\gamma = \sum dy \odot \hat x` over the rows.
    There is no :math:`c_1`: RMSNorm does not subtract the mean. Since
    :math:`\hat x` is just ``x`` scaled per row, the formula takes ``x`` and
    folds ``rrms`` into the per-row factors instead of storing :math:`\hat x`.

    Args:
        dy: upstream gradient ``(*, *normalized_shape)``, in the compute dtype.
        x: the input, same shape (any float dtype).
        rrms: per row, ``(*, 1, ..., 1)`` (``keepdim``), in the compute dtype.
        normalized_shape: the trailing dimensions that were normalized.
        weight: γ of shape ``normalized_shape``, or ``None``.

    Returns:
        ``(dx, dweight)`` (RMSNorm has no bias); ``dweight`` is ``None`` without ``weight``.
    """
    k = len(normalize_shape(normalized_shape))
    dims = tuple(range(-k, 0))  # one row
    rows = tuple(range(dy.dim() - k))  # γ is shared by every row
    dy_xhat = (dy * x).mul_(rrms)  # dy ⊙ x̂: the one full-size buffer this function allocates
    dweight = dy_xhat.sum(rows) if weight is not None else None
    if weight is not None:
        dy_xhat = _mul_(dy_xhat, weight)  # ĝ ⊙ x̂
    c2 = dy_xhat.mean(dims, keepdim=True)
    if _in_place():
        ghat = dy_xhat.copy_(dy)  # the buffer is free again: ĝ = γ ⊙ dy goes in it
        if weight is not None:
            ghat.mul_(weight)
        return ghat.addcmul_(x, rrms * c2, value=-1).mul_(rrms), dweight  # rrms · (ĝ − x̂ c2)
    ghat = dy if weight is None else dy * weight
    return (ghat - x * (rrms * c2)) * rrms, dweight


class _RMSNorm(torch.autograd.Function):
    """``y = γ ⊙ x · rrms``; saves ``x`` and ``rrms``; backward: :func:`rms_norm_backward`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, shape, weight, eps):
        acc = _acc_dtype(x.dtype)
        dims = tuple(range(x.dim() - len(shape), x.dim()))
        xa = x.to(acc)
        rrms = _rrms(xa, dims, eps)
        y = _affine_(xa * rrms, _as(weight, acc), None)  # x̂, then γ ⊙ x̂ in place
        return _fresh(y, x.dtype), rrms

    @staticmethod
    def _saved(inputs, output) -> tuple:
        """What the backward (and the jvp) needs: the input, γ and the statistics."""
        x, shape, weight, eps = inputs
        _, rrms = output
        return (x, weight, rrms)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, shape, weight, eps = inputs
        _, rrms = output
        ctx.mark_non_differentiable(rrms)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*for_backward(*_RMSNorm._saved(inputs, output)))
        ctx.shape, ctx.eps = shape, eps

    @staticmethod
    def backward(ctx, dy, _):
        x, weight, rrms = ctx.saved_tensors
        if dy is None:
            return (None,) * 4
        acc = _acc_dtype(x.dtype)
        if torch.is_grad_enabled():  # create_graph: rrms as a differentiable function of x
            rrms = _rrms(x.to(acc), tuple(range(x.dim() - len(ctx.shape), x.dim())), ctx.eps)
        dx, dweight = rms_norm_backward.__wrapped__(dy.to(acc), x, rrms, ctx.shape, _as(weight, acc))
        need = ctx.needs_input_grad
        return (
            dx.to(x.dtype) if need[0] else None,
            None,
            dweight.to(weight.dtype) if need[2] else None,
            None,
        )


class _RMSNormJvp(_RMSNorm):
    """_RMSNorm with its forward-mode derivative, for ``torch.func.jvp``/``jacfwd``/``hessian`` and ``forward_ad``.

    A class apart because ``torch.compile`` cannot trace a Function that defines ``jvp``.
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        _RMSNorm.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*_RMSNorm._saved(inputs, output))

    @staticmethod
    def jvp(ctx, tx, _shape, tw, _eps):
        x, weight, rrms = ctx.saved_tensors
        acc = _acc_dtype(x.dtype)
        dims = tuple(range(x.dim() - len(ctx.shape), x.dim()))
        xhat = x.to(acc) * rrms
        dxhat = None if tx is None else _xhat_tangent(xhat, tx.to(acc), rrms, dims, centre=False)
        return _affine_tangent(xhat, dxhat, weight, tw, None).to(x.dtype), None


def rms_norm(
    input: Tensor,
    normalized_shape: _shape_t,
    weight: Optional[Tensor] = None,
    eps: Optional[float] = None,
) -> Tensor:
    r"""Root-mean-square normalization (Zhang & Sennrich, 2019), per sample.

    .. math:: y = \frac{x}{\sqrt{\frac{1}{n}\sum_i x_i^2 + \epsilon}} \odot \gamma

    No mean is subtracted and there is no bias. The mean of squares is
    accumulated in float32, so float16 input with ``|x|`` in the hundreds does
    not overflow (``300**2`` exceeds float16's maximum of 65504).
    Gradients: :func:`rms_norm_backward`.

    Args:
        input: floating-point tensor ``(*, *normalized_shape)``.
        normalized_shape: the trailing dimensions to normalize over.
        weight: optional γ of shape ``normalized_shape``.
        eps: added to the mean square; ``None`` means the machine epsilon of
            the dtype the statistics are computed in: ``torch.finfo(torch.float32).eps``
            for float16/bfloat16/float32 input, float64's for float64. This is
            what :func:`torch.nn.functional.rms_norm` does (its documentation
            says ``finfo(input.dtype)``; its code uses the compute dtype).

    Example:
        >>> rms_norm(torch.tensor([[3., 4.]]), 2, eps=0.0)
        tensor([[0.8485, 1.1314]])
    """
    ctx, input, weight = autocast_float32("rms_norm", input, weight)
    shape, eps = check_rms_norm_args(input, normalized_shape, weight, eps)
    with ctx:
        return _rms_norm(input, shape, weight, eps)


def _rms_norm(input: Tensor, shape: tuple[int, ...], weight: Optional[Tensor], eps: float) -> Tensor:
    """:func:`rms_norm` on checked arguments (``eps`` resolved)."""
    return _pick(_RMSNorm, _RMSNormJvp).apply(input, shape, weight, eps)[0]


# ---------------------------------------------------------------------------
# BatchNorm
# ---------------------------------------------------------------------------


@_checked(_check_batch_norm_backward)
def batch_norm_backward(
    dy: Tensor,
    xhat: Tensor,
    rstd: Tensor,
    weight: Optional[Tensor] = None,
    training: bool = True,
) -> tuple[Tensor, Optional[Tensor], Tensor]:
    r"""Gradients of :func:`batch_norm`, the textbook formula.

    Per channel, over the ``n`` values (every sample, every position) that
    share its statistics,

    .. math::

        \frac{\partial L}{\partial\beta} = \sum dy, \qquad
        \frac{\partial L}{\partial\gamma} = \sum dy \odot \hat x, \qquad
        \frac{\partial L}{\partial x} = \gamma\,\mathrm{rstd}\,\Big(dy - c_1 - \hat x\, c_2\Big)
        \quad\text{with}\quad c_1 = \tfrac1n\tfrac{\partial L}{\partial\beta},\;
        c_2 = \tfrac1n\tfrac{\partial L}{\partial\gamma} .

    In training the batch statistics couple the samples: the two subtracted
    terms carry every sample's gradient into every other's. In evaluation
    (``training=False``) the running statistics are constants, and
    :math:`\partial L/\partial x = \gamma\,\mathrm{rstd}\,dy`. γ is constant
    over a channel's values, so it factors out: ``c1`` and ``c2`` are simply
    the parameter gradients divided by ``n``.

    Args:
        dy: upstream gradient ``(N, C, *)``, in the compute dtype.
        xhat: :math:`\hat x`, same shape.
        rstd: ``(C,)``, from the batch (training) or the running variance.
        weight: γ ``(C,)`` or ``None``.
        training: whether the statistics came from this batch.

    Returns:
        ``(dx, dweight, dbias)``; ``dweight`` is ``None`` without ``weight``.
    """
    dims = (0,) + tuple(range(2, dy.dim()))  # everything but the channel
    view = lambda t: _channel_view(t, dy.dim())  # noqa: E731  (C,) -> (1, C, 1, ...)
    n = _numel(dy, dims)
    dbias = dy.sum(dims)
    dy_xhat = dy * xhat  # the one full-size buffer this function allocates
    dweight = dy_xhat.sum(dims)
    scale = rstd if weight is None else rstd * weight  # γ · rstd per channel
    if _in_place():
        dx = dy_xhat.copy_(dy)
        if training:
            c1, c2 = dbias / n, dweight / n  # mean(dy), mean(dy ⊙ x̂) per channel
            dx.sub_(view(c1)).addcmul_(xhat, view(c2), value=-1)
        dx.mul_(view(scale))
    else:
        dx = dy - view(dbias / n) - xhat * view(dweight / n) if training else dy
        dx = dx * view(scale)
    return dx, (dweight if weight is not None else None), dbias


def _bn_dims(x: Tensor) -> tuple[int, ...]:
    return (0,) + tuple(range(2, x.dim()))


def _bn_affine_(xc: Tensor, scale: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``xc · scale + β`` per channel, in place (``scale = γ · rstd``)."""
    view = lambda t: _channel_view(t, xc.dim())  # noqa: E731
    return _affine_(xc, view(scale), None if bias is None else view(bias))


class _BatchNormTrain(torch.autograd.Function):
    """BatchNorm with the batch's statistics; backward: :func:`batch_norm_backward`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, eps):
        acc = _acc_dtype(x.dtype)
        C = x.shape[1]
        xc, mean, shifted_mean, var = _moments(x.to(acc), _bn_dims(x))
        rstd = _rstd(xc, var, _bn_dims(x), eps).reshape(C)
        scale = rstd if weight is None else rstd * weight.to(acc)  # γ · rstd
        y = _bn_affine_(xc, scale, _as(bias, acc))  # (x − μ) · γ · rstd + β, in place
        return _fresh(y, x.dtype), mean.reshape(C), var.reshape(C), shifted_mean, rstd

    @staticmethod
    def _saved(inputs, output) -> tuple:
        """What the backward (and the jvp) needs: the input, γ and the statistics."""
        x, weight, bias, eps = inputs
        _, mean, var, shifted_mean, rstd = output
        return (x, weight, shifted_mean, rstd)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, eps = inputs
        _, mean, var, shifted_mean, rstd = output
        ctx.mark_non_differentiable(mean, var, shifted_mean, rstd)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*for_backward(*_BatchNormTrain._saved(inputs, output)))
        ctx.eps = eps
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, dy, *_):
        x, weight, shifted_mean, rstd = ctx.saved_tensors
        if dy is None:
            return (None,) * 4
        acc = _acc_dtype(x.dtype)
        dims = _bn_dims(x)
        xhat, rstd = _xhat_for_backward(x.to(acc), dims, shifted_mean, _channel_view(rstd, x.dim()), ctx.eps)
        rstd = rstd.reshape(-1)  # (C,)
        dx, dweight, dbias = batch_norm_backward.__wrapped__(dy.to(acc), xhat, rstd, _as(weight, acc), training=True)
        need = ctx.needs_input_grad
        return (
            dx.to(x.dtype) if need[0] else None,
            dweight.to(weight.dtype) if need[1] else None,
            dbias.to(ctx.bias_dtype) if need[2] else None,
            None,
        )


class _BatchNormTrainJvp(_BatchNormTrain):
    """_BatchNormTrain with its forward-mode derivative, for ``torch.func.jvp``/``jacfwd``/``hessian`` and ``forward_ad``.

    A class apart because ``torch.compile`` cannot trace a Function that defines ``jvp``.
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        _BatchNormTrain.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*_BatchNormTrain._saved(inputs, output))

    @staticmethod
    def jvp(ctx, tx, tw, tb, _eps):
        x, weight, shifted_mean, rstd = ctx.saved_tensors
        acc = _acc_dtype(x.dtype)
        dims = _bn_dims(x)
        view = lambda t: _channel_view(t, x.dim())  # noqa: E731
        xhat = _recentre(x.to(acc), dims, shifted_mean) * view(rstd)
        dxhat = None if tx is None else _xhat_tangent(xhat, tx.to(acc), view(rstd), dims)
        return _affine_tangent(xhat, dxhat, weight, tw, tb, view).to(x.dtype), None, None, None, None


class _BatchNormEval(torch.autograd.Function):
    """BatchNorm with the running statistics; backward: :func:`batch_norm_backward` (``training=False``)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, running_mean, running_var, weight, bias, eps):
        acc = _acc_dtype(x.dtype)
        xc = x.to(acc) - _channel_view(running_mean.to(acc), x.dim())
        rstd = torch.rsqrt(running_var.to(acc) + eps)
        scale = rstd if weight is None else rstd * weight.to(acc)
        y = _bn_affine_(xc, scale, _as(bias, acc))
        return _fresh(y, x.dtype), rstd

    @staticmethod
    def _saved(inputs, output) -> tuple:
        """What the backward (and the jvp) needs: the input, γ and the statistics."""
        x, running_mean, running_var, weight, bias, eps = inputs
        _, rstd = output
        return (x, running_mean, weight, rstd)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, running_mean, running_var, weight, bias, eps = inputs
        _, rstd = output
        ctx.mark_non_differentiable(rstd)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*for_backward(*_BatchNormEval._saved(inputs, output)))
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, dy, _):
        x, running_mean, weight, rstd = ctx.saved_tensors
        if dy is None:
            return (None,) * 6
        acc = _acc_dtype(x.dtype)
        view = lambda t: _channel_view(t, x.dim())  # noqa: E731
        xhat = (x.to(acc) - view(running_mean.to(acc))).mul_(view(rstd))
        dx, dweight, dbias = batch_norm_backward.__wrapped__(dy.to(acc), xhat, rstd, _as(weight, acc), training=False)
        need = ctx.needs_input_grad
        return (
            dx.to(x.dtype) if need[0] else None,
            None,
            None,
            dweight.to(weight.dtype) if need[3] else None,
            dbias.to(ctx.bias_dtype) if need[4] else None,
            None,
        )


class _BatchNormEvalJvp(_BatchNormEval):
    """_BatchNormEval with its forward-mode derivative, for ``torch.func.jvp``/``jacfwd``/``hessian`` and ``forward_ad``.

    A class apart because ``torch.compile`` cannot trace a Function that defines ``jvp``.
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        _BatchNormEval.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*_BatchNormEval._saved(inputs, output))

    @staticmethod
    def jvp(ctx, tx, t_mean, t_var, tw, tb, _eps):
        # y = γ (x − μ̂) rstd + β with rstd = (σ̂² + ε)^(-1/2): the running statistics are
        # inputs like any other, so a tangent of theirs moves y too.
        x, running_mean, weight, rstd = ctx.saved_tensors
        acc = _acc_dtype(x.dtype)
        view = lambda t: _channel_view(t, x.dim())  # noqa: E731
        xhat = (x.to(acc) - view(running_mean.to(acc))) * view(rstd)
        dxhat = None
        if tx is not None or t_mean is not None:
            d = torch.zeros_like(xhat) if tx is None else tx.to(acc)
            if t_mean is not None:
                d = d - view(t_mean.to(acc))
            dxhat = d * view(rstd)
        if t_var is not None:  # d rstd = -rstd³ dσ̂² / 2, so dx̂ gains x̂ · (-rstd² dσ̂² / 2)
            dv = xhat * view(-0.5 * rstd * rstd * t_var.to(acc))
            dxhat = dv if dxhat is None else dxhat + dv
        return _affine_tangent(xhat, dxhat, weight, tw, tb, view).to(x.dtype), None


def batch_norm(
    input: Tensor,
    running_mean: Optional[Tensor],
    running_var: Optional[Tensor],
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    r"""Batch normalization (Ioffe & Szegedy, 2015) of ``(N, C, *)`` input per channel.

    In training the statistics come from the batch: mean and biased variance
    over every dimension but ``C``. If running statistics are given they are
    updated in place with PyTorch's momentum convention,

    .. math:: \hat\mu \leftarrow (1 - m)\,\hat\mu + m\,\mu_B, \qquad
              \hat\sigma^2 \leftarrow (1 - m)\,\hat\sigma^2 + m\,\tfrac{n}{n-1}\sigma_B^2 ,

    where the stored variance is the *unbiased* estimate (``n`` values per
    channel). In evaluation the running statistics are used instead.
    Gradients: :func:`batch_norm_backward`.

    Args:
        input: floating-point tensor ``(N, C)`` or ``(N, C, *)``.
        running_mean, running_var: ``(C,)`` buffers, or ``None``.
        weight, bias: optional ``(C,)`` affine parameters.
        training: use (and record) batch statistics.
        momentum: weight of the new batch in the running average, in [0, 1].
        eps: added to the variance, ``>= 0``.

    Example:
        >>> x = torch.tensor([[90., 80., 70.], [60., 50., 40.]])
        >>> batch_norm(x, None, None, training=True, eps=0.0)
        tensor([[ 1.,  1.,  1.],
                [-1., -1., -1.]])
    """
    ctx, input, running_mean, running_var, weight, bias = autocast_float32(
        "batch_norm", input, running_mean, running_var, weight, bias
    )
    momentum, eps = check_batch_norm_args(input, running_mean, running_var, weight, bias, training, momentum, eps)
    with ctx:
        return _batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


def _batch_norm(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                weight: Optional[Tensor], bias: Optional[Tensor], training: bool, momentum: float,
                eps: float) -> Tensor:
    """:func:`batch_norm` on checked arguments."""
    if not training:
        return _pick(_BatchNormEval, _BatchNormEvalJvp).apply(input, running_mean, running_var, weight, bias, eps)[0]
    C = input.shape[1]
    n = input.numel() // C if C else 0
    y, mean, var, _, _ = _pick(_BatchNormTrain, _BatchNormTrainJvp).apply(input, weight, bias, eps)
    if running_mean is not None and running_var is not None and n > 1:  # an empty batch leaves them alone
        _update_running(running_mean, mean, momentum)
        _update_running(running_var, var * (n / (n - 1)), momentum)
    return y


# ---------------------------------------------------------------------------
# GroupNorm and InstanceNorm
# ---------------------------------------------------------------------------


def _grouped(x: Tensor, G: int) -> tuple[int, int, int, int]:
    """``(N, G, C/G, S)``: the shape in which each (sample, group) is one slice over dims (2, 3)."""
    N, C = x.shape[:2]
    S = 1
    for s in x.shape[2:]:
        S *= s
    return (N, G, C // G, S)


@_checked(_check_group_norm_backward)
def group_norm_backward(
    dy: Tensor,
    xhat: Tensor,
    rstd: Tensor,
    num_groups: int,
    weight: Optional[Tensor] = None,
) -> tuple[Tensor, Optional[Tensor], Tensor]:
    r"""Gradients of :func:`group_norm`: LayerNorm's formula, once per (sample, group).

    With :math:`\hat g = \gamma \odot \partial L/\partial y` (γ per channel),
    over the ``m = (C/G)·(spatial)`` values of one group of one sample

    .. math::

        c_1 = \tfrac1m \textstyle\sum \hat g, \qquad
        c_2 = \tfrac1m \textstyle\sum \hat g \odot \hat x, \qquad
        \frac{\partial L}{\partial x} = \mathrm{rstd}\,(\hat g - c_1 - \hat x\, c_2),

    and per channel, over samples and positions, :math:`\partial L/\partial\gamma =
    \sum dy \odot \hat x`, :math:`\partial L/\partial\beta = \sum dy`. Since γ is
    constant over a channel's positions, ``c1`` and ``c2`` come from per-channel
    sums of ``dy`` and ``dy ⊙ x̂`` (those the parameter gradients need anyway),
    weighted by γ: no full-size ``ĝ`` is formed. InstanceNorm is the case
    ``num_groups = C``.

    Args:
        dy: upstream gradient ``(N, C, *)``, in the compute dtype.
        xhat: :math:`\hat x`, same shape.
        rstd: ``(N, G)``.
        num_groups: ``G``.
        weight: γ ``(C,)`` or ``None``.

    Returns:
        ``(dx, dweight, dbias)``; ``dweight`` is ``None`` without ``weight``.
    """
    N, G, Cg, S = _grouped(dy, num_groups)
    m = Cg * S
    dy4, xhat4 = dy.reshape(N, G, Cg, S), xhat.reshape(N, G, Cg, S)  # (N, G, C/G, S)
    rstd = rstd.reshape(N, G, 1, 1)
    w = 1.0 if weight is None else weight.reshape(1, G, Cg, 1)
    dy_xhat = dy4 * xhat4  # the one full-size buffer this function allocates
    sum_dy = dy4.sum(3, keepdim=True)  # (N, G, C/G, 1): per sample and channel
    sum_dy_xhat = dy_xhat.sum(3, keepdim=True)
    c1 = (w * sum_dy).sum(2, keepdim=True) / m  # mean(ĝ) per (sample, group)
    c2 = (w * sum_dy_xhat).sum(2, keepdim=True) / m  # mean(ĝ ⊙ x̂)
    # rstd · (ĝ − c1 − x̂ c2) = dy · (γ rstd) − rstd c1 − x̂ · (rstd c2)
    if _in_place():
        dx = dy_xhat.copy_(dy4).mul_(w * rstd).sub_(rstd * c1).addcmul_(xhat4, rstd * c2, value=-1)
    else:
        dx = dy4 * (w * rstd) - rstd * c1 - xhat4 * (rstd * c2)
    dweight = sum_dy_xhat.sum(0).reshape(-1) if weight is not None else None
    return dx.reshape(dy.shape), dweight, sum_dy.sum(0).reshape(-1)


class _GroupNorm(torch.autograd.Function):
    """GroupNorm (and InstanceNorm); backward: :func:`group_norm_backward`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, G, weight, bias, eps):
        acc = _acc_dtype(x.dtype)
        N, G, Cg, S = _grouped(x, G)
        xc, mean, shifted_mean, var = _moments(x.to(acc).reshape(N, G, Cg, S), (2, 3))
        rstd = _rstd(xc, var, (2, 3), eps)  # (N, G, 1, 1)
        scale = rstd if weight is None else rstd * weight.to(acc).reshape(1, G, Cg, 1)  # γ · rstd
        b = None if bias is None else bias.to(acc).reshape(1, G, Cg, 1)
        y = _affine_(xc, scale, b)  # (x − μ) · γ · rstd + β, in place
        return _fresh(y.reshape(x.shape), x.dtype), mean.reshape(N, G), var.reshape(N, G), shifted_mean, rstd

    @staticmethod
    def _saved(inputs, output) -> tuple:
        """What the backward (and the jvp) needs: the input, γ and the statistics."""
        x, G, weight, bias, eps = inputs
        _, mean, var, shifted_mean, rstd = output
        return (x, weight, shifted_mean, rstd)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, G, weight, bias, eps = inputs
        _, mean, var, shifted_mean, rstd = output
        ctx.mark_non_differentiable(mean, var, shifted_mean, rstd)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*for_backward(*_GroupNorm._saved(inputs, output)))
        ctx.G, ctx.eps = G, eps
        ctx.bias_dtype = None if bias is None else bias.dtype

    @staticmethod
    def backward(ctx, dy, *_):
        x, weight, shifted_mean, rstd = ctx.saved_tensors
        if dy is None:
            return (None,) * 5
        acc = _acc_dtype(x.dtype)
        xg = x.to(acc).reshape(_grouped(x, ctx.G))
        xhat, rstd = _xhat_for_backward(xg, (2, 3), shifted_mean, rstd, ctx.eps)
        dx, dweight, dbias = group_norm_backward.__wrapped__(
            dy.to(acc), xhat.reshape(x.shape), rstd, ctx.G, _as(weight, acc)
        )
        need = ctx.needs_input_grad
        return (
            dx.to(x.dtype) if need[0] else None,
            None,
            dweight.to(weight.dtype) if need[2] else None,
            dbias.to(ctx.bias_dtype) if need[3] else None,
            None,
        )


class _GroupNormJvp(_GroupNorm):
    """_GroupNorm with its forward-mode derivative, for ``torch.func.jvp``/``jacfwd``/``hessian`` and ``forward_ad``.

    A class apart because ``torch.compile`` cannot trace a Function that defines ``jvp``.
    """

    @staticmethod
    def setup_context(ctx, inputs, output):
        _GroupNorm.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*_GroupNorm._saved(inputs, output))

    @staticmethod
    def jvp(ctx, tx, _G, tw, tb, _eps):
        x, weight, shifted_mean, rstd = ctx.saved_tensors
        acc = _acc_dtype(x.dtype)
        shape = _grouped(x, ctx.G)  # (N, G, C/G, S)
        view = lambda t: t.reshape(1, shape[1], shape[2], 1)  # noqa: E731  (C,) -> per channel of a group
        xhat = _recentre(x.to(acc).reshape(shape), (2, 3), shifted_mean) * rstd
        dxhat = None if tx is None else _xhat_tangent(xhat, tx.to(acc).reshape(shape), rstd, (2, 3))
        ty = _affine_tangent(xhat, dxhat, weight, tw, tb, view)
        return ty.reshape(x.shape).to(x.dtype), None, None, None, None


def group_norm(
    input: Tensor,
    num_groups: int,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Group normalization (Wu & He, 2018) of ``(N, C, *)`` input.

    The ``C`` channels are split into ``num_groups`` groups of ``C / G``
    consecutive channels; each (sample, group) is normalized over its channels
    and all spatial positions, then γ/β are applied per channel.
    ``num_groups=1`` is LayerNorm over ``(C, *)``; ``num_groups=C`` is
    InstanceNorm. Gradients: :func:`group_norm_backward`.

    Args:
        input: floating-point tensor ``(N, C, *)``.
        num_groups: ``G``, a positive divisor of ``C``.
        weight, bias: optional ``(C,)`` affine parameters.
        eps: added to the variance, ``>= 0``.
    """
    ctx, input, weight, bias = autocast_float32("group_norm", input, weight, bias)
    G, eps = check_group_norm_args(input, num_groups, weight, bias, eps)
    with ctx:
        return _group_norm(input, G, weight, bias, eps)


def _group_norm(input: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
                eps: float) -> Tensor:
    """:func:`group_norm` on checked arguments."""
    return _pick(_GroupNorm, _GroupNormJvp).apply(input, num_groups, weight, bias, eps)[0]


def instance_norm(
    input: Tensor,
    running_mean: Optional[Tensor] = None,
    running_var: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    r"""Instance normalization (Ulyanov et al., 2016) of ``(N, C, *)`` input.

    Each (sample, channel) is normalized over its spatial positions alone:
    GroupNorm with one channel per group, which is how it is computed (and
    differentiated: :func:`group_norm_backward`). With ``use_input_stats`` and
    running statistics given, these are updated like :func:`batch_norm`'s
    with the per-instance statistics averaged over the batch (the unbiased
    variance again); with ``use_input_stats=False`` the running statistics
    normalize instead.

    Args:
        input: floating-point tensor ``(N, C, L)``, ``(N, C, H, W)``, ...
        running_mean, running_var: optional ``(C,)`` buffers.
        weight, bias: optional ``(C,)`` affine parameters.
        use_input_stats: normalize with each instance's own statistics.
        momentum: weight of the new batch in the running average.
        eps: added to the variance, ``>= 0``.
    """
    ctx, input, running_mean, running_var, weight, bias = autocast_float32(
        "instance_norm", input, running_mean, running_var, weight, bias
    )
    momentum, eps = check_instance_norm_args(input, running_mean, running_var, weight, bias, use_input_stats,
                                             momentum, eps)
    with ctx:
        return _instance_norm(input, running_mean, running_var, weight, bias, use_input_stats, momentum, eps)


def _instance_norm(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
                   weight: Optional[Tensor], bias: Optional[Tensor], use_input_stats: bool, momentum: float,
                   eps: float) -> Tensor:
    """:func:`instance_norm` on checked arguments."""
    if not use_input_stats:
        return _batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    C = int(input.shape[1])  # a plain int: torch.jit.trace hands the Function a traced size otherwise (it failed)
    n = _numel(input, range(2, input.dim()))
    if C == 0:  # nothing to normalize (and no group to split into): an empty result, as torch
        return input.clone()
    y, mean, var, _, _ = _pick(_GroupNorm, _GroupNormJvp).apply(input, C, weight, bias, eps)  # (N, C) statistics
    # No samples or no positions: nothing was measured, the running statistics stay as they were.
    if running_mean is not None and running_var is not None and input.shape[0] > 0 and n > 0:
        _update_running(running_mean, mean.mean(0), momentum)
        _update_running(running_var, (var * (n / (n - 1))).mean(0), momentum)
    return y
