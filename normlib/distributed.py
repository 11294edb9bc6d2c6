r"""BatchNorm whose statistics span every process of a data-parallel job.

In data-parallel training each process holds a slice of the batch.
:class:`SyncBatchNorm` normalizes every slice with the statistics of the
*whole* batch, exactly as one :class:`~normlib.BatchNorm2d` would on the
concatenated batch, using only ``torch.distributed``: CPU tensors with the
``gloo`` backend, CUDA tensors with ``nccl`` (or ``gloo``).

What travels, per layer and training step (``C`` channels, ``W`` processes):

* forward, one ``all_gather``: each rank sends ``2C + 11`` float64 numbers:
  an 11-number header (the status of its own input check, the layer's step
  count, the number of values per channel, the device kind, the input's number
  of dimensions and its first six sizes) and its per-channel means and sums of
  squared deviations. Every rank then merges the ``W``
  contributions with :func:`combine_moments`, the parallel-variance formula
  of Chan, Golub & LeVeque, so unequal and empty per-rank batches give the
  statistics of the concatenated batch.
* backward, one ``all_reduce`` of ``2C`` float64 numbers: the per-channel sums
  :math:`\sum dy` and :math:`\sum dy\,\hat x`, which the input gradient needs.
  The gradients of ``weight``/``bias`` stay local (the data-parallel wrapper,
  e.g. ``DistributedDataParallel``, reduces them like any other parameter's).

Failures are answered on every rank, within a bounded time, never by a hang
and never by normalizing with another step's batch:

* each rank checks its own input *before* the collective and, instead of
  raising alone (which would leave the others waiting), sends a status with
  its statistics; if any rank's input is bad, every rank raises at the same
  step, the bad rank with its own ``TypeError``/``ValueError`` and the others
  with a :class:`~normlib.distributed.SyncBatchNormError` naming that rank and what was wrong;
* each rank sends its step count of the layer too: ranks that drifted apart
  (one skipped a forward and went on) raise instead of mixing two steps;
* every collective waits at most ``timeout`` seconds (default 60): a rank that
  never arrives (it runs the layer in ``eval()`` mode, or stopped before it)
  makes the others raise a :class:`~normlib.distributed.SyncBatchNormError` that names the ranks
  missing and, where they recorded it, why (a rank records in the process
  group's store when its layer switches between training and evaluation);
* the first synchronised forward of each layer adds one small ``all_gather``
  that checks every rank built the layer with the same channel count.

In evaluation, without an initialised process group, or with a group of one
process, :class:`SyncBatchNorm` computes exactly what
:func:`normlib.functional.batch_norm` (and so :class:`~normlib.BatchNorm2d`)
computes.
"""

from __future__ import annotations

import datetime
import itertools
import math
import numbers
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from . import functional as F
from ._checks import _check_channel_norm_args, check_float_tensor
from .batchnorm import _buffer, _NormBase
from .numerics import acc_dtype, centre, for_backward, channel_view, momentum_for_step, numel, sum_of_squares, update_running
from .errors import NormValueError, NormTypeError

__all__ = [
    "SyncBatchNorm",
    "SyncBatchNormError",
    "SyncBatchNormFunction",
    "DistributedDataParallel",
    "combine_moments",
    "local_moments",
]

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


