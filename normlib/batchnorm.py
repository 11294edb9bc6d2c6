"""BatchNorm and InstanceNorm modules on one base class that holds running statistics.

Buffers and parameters carry torch.nn's names (``weight``, ``bias``,
``running_mean``, ``running_var``, ``num_batches_tracked``), so state_dicts
load in both directions. Training vs evaluation is decided by
``self.training`` alone (``model.train()`` / ``model.eval()``), never by
whether autograd is enabled.

Each class is a subclass of its :mod:`torch.nn` namesake (and so of
``torch.nn.modules.batchnorm._NormBase``): ``isinstance(m, torch.nn.BatchNorm2d)``
holds, ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` converts normlib's
BatchNorm layers, and torch's own state_dict loading rules apply, among them
the versioned ``num_batches_tracked`` (a checkpoint saved at version 1,
without that key, loads with the counter kept at its current value, as in torch).
normlib checks the arguments (with its own messages), torch's constructor
registers the parameters and buffers, and ``forward`` is normlib's.

dtypes follow torch.nn: ``weight``, ``bias``, ``running_mean`` and
``running_var`` must have the input's dtype, or be float32 for
float16/bfloat16 input; anything else is a ``TypeError`` naming both dtypes
(torch raises a ``RuntimeError``). The output has the input's dtype.
"""

from __future__ import annotations

import warnings

from typing import Optional

import torch  # noqa: F401 (the docstrings' examples, run as doctests, use it)
from torch import Tensor, nn
from torch.nn.modules import batchnorm as _tbn
from torch.nn.modules import instancenorm as _tin

from . import ops
from .numerics import momentum_for_step
from ._checks import check_eps, check_float_tensor, check_momentum, check_positive_int
from .normalization import _accepts_bias, _NormlibRepr
from .errors import NormValueError

__all__ = ["BatchNorm1d", "BatchNorm2d", "InstanceNorm1d", "InstanceNorm2d"]


def _buffer(value: Optional[Tensor], name: str) -> Tensor:
    """A running-statistics buffer, which torch's constructor registers whenever ``track_running_stats`` is set."""
    if value is None:
        raise RuntimeError(f"track_running_stats is set but the layer's {name} buffer is None")
    return value


class _NormBase(_NormlibRepr, _tbn._NormBase):
    """Parameters, running statistics and their (re)initialisation.

    A subclass of ``torch.nn.modules.batchnorm._NormBase``: normlib's argument
    checks, then torch's constructor (which registers ``weight``/``bias`` and
    the running-statistics buffers, or ``None`` for each that is switched off),
    and torch's versioned ``_load_from_state_dict``.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        num_features = check_positive_int(num_features, "num_features")
        eps, momentum = check_eps(eps), check_momentum(momentum)
        # torch < 2.13 has no `bias` argument: then drop the bias after construction
        extra = {"bias": bias} if _accepts_bias(_tbn._NormBase) else {}
        _tbn._NormBase.__init__(self, num_features, eps, momentum, affine, track_running_stats, device, dtype, **extra)
        if affine and not bias and self.bias is not None:
            self.register_parameter("bias", None)  # what `self.bias = None` does, typed

    def reset_running_stats(self) -> None:
        if self.track_running_stats:
            _buffer(self.running_mean, "running_mean").zero_()
            _buffer(self.running_var, "running_var").fill_(1)
            _buffer(self.num_batches_tracked, "num_batches_tracked").zero_()

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _batch_norm(self, input: Tensor) -> Tensor:
        """This layer's BatchNorm of ``input`` on this process, counting the step."""
        momentum = self._momentum_for_this_step()
        # Batch statistics in training, and in eval too when no running statistics exist.
        use_batch_stats = self.training or self.running_mean is None
        # Record into the running statistics only while training.
        track = self.training and self.track_running_stats
        return ops.dispatch.batch_norm(
            input,
            self.running_mean if track or not use_batch_stats else None,
            self.running_var if track or not use_batch_stats else None,
            self.weight,
            self.bias,
            use_batch_stats,
            momentum,
            self.eps,
        )

    def _momentum_for_this_step(self) -> float:
        """Count the batch and return the weight it gets in the running average.

        ``momentum=None`` makes the running statistics a cumulative (equal
        weight) average of every batch seen: the k-th batch gets weight 1/k.
        """
        if not (self.training and self.track_running_stats):
            return 0.0 if self.momentum is None else self.momentum
        batches = _buffer(self.num_batches_tracked, "num_batches_tracked")
        batches.add_(1)  # a buffer: no graph is recorded (as torch.nn's BatchNorm counts)
        momentum = self.momentum
        return momentum if momentum is not None else momentum_for_step(None, batches)



class _BatchNorm(_NormBase, _tbn._BatchNorm):
    _ndims: tuple[int, ...] = ()

    def _check_input_dim(self, input: Tensor) -> None:
        check_float_tensor(input)
        if input.dim() not in self._ndims:
            want = " or ".join(f"{d}D" for d in self._ndims)
            raise NormValueError(
                f"{type(self).__name__} expects {want} input (got {input.dim()}D input "
                f"of shape {list(input.shape)})"
            )
        if input.shape[1] != self.num_features:
            raise NormValueError(
                f"{type(self).__name__}({self.num_features}) expects {self.num_features} "
                f"channels in dimension 1 (got input of shape {list(input.shape)})"
            )

    def forward(self, input: Tensor) -> Tensor:
        if not (isinstance(input, Tensor) and input.dim() in self._ndims and input.shape[1] == self.num_features):
            self._check_input_dim(input)  # raises, naming what is wrong (the dtype is checked with the rest)
        return self._batch_norm(input)


