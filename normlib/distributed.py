r"""BatchNorm whose statistics span every process of a data-parallel job.

In data-parallel training each process holds a slice of the batch.
:class:`SyncBatchNorm` normalizes every slice with the statistics of the
*whole* batch, exactly as one :class:`~normlib.BatchNorm2d` would on the
concatenated batch, using only ``torch.distributed``: CPU tensors with the
``gloo`` backend, CUDA tensors with ``nccl`` (or ``gloo``).

What travels, per layer and training step (``C`` channels, ``W`` processes):

* forward, one ``all_gather``: each rank sends ``2C + 3`` float64 numbers:
  a header (channel count, device kind, number of values per channel) and its
  per-channel means and sums of squared deviations. Every rank then merges the ``W``
  contributions with :func:`combine_moments`, the parallel-variance formula
  of Chan, Golub & LeVeque, so unequal and empty per-rank batches give the
  statistics of the concatenated batch.
* backward, one ``all_reduce`` of ``2C`` float64 numbers: the per-channel sums
  :math:`\sum dy` and :math:`\sum dy\,\hat x`, which the input gradient needs.
  The gradients of ``weight``/``bias`` stay local (the data-parallel wrapper,
  e.g. ``DistributedDataParallel``, reduces them like any other parameter's).

The first synchronised forward of each layer adds one small ``all_gather``
(two numbers per rank) that checks every rank has the same channel count, so
that a mismatch raises a ``ValueError`` on every rank instead of hanging.

In evaluation, without an initialised process group, or with a group of one
process, :class:`SyncBatchNorm` computes exactly what
:func:`normlib.functional.batch_norm` (and so :class:`~normlib.BatchNorm2d`)
computes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import functional as F
from ._checks import check_dtypes, check_eps, check_float_tensor, check_momentum, check_positive_int
from .normalization import _accepts_bias

__all__ = ["SyncBatchNorm", "SyncBatchNormFunction", "combine_moments", "local_moments"]

# Statistics travel as float64 whatever the input's dtype: counts stay exact
# (float32 counts stop being integers past 2**24 values per channel) and the
# payload is a few numbers per channel, so its width costs nothing measurable.
_WIRE = torch.float64
# The device kind of each rank travels as a small integer.
_DEVICE_KINDS = ("cpu", "cuda", "xpu", "hpu", "mps", "meta")


def _device_code(device: torch.device) -> int:
    return _DEVICE_KINDS.index(device.type) if device.type in _DEVICE_KINDS else len(_DEVICE_KINDS)


def _device_name(code: int) -> str:
    return _DEVICE_KINDS[code] if code < len(_DEVICE_KINDS) else "other"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in float64 for float64 input, float32 for everything narrower."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _channel_view(p: Tensor, ndim: int) -> Tensor:
    """(C,) -> (1, C, 1, ..., 1) so that it broadcasts against (N, C, *)."""
    return p.reshape((1, -1) + (1,) * (ndim - 2))


def _shifted_moments(x: Tensor) -> tuple[int, Tensor, Tensor, Tensor, Tensor]:
    """``(n, x0, shifted, shifted_mean, m2)`` per channel of ``(N, C, *)`` input ``x``.

    ``x0`` (``(C,)``) is the channel's first value (0 for an empty slice),
    ``shifted = x - x0``, ``shifted_mean`` its mean and ``m2`` the sum of
    squared deviations, all in ``x``'s dtype: the two shifted passes of
    :func:`normlib.functional.moments`, kept apart so that the mean can be
    formed in float64 as ``x0 + shifted_mean`` without rounding it to ``x``'s dtype.
    """
    C = x.shape[1]
    n = x.numel() // C if C else 0
    dims = (0,) + tuple(range(2, x.dim()))
    if n == 0:
        zeros = x.new_zeros(C)
        return 0, zeros, x - _channel_view(zeros, x.dim()), zeros.clone(), zeros.clone()
    x0 = x.detach().reshape(x.shape[0], C, -1)[0, :, 0]  # (C,): the first value of each channel
    shifted = x - _channel_view(x0, x.dim())
    shifted_mean = shifted.mean(dims)  # (C,)
    xc = shifted - _channel_view(shifted_mean, x.dim())
    return n, x0, shifted, shifted_mean, (xc * xc).sum(dims)


def local_moments(x: Tensor) -> tuple[int, Tensor, Tensor]:
    r"""Count, mean and sum of squared deviations per channel of ``(N, C, *)`` input.

    .. math:: n = N \cdot \textstyle\prod *, \qquad \mu = \frac{1}{n}\sum_i x_i, \qquad M_2 = \sum_i (x_i - \mu)^2 .

    Returns ``(n, mean, m2)``: ``n`` a Python int, ``mean`` and ``m2`` of shape
    ``(C,)`` in float64, what one rank contributes to :func:`combine_moments`.
    The passes run in float32 (float64 for float64 input) on ``x - x0``, ``x0``
    being each channel's first value, as in :func:`normlib.functional.moments`:
    a constant channel gives ``m2 == 0`` exactly, and the mean, formed as
    ``x0 + mean(x - x0)`` in float64, keeps digits that a float32 mean of values
    far from zero would round away. An empty slice (``n = 0``) gives zeros.

    Example:
        >>> n, mean, m2 = local_moments(torch.full((4, 2, 3), 1e6))
        >>> n, mean.tolist(), m2.tolist()
        (12, [1000000.0, 1000000.0], [0.0, 0.0])
    """
    x = x.to(_acc_dtype(x.dtype))
    n, x0, _, shifted_mean, m2 = _shifted_moments(x)
    return n, x0.to(_WIRE) + shifted_mean.to(_WIRE), m2.to(_WIRE)


def combine_moments(count: Tensor, mean: Tensor, m2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""Merge per-part statistics into those of the union (Chan, Golub & LeVeque).

    Part ``k`` holds ``count[k]`` values with mean ``mean[k]`` and sum of
    squared deviations ``m2[k]``. Two parts ``a`` and ``b`` merge as

    .. math::

        n = n_a + n_b, \qquad \delta = \mu_b - \mu_a, \qquad
        \mu = \mu_a + \delta\,\frac{n_b}{n}, \qquad
        M_2 = M_{2,a} + M_{2,b} + \delta^2\,\frac{n_a n_b}{n},

    and this function folds that merge over the parts in order. Only
    differences of means are squared, never the raw values, so nothing
    cancels: parts whose values all equal 1e6 merge to mean 1e6 and
    ``M2 = 0`` exactly (:math:`\sum x^2 - (\sum x)^2 / n` would lose every
    digit there). A part with ``count == 0`` changes nothing.

    Args:
        count: ``(W,)`` number of values in each part (``>= 0``).
        mean: ``(W, C)`` mean of each part and channel (any value where the count is 0).
        m2: ``(W, C)`` sum of squared deviations from the part's own mean.

    Returns:
        ``(n, mean, m2)``: the total count (0-d) and the ``(C,)`` mean and sum of
        squared deviations of all parts together, in ``mean``'s dtype. The
        biased variance is ``m2 / n``, the unbiased one ``m2 / (n - 1)``.

    Example:
        >>> x = torch.arange(10.0, dtype=torch.float64).reshape(10, 1)
        >>> parts = [x[:3], x[3:3], x[3:]]  # 3, 0 and 7 values
        >>> count = torch.tensor([float(len(p)) for p in parts], dtype=torch.float64)
        >>> mean = torch.stack([p.mean(0) if len(p) else torch.zeros(1, dtype=torch.float64) for p in parts])
        >>> m2 = torch.stack([((p - p.mean(0)) ** 2).sum(0) if len(p) else torch.zeros(1, dtype=torch.float64) for p in parts])
        >>> n, mu, s = combine_moments(count, mean, m2)
        >>> n.item(), mu.item(), (s / n).item()
        (10.0, 4.5, 8.25)
    """
    if count.dim() != 1 or mean.dim() != 2 or m2.shape != mean.shape or mean.shape[0] != count.shape[0]:
        raise ValueError(
            f"combine_moments expects count (W,), mean (W, C) and m2 (W, C) "
            f"(got {list(count.shape)}, {list(mean.shape)}, {list(m2.shape)})"
        )
    nonempty = [c > 0 for c in count.tolist()]
    count = count.to(mean.dtype)
    n_a = count[0]
    mean_a = mean[0] if nonempty[0] else torch.zeros_like(mean[0])
    m2_a = m2[0] if nonempty[0] else torch.zeros_like(m2[0])
    for k in range(1, count.shape[0]):
        if not nonempty[k]:
            continue
        n_b = count[k]
        n = n_a + n_b
        delta = mean[k] - mean_a  # (C,)
        mean_a = mean_a + delta * (n_b / n)
        m2_a = m2_a + m2[k] + delta * delta * (n_a * n_b / n)
        n_a = n
    return n_a, mean_a, m2_a