def _shifted_moments(x: Tensor) -> tuple[int, Tensor, Tensor, Tensor, Tensor]:
    """``(n, x0, xc, shifted_mean, m2)`` per channel of ``(N, C, *)`` input ``x``.

    The shifted two passes of :func:`normlib.numerics.shifted_moments`, kept
    as parts: ``x0`` (``(C,)``) is the channel's first value (0 for an empty
    channel), ``shifted_mean`` (``(C,)``) the mean of ``x - x0``, ``xc`` the
    centred input and ``m2`` (``(C,)``) the sum of squared deviations, all in
    ``x``'s dtype, so that the mean can be formed in float64 as
    ``x0 + shifted_mean`` without rounding it to ``x``'s dtype.
    """
    C = x.shape[1]
    dims = (0,) + tuple(range(2, x.dim()))
    n = numel(x, dims)
    if n == 0:
        zeros = x.new_zeros(C)
        return 0, zeros, x, zeros.clone(), zeros.clone()
    xc, x0, shifted_mean = centre(x, dims)
    return n, x0.reshape(C), xc, shifted_mean.reshape(C), sum_of_squares(xc, dims).reshape(C)


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
    check_float_tensor(x, "x")
    if x.dim() < 2:
        raise NormValueError(f"local_moments expects x of shape (N, C, *) (got {x.dim()}D x of shape {list(x.shape)})")
    x = x.to(acc_dtype(x.dtype))
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
    for name, t in (("count", count), ("mean", mean), ("m2", m2)):
        if not isinstance(t, Tensor):
            raise NormTypeError(f"combine_moments: {name} must be a torch.Tensor (got {type(t).__name__})")
    check_float_tensor(mean, "mean")
    check_float_tensor(m2, "m2")
    if count.dim() != 1 or mean.dim() != 2 or m2.shape != mean.shape or mean.shape[0] != count.shape[0]:
        raise NormValueError(
            f"combine_moments expects count (W,), mean (W, C) and m2 (W, C) "
            f"(got {list(count.shape)}, {list(mean.shape)}, {list(m2.shape)})"
        )
    if count.shape[0] == 0:
        raise NormValueError("combine_moments needs at least one part (got count of shape [0])")
    counts = count.tolist()
    if any(not math.isfinite(c) or c < 0 or c != int(c) for c in counts):
        raise NormValueError(f"combine_moments: count must hold non-negative whole numbers (got {counts})")
    nonempty = [c > 0 for c in counts]
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


class SyncBatchNormError(RuntimeError):
    """A failure of the process group as a whole: another rank's bad input, ranks at different steps, a timeout."""


# The per-step message of each rank: a fixed header, then C means and C sums of squared deviations.
_STATUS, _STEP, _COUNT, _DEVICE, _NDIM, _SHAPE = 0, 1, 2, 3, 4, 5
_SHAPE_FIELDS = 6  # the first dimensions of the input's shape, for the error message on other ranks
_HEADER = _SHAPE + _SHAPE_FIELDS
# What a rank found wrong with its own input (the status field).
_OK, _BAD_INPUT_TYPE, _BAD_DIMS, _BAD_CHANNELS, _BAD_DTYPE, _BAD_DEVICE, _BAD_OTHER = range(7)
_REASONS = {
    _BAD_INPUT_TYPE: "its input is not a floating-point tensor",
    _BAD_DIMS: "its input has fewer than 2 dimensions",
    _BAD_CHANNELS: "its input has the wrong number of channels",
    _BAD_DTYPE: "its input's dtype does not match the layer's parameters",
    _BAD_DEVICE: "its input is on another device than the layer",
    _BAD_OTHER: "its input was refused",
}

_DEFAULT_TIMEOUT = 60.0


def _group_size(group) -> int:
    return torch.distributed.get_world_size(group)


def _wait(work, timeout: float, what: str, label: str, group, step: Optional[int]) -> None:
    """Wait for a collective at most ``timeout`` seconds; on timeout raise naming who did not come."""
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:  # gloo raises on timeout; a closed connection raises too
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise SyncBatchNormError(
                f"SyncBatchNorm {label}: the {what} failed on rank {_rank(group)}"
                f"{_at(step)} ({e}); another process probably stopped"
            ) from e
        ok = False
    if ok is False:
        raise SyncBatchNormError(
            f"SyncBatchNorm {label}: rank {_rank(group)} waited {timeout:g} s in the {what}{_at(step)} and "
            f"not every rank of the process group arrived. {_absentees(group, label)} A rank that runs this "
            f"layer in eval() mode while others train, or that raised or returned before reaching it, leaves "
            f"the others waiting. The process group may be unusable after this error; restart the job. "
            f"(The wait is SyncBatchNorm's `timeout` argument.)"
        )


def _at(step: Optional[int]) -> str:
    return f" at step {step}" if step else ""


def _rank(group) -> int:
    return torch.distributed.get_rank(group)


def _store():
    """The process group's key-value store, where ranks leave notes for a diagnosis (or None)."""
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except Exception:  # a private accessor: without it there is only no diagnosis
        return None


def _note_key(label: str, global_rank: int) -> str:
    return f"normlib/SyncBatchNorm/{label}/rank{global_rank}"