class BatchNorm1d(_BatchNorm, nn.BatchNorm1d):
    r"""Batch normalization over ``(N, C)`` or ``(N, C, L)`` input.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta

    with per-channel statistics of the batch in training (also recorded into
    ``running_mean``/``running_var`` with ``new = (1 - momentum) * old +
    momentum * batch``), and the running statistics in evaluation.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance (default ``1e-5``).
        momentum: weight of each new batch (default 0.1); ``None`` for a cumulative average.
        affine: learn γ (``weight``) and β (``bias``).
        bias: (keyword-only) learn β too, when ``affine``.
        track_running_stats: keep running statistics; without them the batch
            statistics are used in evaluation too.

    dtypes: ``weight``, ``bias``, ``running_mean`` and ``running_var`` must
    have the input's dtype, or be float32 for float16/bfloat16 input (as in
    :class:`torch.nn.BatchNorm1d`); anything else is a ``TypeError`` naming
    both dtypes. The output has the input's dtype.

    A subclass of :class:`torch.nn.BatchNorm1d`: ``isinstance(m, torch.nn.BatchNorm1d)`` holds.

    Example:
        >>> bn = BatchNorm1d(3)
        >>> bn(torch.randn(8, 3)).shape
        torch.Size([8, 3])
    """

    _ndims = (2, 3)


class BatchNorm2d(_BatchNorm, nn.BatchNorm2d):
    r"""Batch normalization over ``(N, C, H, W)`` input, per channel.

    Same arguments, dtype rule and behaviour as :class:`BatchNorm1d`; the statistics of
    channel ``c`` are taken over ``N``, ``H`` and ``W``. A subclass of :class:`torch.nn.BatchNorm2d`.

    Example:
        >>> BatchNorm2d(32)(torch.randn(16, 32, 8, 8)).shape
        torch.Size([16, 32, 8, 8])
    """

    _ndims = (4,)


class _InstanceNorm(_NormBase, _tin._InstanceNorm):
    _spatial: int = 1

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = False,
        track_running_stats: bool = False,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)

    def forward(self, input: Tensor) -> Tensor:
        check_float_tensor(input)
        batched = self._spatial + 2
        if input.dim() not in (batched - 1, batched):
            raise NormValueError(
                f"{type(self).__name__} expects {batched - 1}D (unbatched) or {batched}D "
                f"input (got {input.dim()}D input of shape {list(input.shape)})"
            )
        unbatched = input.dim() == batched - 1
        x = input.unsqueeze(0) if unbatched else input
        if x.shape[1] != self.num_features:
            if self.affine or self.track_running_stats:  # γ, β or the running statistics need that many
                raise NormValueError(
                    f"{type(self).__name__}({self.num_features}) expects {self.num_features} "
                    f"channels (got input of shape {list(input.shape)})"
                )
            # num_features is not used: torch warns and normalizes every channel there is, and so does normlib
            warnings.warn(
                f"input's size at dim={1 - unbatched} does not match num_features. You can silence this warning "
                "by not passing in num_features, which is not used because affine=False", stacklevel=2)
        momentum = self._momentum_for_this_step()
        # Running statistics (when tracked) are recorded in training and used in eval.
        y = ops.dispatch.instance_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training or not self.track_running_stats,
            momentum,
            self.eps,
        )
        return y.squeeze(0) if unbatched else y

    def _momentum_for_this_step(self) -> float:
        """torch's InstanceNorm counts no batches: only ``momentum=None`` (a cumulative average) needs the count."""
        if self.momentum is not None:
            return self.momentum
        return super()._momentum_for_this_step()


class InstanceNorm1d(_InstanceNorm, nn.InstanceNorm1d):
    r"""Instance normalization of ``(N, C, L)`` (or unbatched ``(C, L)``) input.

    Each (sample, channel) is normalized over its ``L`` positions. Defaults
    follow :class:`torch.nn.InstanceNorm1d`: ``affine=False``,
    ``track_running_stats=False``. One deliberate difference: with
    ``track_running_stats=True`` and ``momentum=None`` the running statistics
    are a cumulative average over the batches seen (counted in
    ``num_batches_tracked``), as for BatchNorm; torch leaves them unchanged.
    With a momentum, as torch, no batch is counted.

    dtypes: as :class:`BatchNorm1d` (parameters and running statistics of the
    input's dtype, or float32 for float16/bfloat16 input; a ``TypeError``
    otherwise). A subclass of :class:`torch.nn.InstanceNorm1d`.

    Example:
        >>> InstanceNorm1d(3)(torch.randn(2, 3, 10)).shape
        torch.Size([2, 3, 10])
    """

    _spatial = 1


class InstanceNorm2d(_InstanceNorm, nn.InstanceNorm2d):
    r"""Instance normalization of ``(N, C, H, W)`` (or unbatched ``(C, H, W)``) input.

    Each (sample, channel) image is normalized over its ``H × W`` pixels.
    Same arguments and dtype rule as :class:`InstanceNorm1d`; a subclass of
    :class:`torch.nn.InstanceNorm2d`.

    Example:
        >>> InstanceNorm2d(3)(torch.randn(2, 3, 8, 8)).shape
        torch.Size([2, 3, 8, 8])
    """

    _spatial = 2
