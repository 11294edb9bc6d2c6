r"""The math of normalization, written out in plain PyTorch.

Every function here has the signature and semantics of its namesake in
:mod:`torch.nn.functional`, and is written so that one line of code maps to
one line of the book's equations:

.. math::

    \mu = \frac{1}{n}\sum_i x_i, \qquad
    \sigma^2 = \frac{1}{n}\sum_i (x_i - \mu)^2, \qquad
    \hat x = (x - \mu)\,\mathrm{rstd}, \quad \mathrm{rstd} = \frac{1}{\sqrt{\sigma^2 + \epsilon}}, \qquad
    y = \gamma \odot \hat x + \beta .

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
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ._checks import (
    _shape_t,
    check_channels,
    check_eps,
    check_float_tensor,
    check_momentum,
    check_param,
    check_positive_int,
    check_trailing_shape,
    normalize_shape,
)

__all__ = [
    "layer_norm",
    "rms_norm",
    "batch_norm",
    "group_norm",
    "instance_norm",
    "moments",
]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float64 for float64 input, float32 for everything narrower."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _channel_view(p: Tensor, ndim: int) -> Tensor:
    """(C,) -> (1, C, 1, ..., 1) so that it broadcasts against (N, C, *)."""
    return p.reshape((1, -1) + (1,) * (ndim - 2))


def moments(x: Tensor, dims: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    r"""Mean and biased variance of ``x`` over ``dims`` by two passes.

    Returns ``(xc, mean, var)`` with ``xc = x - mean`` (all with ``keepdim``),
    computed in ``x``'s dtype: call it on an already up-cast tensor.

    The first pass runs on ``x - x_0``, where ``x_0`` is the first element of
    each slice (detached: it cancels exactly in ``xc``), so a constant slice
    gives ``xc == 0`` exactly.
    """
    dims = tuple(d % x.dim() for d in dims)
    if any(x.shape[d] == 0 for d in dims):
        # Empty slices: nothing to shift by; the statistics are NaN, like torch's.
        mean = x.mean(dims, keepdim=True)
        xc = x - mean
        return xc, mean, (xc * xc).mean(dims, keepdim=True)
    x0 = x.detach()
    for d in dims:
        x0 = x0.narrow(d, 0, 1)
    shifted = x - x0
    shifted_mean = shifted.mean(dims, keepdim=True)
    xc = shifted - shifted_mean
    var = (xc * xc).mean(dims, keepdim=True)
    return xc, x0 + shifted_mean, var


def check_layer_norm_args(input, normalized_shape, weight, bias, eps) -> tuple[tuple[int, ...], float]:
    """Validate :func:`layer_norm`'s arguments; returns ``(normalized_shape, eps)``."""
    check_float_tensor(input)
    shape = normalize_shape(normalized_shape)
    check_trailing_shape(input, shape)
    check_param(weight, "weight", shape)
    check_param(bias, "bias", shape)
    return shape, check_eps(eps)