def _leave_note(label: str, text: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(_note_key(label, torch.distributed.get_rank()), text)
        except Exception:  # the note is a courtesy; never let it break training
            pass


def _absentees(group, label: str) -> str:
    """What the other ranks last recorded about this layer, read without waiting."""
    store = _store()
    if store is None:
        return ""
    try:
        ranks = torch.distributed.get_process_group_ranks(group)
    except Exception:
        ranks = list(range(torch.distributed.get_world_size()))
    notes = []
    for r in ranks:
        key = _note_key(label, r)
        try:
            if store.check([key]):
                notes.append(f"rank {r}: {store.get(key).decode()}")
        except Exception:
            return ""
    return ("What the ranks recorded about this layer: " + "; ".join(notes) + ".") if notes else ""


def _status_of(error: Optional[BaseException], input: Any, num_features: int) -> int:
    if error is None:
        return _OK
    if not isinstance(input, Tensor) or not input.is_floating_point():
        return _BAD_INPUT_TYPE
    if input.dim() < 2:
        return _BAD_DIMS
    if input.shape[1] != num_features:
        return _BAD_CHANNELS
    if "dtype" in str(error):
        return _BAD_DTYPE
    if "device" in str(error):
        return _BAD_DEVICE
    return _BAD_OTHER


def _message(input: Any, num_features: int, step: int, status: int, error: Optional[BaseException],
             device: torch.device) -> Tensor:
    """This rank's header, with zeros for statistics (filled in by the caller when the input is good)."""
    out = torch.zeros(_HEADER + 2 * num_features, dtype=_WIRE, device=device)
    out[_STATUS], out[_STEP] = status, step
    if isinstance(input, Tensor):
        out[_DEVICE] = _device_code(input.device)
        out[_NDIM] = input.dim()
        shape = list(input.shape[:_SHAPE_FIELDS]) + [-1] * (_SHAPE_FIELDS - min(input.dim(), _SHAPE_FIELDS))
        out[_SHAPE : _SHAPE + _SHAPE_FIELDS] = torch.tensor(shape, dtype=_WIRE)
    return out


def _raise_for(table: Tensor, rank: int, num_features: int, label: str, step: Optional[int],
               error: Optional[BaseException]) -> None:
    """Every rank reads the same table and raises the same way (the bad rank with its own error)."""
    status = [int(s) for s in table[:, _STATUS].tolist()]
    bad = [r for r, s in enumerate(status) if s != _OK]
    if bad:
        described = []
        for r in bad:
            ndim = int(table[r, _NDIM])
            shape = [int(v) for v in table[r, _SHAPE : _SHAPE + min(ndim, _SHAPE_FIELDS)].tolist()]
            shape_text = str(shape) + (" ..." if ndim > _SHAPE_FIELDS else "")
            described.append(f"rank {r}: {_REASONS[status[r]]} (input of shape {shape_text})")
        summary = (
            f"SyncBatchNorm({num_features}) {label}{_at(step)}: "
            + "; ".join(described)
            + ". Every rank of the process group raises at this step, so that no rank waits for the others."
        )
        if error is not None:
            raise type(error)(f"{error} [{summary}]") from error
        raise SyncBatchNormError(summary)
    steps = [int(s) for s in table[:, _STEP].tolist()]
    if step and len(set(steps)) > 1:
        raise SyncBatchNormError(
            f"SyncBatchNorm {label}: the ranks are at different steps of this layer "
            f"(rank -> step: {dict(enumerate(steps))}; this is rank {rank}); a rank skipped a forward "
            f"(for example it caught an error and went on), and normalizing now would mix two steps' batches"
        )
    kinds = [_device_name(int(k)) for k in table[:, _DEVICE].tolist()]
    if len(set(kinds)) > 1:
        raise SyncBatchNormError(
            f"SyncBatchNorm {label}: the process group spans devices of different kinds "
            f"(rank -> device: {dict(enumerate(kinds))}; this is rank {rank}); put the model "
            f"and its input on the same kind of device in every process"
        )


def _check_same_channels(num_channels: int, device: torch.device, group, world_size: int, timeout: float,
                         label: str) -> None:
    """All-gather (C, device kind) once so that a mismatch raises on every rank instead of hanging."""
    header = torch.tensor([num_channels, _device_code(device)], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(header) for _ in range(world_size)]
    _wait(torch.distributed.all_gather(gathered, header, group=group, async_op=True), timeout,
          "check of the channel counts", label, group, None)
    table = torch.stack(gathered).tolist()
    _raise_if_mismatched(table, torch.distributed.get_rank(group))


def _raise_if_mismatched(table: list[list[int]], rank: int) -> None:
    """``table[r] = [channels, device kind]`` of rank ``r``: all ranks must agree."""
    channels = [int(row[0]) for row in table]
    kinds = [_device_name(int(row[1])) for row in table]
    if len(set(channels)) > 1:
        raise NormValueError(
            f"SyncBatchNorm: the processes of the group disagree on the number of channels "
            f"(rank -> channels: {dict(enumerate(channels))}; this is rank {rank}); every "
            f"process must build the same model"
        )
    if len(set(kinds)) > 1:
        raise NormValueError(
            f"SyncBatchNorm: the process group spans devices of different kinds "
            f"(rank -> device: {dict(enumerate(kinds))}; this is rank {rank}); put the model "
            f"and its input on the same kind of device in every process"
        )


class SyncBatchNormFunction(torch.autograd.Function):
    r"""Training-mode BatchNorm over the union of the batches of a process group.

    ``forward(input, weight, bias, running_mean, running_var, eps, momentum, group,
    timeout=60, step=0, error=None, label="", num_features=None)`` returns
    :math:`y = \gamma \odot (x - \mu)\,\mathrm{rstd} + \beta` with :math:`\mu`,
    :math:`\sigma^2` the statistics of every rank's batch together (one
    ``all_gather``), and records them into the running statistics (the unbiased
    variance, from the global count). The backward all-reduces :math:`\sum dy`
    and :math:`\sum dy\,\hat x` (one ``all_reduce``, only when the input needs a
    gradient) and returns

    .. math:: dx = \gamma\,\mathrm{rstd}\,\Big(dy - \frac{1}{n}\sum dy - \hat x\,\frac{1}{n}\sum dy\,\hat x\Big),

    the input gradient of one BatchNorm over all ``n`` values of the group;
    ``weight``/``bias`` get this rank's share of their gradients. Every rank of
    ``group`` must call it (an empty batch still takes part). It works with a
    group of any size, one included. ``error`` is this rank's own complaint
    about its input (an exception, or ``None``): it travels to the other ranks
    as a status, and every rank raises. ``step`` (when non-zero) must be the
    same on every rank. Each collective waits at most ``timeout`` seconds.
    """

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, group,
                timeout=_DEFAULT_TIMEOUT, step=0, error=None, label="", num_features=None):
        world_size = _group_size(group)
        C = num_features if num_features is not None else input.shape[1]
        device = running_mean.device if running_mean is not None else (
            weight.device if weight is not None else input.device)
        status = _status_of(error, input, C)
        mine = _message(input, C, step, status, error, device)
        if status == _OK:
            acc = acc_dtype(input.dtype)
            x = input.to(acc)
            n_local, x0, xc, shifted_mean, m2_local = _shifted_moments(x)
            mine[_COUNT] = n_local
            mine[_HEADER : _HEADER + C] = x0.to(_WIRE) + shifted_mean.to(_WIRE)  # (C,), not rounded to x's dtype
            mine[_HEADER + C :] = m2_local.to(_WIRE)
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        _wait(torch.distributed.all_gather(gathered, mine, group=group, async_op=True), timeout,
              "exchange of batch statistics", label, group, step)
        table = torch.stack(gathered)  # (W, header + 2C)
        _raise_for(table, _rank(group), C, label, step, error)
        counts, means, m2s = table[:, _COUNT], table[:, _HEADER : _HEADER + C], table[:, _HEADER + C :]
        n_t, mean64, m264 = combine_moments(counts, means, m2s)
        n = int(n_t.item())
        if n <= 1:
            raise NormValueError(
                f"SyncBatchNorm in training needs more than 1 value per channel across the "
                f"process group to estimate a variance (got {n}; per rank: "
                f"{[int(c) for c in counts.tolist()]})"
            )
        var64 = m264 / n
        if running_mean is not None:
            update_running(running_mean, mean64, momentum)
            update_running(running_var, m264 / (n - 1), momentum)

        # x - mean, as (x - x0) - (mean - x0): the global mean enters only as its (small)
        # distance from this rank's shift, formed in float64, so nothing large is rounded.
        # The forward starts from this rank's centred xc = (x - x0) - shifted_mean.
        shift64 = mean64 - x0.to(_WIRE)  # (C,)
        mean_shift = channel_view(shift64.to(acc), input.dim())
        rstd = channel_view(torch.rsqrt(var64 + eps).to(acc), input.dim())
        y = (xc - channel_view((shift64 - shifted_mean.to(_WIRE)).to(acc), input.dim())) * rstd
        if weight is not None:
            y = y * channel_view(weight.to(acc), input.dim())
        if bias is not None:
            y = y + channel_view(bias.to(acc), input.dim())
        ctx.save_for_backward(*for_backward(input, weight, channel_view(x0, input.dim()), mean_shift, rstd))
        ctx.n = n
        ctx.group = group
        ctx.timeout, ctx.step, ctx.label = timeout, step, label
        ctx.has_bias = bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return F._fresh(y, input.dtype)

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
            _wait(torch.distributed.all_reduce(both, group=ctx.group, async_op=True), ctx.timeout,
                  "backward's all_reduce", ctx.label, ctx.group, ctx.step)
            g_sum_dy = channel_view(both[:C].to(acc), input.dim())
            g_sum_dy_xhat = channel_view(both[C:].to(acc), input.dim())
            scale = rstd if weight is None else rstd * channel_view(weight.to(acc), input.dim())
            grad_input = (scale * (dyf - g_sum_dy / ctx.n - xhat * (g_sum_dy_xhat / ctx.n))).to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None, None, None, None, None