def _group_size(group) -> int:
    return torch.distributed.get_world_size(group)


def _check_same_channels(num_channels: int, device: torch.device, group, world_size: int) -> None:
    """All-gather (C, device kind) once so that a mismatch raises on every rank instead of hanging."""
    header = torch.tensor([num_channels, _device_code(device)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(header) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, header, group=group)
    table = torch.stack(gathered).tolist()
    _raise_if_mismatched(table, torch.distributed.get_rank(group))


def _raise_if_mismatched(table: list[list[int]], rank: int) -> None:
    """``table[r] = [channels, device kind]`` of rank ``r``: all ranks must agree."""
    channels = [int(row[0]) for row in table]
    kinds = [_device_name(int(row[1])) for row in table]
    if len(set(channels)) > 1:
        raise ValueError(
            f"SyncBatchNorm: the processes of the group disagree on the number of channels "
            f"(rank -> channels: {dict(enumerate(channels))}; this is rank {rank}); every "
            f"process must build the same model"
        )
    if len(set(kinds)) > 1:
        raise ValueError(
            f"SyncBatchNorm: the process group spans devices of different kinds "
            f"(rank -> device: {dict(enumerate(kinds))}; this is rank {rank}); put the model "
            f"and its input on the same kind of device in every process"
        )


class SyncBatchNormFunction(torch.autograd.Function):
    r"""Training-mode BatchNorm over the union of the batches of a process group.

    ``forward(input, weight, bias, running_mean, running_var, eps, momentum, group)``
    returns :math:`y = \gamma \odot (x - \mu)\,\mathrm{rstd} + \beta` with
    :math:`\mu`, :math:`\sigma^2` the statistics of every rank's batch together
    (one ``all_gather``), and records them into the running statistics (the
    unbiased variance, from the global count). The backward all-reduces
    :math:`\sum dy` and :math:`\sum dy\,\hat x` (one ``all_reduce``, only when the
    input needs a gradient) and returns

    .. math:: dx = \gamma\,\mathrm{rstd}\,\Big(dy - \frac{1}{n}\sum dy - \hat x\,\frac{1}{n}\sum dy\,\hat x\Big),

    the input gradient of one BatchNorm over all ``n`` values of the group;
    ``weight``/``bias`` get this rank's share of their gradients. Every rank of
    ``group`` must call it (an empty batch still takes part). It works with a
    group of any size, one included.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, group):
        world_size = _group_size(group)
        C = input.shape[1]
        acc = _acc_dtype(input.dtype)
        x = input.to(acc)
        n_local, x0, shifted, shifted_mean, m2_local = _shifted_moments(x)
        mean_local = x0.to(_WIRE) + shifted_mean.to(_WIRE)  # (C,), not rounded to x's dtype

        # One collective: [C, device kind, count, mean (C), M2 (C)] from every rank.
        header = torch.tensor([C, _device_code(input.device), n_local], dtype=_WIRE, device=input.device)
        mine = torch.cat([header, mean_local, m2_local.to(_WIRE)])  # (2C + 3,)
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        torch.distributed.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered)  # (W, 2C + 3)
        _raise_if_mismatched(table[:, :2].long().tolist(), torch.distributed.get_rank(group))
        counts, means, m2s = table[:, 2], table[:, 3 : 3 + C], table[:, 3 + C :]
        n_t, mean64, m264 = combine_moments(counts, means, m2s)
        n = int(n_t.item())
        if n <= 1:
            raise ValueError(
                f"SyncBatchNorm in training needs more than 1 value per channel across the "
                f"process group to estimate a variance (got {n}; per rank: "
                f"{[int(c) for c in counts.tolist()]})"
            )
        var64 = m264 / n
        if running_mean is not None:
            with torch.no_grad():
                for running, batch_value in ((running_mean, mean64), (running_var, m264 / (n - 1))):
                    racc = _acc_dtype(running.dtype)
                    new = running.to(racc) * (1.0 - momentum) + batch_value.to(racc) * momentum
                    running.copy_(new)

        # x - mean, as (x - x0) - (mean - x0): the global mean enters only as its (small)
        # distance from this rank's shift, formed in float64, so nothing large is rounded.
        mean_shift = _channel_view((mean64 - x0.to(_WIRE)).to(acc), input.dim())
        rstd = _channel_view(torch.rsqrt(var64 + eps).to(acc), input.dim())
        y = (shifted - mean_shift) * rstd
        if weight is not None:
            y = y * _channel_view(weight.to(acc), input.dim())
        if bias is not None:
            y = y + _channel_view(bias.to(acc), input.dim())
        ctx.save_for_backward(input, weight, _channel_view(x0, input.dim()), mean_shift, rstd)
        ctx.n = n
        ctx.group = group
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(input.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        input, weight, x0, mean_shift, rstd = ctx.saved_tensors
        acc = rstd.dtype
        dims = (0,) + tuple(range(2, input.dim()))
        xhat = ((input.to(acc) - x0) - mean_shift) * rstd
        dyf = dy.to(acc)
        sum_dy = dyf.sum(dims)  # (C,)
        sum_dy_xhat = (dyf * xhat).sum(dims)  # (C,)
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            C = input.shape[1]
            both = torch.cat([sum_dy, sum_dy_xhat]).to(_WIRE)  # (2C,)
            torch.distributed.all_reduce(both, group=ctx.group)
            g_sum_dy = _channel_view(both[:C].to(acc), input.dim())
            g_sum_dy_xhat = _channel_view(both[C:].to(acc), input.dim())
            scale = rstd if weight is None else rstd * _channel_view(weight.to(acc), input.dim())
            grad_input = (scale * (dyf - g_sum_dy / ctx.n - xhat * (g_sum_dy_xhat / ctx.n))).to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    r"""Batch normalization of ``(N, C, *)`` input with statistics over every process of a group.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta

    where, in training, :math:`\mathrm{E}` and :math:`\mathrm{Var}` (biased)
    run over ``N`` and ``*`` of the batches of *all* processes in
    ``process_group`` together: every rank gets what one BatchNorm would give
    its slice of the concatenated batch, also when the ranks hold different
    numbers of samples, or none. Running statistics are updated with the
    global statistics (the unbiased variance from the global count) and used
    in evaluation. Works on CPU tensors with the ``gloo`` backend and on CUDA
    tensors with ``nccl``. In evaluation, without an initialised process
    group, or in a group of one process it computes exactly what
    :class:`~normlib.BatchNorm2d` computes. See :mod:`normlib.distributed` for
    what is communicated.

    Arguments, parameters (``weight``, ``bias``), buffers (``running_mean``,
    ``running_var``, ``num_batches_tracked``) and state_dict are those of
    :class:`torch.nn.SyncBatchNorm`.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance (default ``1e-5``).
        momentum: weight of each new batch in the running statistics (default
            0.1); ``None`` for a cumulative average.
        affine: learn γ (``weight``) and β (``bias``).
        track_running_stats: keep running statistics; without them the
            (synchronised) batch statistics are used in evaluation too.
        process_group: the processes whose batches are normalized together
            (default: all of them, ``torch.distributed.group.WORLD``).
        bias: (keyword-only) learn β too, when ``affine``.

    Shape:
        - Input: ``(N, C, *)``, ``N`` may differ between processes and be 0.
        - Output: same shape as the input.

    Example:
        >>> # in each process, after torch.distributed.init_process_group("gloo", ...)
        >>> model = SyncBatchNorm.convert_sync_batchnorm(model)  # doctest: +SKIP
        >>> model = torch.nn.parallel.DistributedDataParallel(model)  # doctest: +SKIP
        >>> SyncBatchNorm(4)(torch.randn(8, 4, 5, 5)).shape  # no process group: plain BatchNorm
        torch.Size([8, 4, 5, 5])
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Optional[Any] = None,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        num_features = check_positive_int(num_features, "num_features")
        eps, momentum = check_eps(eps), check_momentum(momentum)
        # torch < 2.13 has no `bias` argument: then drop the bias after construction.
        extra = {"bias": bias} if _accepts_bias(nn.modules.batchnorm._NormBase) else {}
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, **extra)
        if affine and not bias and self.bias is not None:
            self.bias = None
        self.process_group = process_group
        # Groups (by id) in which this layer's channel count was checked against every rank.
        self._checked_groups: set[int] = set()

    def _check_input_dim(self, input: Tensor) -> None:
        check_float_tensor(input)
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects input of shape (N, C, *) with at least 2 dimensions "
                f"(got {input.dim()}D input of shape {list(input.shape)})"
            )
        if input.shape[1] != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) expects {self.num_features} channels in "
                f"dimension 1 (got input of shape {list(input.shape)})"
            )
        check_dtypes(
            input, weight=self.weight, bias=self.bias, running_mean=self.running_mean, running_var=self.running_var
        )

    def _sync_group(self):
        """The process group to synchronise over, or ``None`` when there is nothing to synchronise."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                "SyncBatchNorm: this process is not a member of the layer's process_group "
                "(new_group() returned NON_GROUP_MEMBER here); give each process a group it belongs to"
            )
        return group if _group_size(group) > 1 else None

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative average: the k-th batch gets weight 1/k
                momentum = 1.0 / float(self.num_batches_tracked)
        # Batch statistics in training, and in eval too when no running statistics exist.
        use_batch_stats = self.training or self.running_mean is None
        # Record into the running statistics only while training.
        track = self.training and self.track_running_stats
        running_mean = self.running_mean if track or not use_batch_stats else None
        running_var = self.running_var if track or not use_batch_stats else None
        group = self._sync_group() if self.training else None
        if group is None:
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, use_batch_stats, momentum, self.eps
            )
        if _uses_nccl_only(group) and input.device.type != "cuda":
            raise ValueError(
                f"SyncBatchNorm: the process group's backend is nccl, which needs CUDA tensors "
                f"(got input on {input.device}); use the gloo backend for CPU tensors"
            )
        if id(group) not in self._checked_groups:
            _check_same_channels(self.num_features, input.device, group, _group_size(group))
            self._checked_groups.add(id(group))
        return SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, momentum, group
        )

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.process_group is not None:
            text += f", process_group={self.process_group}"
        return text

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Optional[Any] = None) -> nn.Module:
        r"""Replace every BatchNorm layer in ``module`` by a :class:`SyncBatchNorm`.

        Converts ``torch.nn.BatchNorm1d/2d/3d``, ``torch.nn.SyncBatchNorm`` and
        normlib's ``BatchNorm1d/2d`` (a normlib :class:`SyncBatchNorm` is left as
        it is). The new layer takes over the old one's parameter objects (so
        optimizer state, ``requires_grad`` and sharing carry over), its running
        statistics buffers, ``eps``, ``momentum`` and training mode.

        Returns ``module`` with its BatchNorm children replaced in place, or a
        new :class:`SyncBatchNorm` when ``module`` itself is a BatchNorm.

        Example:
            >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8))
            >>> w = net[1].weight
            >>> net = SyncBatchNorm.convert_sync_batchnorm(net)
            >>> type(net[1]).__name__, net[1].weight is w
            ('SyncBatchNorm', True)
        """
        if isinstance(module, cls):
            return module
        if isinstance(module, nn.modules.batchnorm._BatchNorm):  # normlib's BatchNorm classes are subclasses
            for name in ("weight", "bias"):
                p = getattr(module, name, None)
                if isinstance(p, nn.parameter.UninitializedParameter):
                    raise ValueError(
                        f"convert_sync_batchnorm: {type(module).__name__}.{name} is not initialised "
                        f"yet (a lazy module); run one forward pass before converting"
                    )
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group,
                bias=getattr(module, "bias", None) is not None or not module.affine,
            )
            if module.affine:
                out.weight = module.weight
                out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
            for name, child in module.named_children():
                out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
            return out
        for name, child in module.named_children():
            new = cls.convert_sync_batchnorm(child, process_group)
            if new is not child:
                setattr(module, name, new)
        return module


def _uses_nccl_only(group) -> bool:
    """Whether the group's only backend is NCCL (which cannot move CPU tensors)."""
    try:
        name = torch.distributed.get_backend(group)
    except Exception:  # pragma: no cover - a backend that cannot name itself
        return False
    return str(name) == "nccl"