def check_rms_norm_args(input, normalized_shape, weight, eps) -> tuple[tuple[int, ...], float]:
    """Validate :func:`rms_norm`'s arguments; returns ``(normalized_shape, eps)``, resolving ``eps=None``."""
    check_float_tensor(input)
    shape = normalize_shape(normalized_shape)
    check_trailing_shape(input, shape)
    check_param(weight, "weight", shape)
    eps = torch.finfo(_acc_dtype(input.dtype)).eps if eps is None else check_eps(eps)
    return shape, eps


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
    :func:`torch.nn.functional.layer_norm`.

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
        tensor([[-1.,  1.],
                [-1.,  1.]])
    """
    shape, eps = check_layer_norm_args(input, normalized_shape, weight, bias, eps)
    acc = _acc_dtype(input.dtype)
    dims = tuple(range(-len(shape), 0))
    xc, _, var = moments(input.to(acc), dims)
    rstd = torch.rsqrt(var + eps)
    y = xc * rstd
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(input.dtype)


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
    shape, eps = check_rms_norm_args(input, normalized_shape, weight, eps)
    acc = _acc_dtype(input.dtype)
    dims = tuple(range(-len(shape), 0))
    x = input.to(acc)
    rrms = torch.rsqrt((x * x).mean(dims, keepdim=True) + eps)
    y = x * rrms
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(input.dtype)


def _check_running(stat: Optional[Tensor], name: str, num_channels: int) -> None:
    if stat is None:
        return
    check_float_tensor(stat, name)
    if tuple(stat.shape) != (num_channels,):
        raise ValueError(f"{name} must have shape [{num_channels}] (got {list(stat.shape)})")


@torch.no_grad()
def _update_running(
    running: Tensor, batch_value: Tensor, momentum: float
) -> None:
    """PyTorch's convention: ``new = (1 - momentum) * old + momentum * batch``, in place.

    Computed in the accumulation dtype, then rounded once into the buffer.
    """
    acc = _acc_dtype(running.dtype)
    new = running.to(acc) * (1.0 - momentum) + batch_value.to(acc) * momentum
    running.copy_(new)


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
    check_float_tensor(input)
    C = check_channels(input, "batch_norm")
    _check_running(running_mean, "running_mean", C)
    _check_running(running_var, "running_var", C)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must be given together (got one of them)")
    check_param(weight, "weight", (C,))
    check_param(bias, "bias", (C,))
    momentum = check_momentum(momentum, allow_none=False)
    eps = check_eps(eps)
    if not training and running_mean is None:
        raise ValueError("batch_norm in evaluation (training=False) needs running_mean and running_var")

    acc = _acc_dtype(input.dtype)
    x = input.to(acc)
    if training:
        dims = (0,) + tuple(range(2, input.dim()))
        n = input.numel() // C if C else 0
        if n == 1:
            raise ValueError(
                f"batch_norm in training needs more than 1 value per channel to "
                f"estimate a variance (got input of shape {list(input.shape)})"
            )
        xc, mean, var = moments(x, dims)
        y = xc * torch.rsqrt(var + eps)
        if running_mean is not None and n > 1:
            _update_running(running_mean, mean.reshape(C), momentum)
            _update_running(running_var, var.reshape(C) * (n / (n - 1)), momentum)
    else:
        mean = _channel_view(running_mean.to(acc), input.dim())
        rstd = torch.rsqrt(_channel_view(running_var.to(acc), input.dim()) + eps)
        y = (x - mean) * rstd
    if weight is not None:
        y = y * _channel_view(weight.to(acc), input.dim())
    if bias is not None:
        y = y + _channel_view(bias.to(acc), input.dim())
    return y.to(input.dtype)


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
    InstanceNorm.

    Args:
        input: floating-point tensor ``(N, C, *)``.
        num_groups: ``G``, a positive divisor of ``C``.
        weight, bias: optional ``(C,)`` affine parameters.
        eps: added to the variance, ``>= 0``.
    """
    check_float_tensor(input)
    C = check_channels(input, "group_norm")
    G = check_positive_int(num_groups, "num_groups")
    if C % G != 0:
        raise ValueError(
            f"num_groups must divide the number of channels: got num_groups={G} "
            f"for input with {C} channels"
        )
    check_param(weight, "weight", (C,))
    check_param(bias, "bias", (C,))
    eps = check_eps(eps)

    acc = _acc_dtype(input.dtype)
    N = input.shape[0]
    x = input.to(acc).reshape(N, G, input[0].numel() // G if N else 0)  # (N, G, C/G * prod(*))
    xc, _, var = moments(x, (2,))
    y = (xc * torch.rsqrt(var + eps)).reshape(input.shape)  # (N, C, *)
    if weight is not None:
        y = y * _channel_view(weight.to(acc), input.dim())
    if bias is not None:
        y = y + _channel_view(bias.to(acc), input.dim())
    return y.to(input.dtype)


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

    Each (sample, channel) is normalized over its spatial positions alone.
    With ``use_input_stats`` and running statistics given, these are updated
    like :func:`batch_norm`'s with the per-instance statistics averaged over
    the batch (the unbiased variance again); with ``use_input_stats=False``
    the running statistics normalize instead.

    Args:
        input: floating-point tensor ``(N, C, L)``, ``(N, C, H, W)``, ...
        running_mean, running_var: optional ``(C,)`` buffers.
        weight, bias: optional ``(C,)`` affine parameters.
        use_input_stats: normalize with each instance's own statistics.
        momentum: weight of the new batch in the running average.
        eps: added to the variance, ``>= 0``.
    """
    check_float_tensor(input)
    C = check_channels(input, "instance_norm", min_dim=3)
    _check_running(running_mean, "running_mean", C)
    _check_running(running_var, "running_var", C)
    if (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must be given together (got one of them)")
    check_param(weight, "weight", (C,))
    check_param(bias, "bias", (C,))
    momentum = check_momentum(momentum, allow_none=False)
    eps = check_eps(eps)

    if not use_input_stats:
        if running_mean is None:
            raise ValueError("instance_norm with use_input_stats=False needs running_mean and running_var")
        return batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)

    acc = _acc_dtype(input.dtype)
    spatial = tuple(range(2, input.dim()))
    n = 1
    for d in spatial:
        n *= input.shape[d]
    if n == 1:
        raise ValueError(
            f"instance_norm needs more than 1 spatial element per channel "
            f"(got input of shape {list(input.shape)})"
        )
    xc, mean, var = moments(input.to(acc), spatial)
    y = xc * torch.rsqrt(var + eps)
    if running_mean is not None and input.shape[0] > 0:
        _update_running(running_mean, mean.reshape(input.shape[:2]).mean(0), momentum)
        unbiased = var.reshape(input.shape[:2]) * (n / (n - 1))
        _update_running(running_var, unbiased.mean(0), momentum)
    if weight is not None:
        y = y * _channel_view(weight.to(acc), input.dim())
    if bias is not None:
        y = y + _channel_view(bias.to(acc), input.dim())
    return y.to(input.dtype)