class SyncBatchNorm(_NormBase, nn.SyncBatchNorm):
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
    what is communicated and how failures are reported.

    A subclass of :class:`torch.nn.SyncBatchNorm` (and of normlib's BatchNorm
    base). Arguments, parameters (``weight``, ``bias``), buffers
    (``running_mean``, ``running_var``, ``num_batches_tracked``) and state_dict
    are those of :class:`torch.nn.SyncBatchNorm`. torch's
    ``DistributedDataParallel`` refuses every ``torch.nn.SyncBatchNorm`` on
    CPU (torch's own runs only on GPUs): on CPU wrap the model in
    :class:`normlib.distributed.DistributedDataParallel`, which lets normlib's through.

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
        timeout: (keyword-only) seconds each collective may wait for the other
            ranks before every waiting rank raises a :class:`~normlib.distributed.SyncBatchNormError`
            (default 60).

    Shape:
        - Input: ``(N, C, *)``, ``N`` may differ between processes and be 0.
        - Output: same shape as the input.

    Example:
        >>> # in each process, after torch.distributed.init_process_group("gloo", ...)
        >>> model = SyncBatchNorm.convert_sync_batchnorm(model)  # doctest: +SKIP
        >>> model = DistributedDataParallel(model)  # doctest: +SKIP
        >>> SyncBatchNorm(4)(torch.randn(8, 4, 5, 5)).shape  # no process group: plain BatchNorm
        torch.Size([8, 4, 5, 5])
        >>> isinstance(SyncBatchNorm(4), torch.nn.SyncBatchNorm)
        True
    """

    _labels = itertools.count(1)

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
        timeout: float = _DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype, bias=bias)
        if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not 0 < timeout < math.inf:
            raise NormValueError(f"timeout must be a positive number of seconds (got {timeout!r})")
        self.process_group = process_group
        self.timeout: float = float(timeout)
        # Layers are numbered in the order a process builds them: the same on every rank of a
        # data-parallel job, so that an error can say which layer on every rank ("#3").
        self._label: str = f"#{next(SyncBatchNorm._labels)}"
        self._sync_steps: int = 0  # synchronised training forwards of this layer so far
        self._noted_mode: Optional[bool] = None
        # Groups (by id) in which this layer's channel count was checked against every rank.
        self._checked_groups: set[int] = set()

    def _check_input_dim(self, input: Tensor) -> None:
        check_float_tensor(input)
        if input.dim() < 2:
            raise NormValueError(
                f"SyncBatchNorm expects input of shape (N, C, *) with at least 2 dimensions "
                f"(got {input.dim()}D input of shape {list(input.shape)})"
            )
        if input.shape[1] != self.num_features:
            raise NormValueError(
                f"SyncBatchNorm({self.num_features}) expects {self.num_features} channels in "
                f"dimension 1 (got input of shape {list(input.shape)})"
            )

    def _check_input(self, input: Tensor) -> None:
        """Everything :func:`normlib.functional.batch_norm` would refuse, checked before any collective."""
        self._check_input_dim(input)
        _check_channel_norm_args("batch_norm", input, self.running_mean, self.running_var, self.weight, self.bias)

    def _sync_group(self):
        """The process group to synchronise over, or ``None`` when there is nothing to synchronise."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            raise NormValueError(
                "SyncBatchNorm: this process is not a member of the layer's process_group "
                "(new_group() returned NON_GROUP_MEMBER here); give each process a group it belongs to"
            )
        return group if _group_size(group) > 1 else None

    def _note_mode(self, group) -> None:
        """Record in the group's store when this layer switches between training and evaluation."""
        if self._noted_mode is not self.training:
            self._noted_mode = self.training
            mode = "training" if self.training else "eval() mode"
            _leave_note(self._label, f"ran this layer in {mode} after {self._sync_steps} synchronised steps")

    def forward(self, input: Tensor) -> Tensor:
        group = self._sync_group()
        if group is not None:
            self._note_mode(group)
        if group is None or not self.training:
            self._check_input(input)
            return self._batch_norm(input)
        # Training in a group: find out what is wrong with this rank's input, but tell the
        # others in the collective instead of raising alone (which would leave them waiting).
        error: Optional[BaseException] = None
        try:
            self._check_input(input)
            if _uses_nccl_only(group) and input.device.type != "cuda":
                raise NormValueError(
                    f"SyncBatchNorm: the process group's backend is nccl, which needs CUDA tensors "
                    f"(got input on {input.device}); use the gloo backend for CPU tensors"
                )
        except (TypeError, ValueError) as e:
            error = e
        if id(group) not in self._checked_groups:
            device = self.running_mean.device if self.running_mean is not None else (
                input.device if isinstance(input, Tensor) else torch.device("cpu"))
            _check_same_channels(self.num_features, device, group, _group_size(group), self.timeout, self._label)
            self._checked_groups.add(id(group))
        self._sync_steps += 1
        track = self.track_running_stats
        # The batch is counted once every rank has accepted it (a failed step counts nowhere).
        if track:
            momentum = momentum_for_step(self.momentum, _buffer(self.num_batches_tracked, "num_batches_tracked"),
                                         uncounted=1)
        else:
            momentum = 0.0 if self.momentum is None else self.momentum
        y = SyncBatchNormFunction.apply(
            input, self.weight, self.bias,
            self.running_mean if track else None, self.running_var if track else None,
            self.eps, momentum, group, self.timeout, self._sync_steps, error, self._label, self.num_features,
        )
        if track:
            with torch.no_grad():
                _buffer(self.num_batches_tracked, "num_batches_tracked").add_(1)
        return y

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.process_group is not None:
            text += f", process_group={self.process_group}"
        if self.timeout != _DEFAULT_TIMEOUT:
            text += f", timeout={self.timeout:g}"
        return text

    @classmethod
    def convert_sync_batchnorm(cls, module: nn.Module, process_group: Optional[Any] = None, *,
                               timeout: float = _DEFAULT_TIMEOUT) -> nn.Module:
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
        if not isinstance(module, nn.Module):
            raise NormTypeError(f"convert_sync_batchnorm: module must be a torch.nn.Module (got {type(module).__name__})")
        if isinstance(module, cls):
            return module
        if isinstance(module, nn.modules.batchnorm._BatchNorm):  # normlib's BatchNorm classes are subclasses
            for name in ("weight", "bias"):
                p = getattr(module, name, None)
                if isinstance(p, nn.parameter.UninitializedParameter):
                    raise NormValueError(
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
                timeout=timeout,
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
                out.add_module(name, cls.convert_sync_batchnorm(child, process_group, timeout=timeout))
            return out
        for name, child in module.named_children():
            new = cls.convert_sync_batchnorm(child, process_group, timeout=timeout)
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


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch's ``DistributedDataParallel``, letting normlib's :class:`SyncBatchNorm` train on CPU.

    torch's wrapper refuses any ``torch.nn.SyncBatchNorm`` in a model on the
    CPU ("SyncBatchNorm layers only work with GPU modules"), because torch's
    own layer needs a GPU. normlib's :class:`SyncBatchNorm` is a subclass of it
    that works on CPU tensors over gloo, so this subclass refuses only torch's
    own layer there. Everything else is torch's ``DistributedDataParallel``,
    with the same arguments.

    Example:
        >>> # in each process, after torch.distributed.init_process_group("gloo", ...)
        >>> ddp = DistributedDataParallel(SyncBatchNorm.convert_sync_batchnorm(model))  # doctest: +SKIP
    """

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        for layer in module.modules():
            if isinstance(layer, nn.SyncBatchNorm) and not isinstance(layer, SyncBatchNorm):
                if self.device_type == "cpu":
                    raise NormValueError(
                        "torch.nn.SyncBatchNorm layers only work with GPU modules; on CPU convert the model "
                        "with normlib.SyncBatchNorm.convert_sync_batchnorm, which works over gloo"
                    )
