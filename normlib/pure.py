r"""The book's normalizations in pure Python: nested lists of numbers, the standard library only.

Each function is its chapter's formula written out step by step, on lists instead of tensors,
so it runs where torch does not: the book's live cells run this module in the reader's
browser (Pyodide, Python compiled to WebAssembly), with no server. It is the slow,
readable twin of :mod:`normlib.functional`, and is tested against it in float64
(``tests/test_pure.py``).

A tensor is a nested list: ``[[1, 3], [5, 7], [9, 11]]`` has shape ``(3, 2)``. Every
function checks its arguments and names the one that is wrong, with normlib's errors
(:mod:`normlib.errors`, which needs nothing either).

Two rules make a result the same float on every machine and every Python:

- sums are ``math.fsum`` (correctly rounded), never the built-in ``sum``, whose
  result for floats changed in Python 3.12 (it became compensated), so the notebook's
  Python and the browser's would round differently;
- squares are ``d * d``, not ``d ** 2`` (``**`` goes through the C library's ``pow``).

The one exception is :func:`softmax` (and :func:`attention`), whose ``math.exp`` comes from
the C library and may differ in the last bit between libraries: the book prints it rounded.

Example:
    >>> layer_norm([[1, 3], [5, 7], [9, 11]], eps=0.0)
    [[-1.0, 1.0], [-1.0, 1.0], [-1.0, 1.0]]
    >>> batch_norm([[1, 3], [5, 7], [9, 11]], training=True, eps=0.0)[0]
    [-1.224744871391589, -1.224744871391589]
"""

from __future__ import annotations

import math
import sys
from typing import TypeGuard

from .errors import NormTypeError, NormValueError

__all__ = [
    "shape",
    "mean",
    "variance",
    "layer_norm",
    "rms_norm",
    "batch_norm",
    "BatchNorm",
    "group_norm",
    "instance_norm",
    "softmax",
    "matmul",
    "transpose",
    "attention",
]

Number = float  # an int or a float (not a bool); what the functions return is always float


# ----------------------------------------------------------------------------------------------
# arguments


def _is_number(v: object) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def shape(x: object, name: str = "x") -> tuple[int, ...]:
    """The shape of a nested list of numbers, checking that it is one: every list at a level
    has the same length and holds numbers or lists, not both.

    >>> shape([[1, 3], [5, 7], [9, 11]])
    (3, 2)
    """
    if _is_number(x):
        return ()
    if not isinstance(x, (list, tuple)):
        raise NormTypeError(f"{name} must be a number or a nested list of numbers (got {type(x).__name__})")
    if not x:
        return (0,)
    shapes = [shape(v, f"{name}[{i}]") for i, v in enumerate(x)]
    for i, s in enumerate(shapes):
        if s != shapes[0]:
            raise NormValueError(f"{name} is not rectangular: {name}[0] has shape {shapes[0]}, {name}[{i}] has {s}")
    return (len(x),) + shapes[0]


def _check_eps(eps: object, name: str = "eps") -> float:
    if not _is_number(eps):
        raise NormTypeError(f"{name} must be a real number (got {type(eps).__name__})")
    if not (math.isfinite(eps) and eps >= 0):
        raise NormValueError(f"{name} must be a finite number >= 0 (got {eps})")
    return float(eps)


def _check_vector(v: object, name: str, n: int) -> list[float] | None:
    """An optional γ or β: ``None`` or ``n`` numbers."""
    if v is None:
        return None
    s = shape(v, name)
    if s != (n,) or not isinstance(v, (list, tuple)):
        raise NormValueError(f"{name} must hold {n} numbers, one per normalized feature (got shape {s})")
    return [float(u) for u in v]


def _rows(x: object, name: str, min_dim: int = 1) -> tuple[int, ...]:
    s = shape(x, name)
    if len(s) < min_dim:
        raise NormValueError(f"{name} must have at least {min_dim} dimension(s) (got shape {s})")
    if 0 in s:
        raise NormValueError(f"{name} has no values to normalize (shape {s})")
    return s


def _map_rows(f, x):
    """``f`` applied to every innermost list of ``x`` (its rows), the nesting kept."""
    if x and _is_number(x[0]):
        return f(x)
    return [_map_rows(f, v) for v in x]


def _flat(x) -> list[float]:
    """The numbers of a nested list (or one number), in order."""
    if _is_number(x):
        return [float(x)]
    return [v for u in x for v in _flat(u)]


def _like(x, values):
    """The numbers of ``values``, in order, nested as ``x`` is."""
    it = iter(values)

    def fill(u):
        return next(it) if _is_number(u) else [fill(v) for v in u]

    return fill(x)


# ----------------------------------------------------------------------------------------------
# statistics


def mean(values) -> float:
    """The mean of a list of numbers (a correctly rounded sum, divided by their count)."""
    values = _flat(values)
    if not values:
        raise NormValueError("mean of no values")
    return math.fsum(values) / len(values)


def variance(values) -> float:
    """The biased variance (divide by ``n``): the mean of the squared deviations from the mean,
    never ``E[x²] − E[x]²``, which cancels when the mean is large."""
    values = _flat(values)
    mu = mean(values)
    return math.fsum((v - mu) * (v - mu) for v in values) / len(values)


# ----------------------------------------------------------------------------------------------
# the normalizations


def layer_norm(x, weight=None, bias=None, eps: float = 1e-5):
    r"""LayerNorm over the last dimension: each row normalized on its own.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \odot \gamma + \beta

    Args:
        x: a row of numbers, or rows of rows ``(*, n)``.
        weight: γ, ``n`` numbers, or ``None`` (ones).
        bias: β, ``n`` numbers, or ``None`` (zeros).
        eps: added to the variance, ``>= 0``.

    >>> layer_norm([1, 3], eps=0.0)
    [-1.0, 1.0]
    """
    n = _rows(x, "x")[-1]
    gamma, beta, eps = _check_vector(weight, "weight", n), _check_vector(bias, "bias", n), _check_eps(eps)

    def one_row(row):
        mu = mean(row)  # the mean of the row
        std = math.sqrt(variance(row) + eps)  # from its biased variance
        xhat = [(v - mu) / std for v in row]  # standardized
        return _affine(xhat, gamma, beta)

    return _map_rows(one_row, x)


def rms_norm(x, weight=None, eps: float | None = None):
    r"""RMSNorm over the last dimension: each row divided by its root mean square; no mean is
    subtracted and there is no β.

    .. math:: y = \frac{x}{\sqrt{\frac{1}{n}\sum_i x_i^2 + \epsilon}} \odot \gamma

    Args:
        x: a row of numbers, or rows of rows ``(*, n)``.
        weight: γ, ``n`` numbers, or ``None`` (ones).
        eps: added to the mean square; ``None`` is float64's machine epsilon, as torch's
            ``rms_norm`` uses for float64 input.

    >>> rms_norm([3, 4], eps=0.0)
    [0.848528137423857, 1.131370849898476]
    """
    n = _rows(x, "x")[-1]
    gamma = _check_vector(weight, "weight", n)
    eps = sys.float_info.epsilon if eps is None else _check_eps(eps)

    def one_row(row):
        ms = math.fsum(v * v for v in row) / len(row)  # the mean square
        return _affine([v / math.sqrt(ms + eps) for v in row], gamma, None)

    return _map_rows(one_row, x)


def _affine(xhat: list[float], gamma: list[float] | None, beta: list[float] | None) -> list[float]:
    if gamma is not None:
        xhat = [g * h for g, h in zip(gamma, xhat)]
    if beta is not None:
        xhat = [h + b for h, b in zip(xhat, beta)]
    return [float(h) for h in xhat]


def _channels(x, name: str) -> tuple[int, int]:
    """``(N, C)`` of an ``(N, C, *)`` input."""
    s = _rows(x, name, min_dim=2)
    return s[0], s[1]


def batch_norm(x, running_mean=None, running_var=None, weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5):
    r"""BatchNorm of an ``(N, C)`` or ``(N, C, *)`` input: each channel normalized over the batch
    (and its positions).

    In training the statistics come from the batch (mean and biased variance); if running
    statistics are given, they are updated in place, as torch does,

    .. math:: \hat\mu \leftarrow (1 - m)\,\hat\mu + m\,\mu_B, \qquad
              \hat\sigma^2 \leftarrow (1 - m)\,\hat\sigma^2 + m\,\tfrac{n}{n-1}\sigma_B^2

    (the stored variance is the unbiased one, over the ``n`` values of a channel). In
    evaluation (``training=False``) the running statistics are used instead.

    Args:
        x: ``(N, C)`` or ``(N, C, *)`` nested lists.
        running_mean, running_var: lists of ``C`` numbers (updated in place in training), or ``None``.
        weight, bias: γ and β, ``C`` numbers each, or ``None``.
        training: use (and record) the batch's statistics.
        momentum: the weight of the new batch in the running average, in [0, 1].
        eps: added to the variance, ``>= 0``.
    """
    N, C = _channels(x, "x")
    gamma, beta, eps = _check_vector(weight, "weight", C), _check_vector(bias, "bias", C), _check_eps(eps)
    for name, buf in (("running_mean", running_mean), ("running_var", running_var)):
        if buf is not None and (not isinstance(buf, list) or shape(buf, name) != (C,)):
            raise NormValueError(f"{name} must be a list of {C} numbers, one per channel (it is updated in place)")
    if not isinstance(training, bool):
        raise NormTypeError(f"training must be True or False (got {type(training).__name__})")
    if not _is_number(momentum) or not 0 <= momentum <= 1:
        raise NormValueError(f"momentum must be a number in [0, 1] (got {momentum!r})")
    if not training and (running_mean is None or running_var is None):
        raise NormValueError("evaluation (training=False) needs running_mean and running_var")
    # channel c's values: every sample's channel c, with all its positions
    values = [[v for sample in x for v in _flat(sample[c])] for c in range(C)]
    means, stds = [], []
    for c, vals in enumerate(values):
        if training:
            n = len(vals)
            if n < 2:
                raise NormValueError(f"x: training needs more than 1 value per channel (got shape {shape(x)})")
            mu, var = mean(vals), variance(vals)
            if running_mean is not None:
                running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mu
            if running_var is not None:
                running_var[c] = (1 - momentum) * running_var[c] + momentum * var * n / (n - 1)
        else:
            mu, var = float(running_mean[c]), float(running_var[c])
        means.append(mu)
        stds.append(math.sqrt(var + eps))
    g = gamma or [1.0] * C
    b = beta or [0.0] * C

    def channel(c, u):  # channel c of one sample, standardized, then scaled and shifted
        return _like(u, [g[c] * ((v - means[c]) / stds[c]) + b[c] for v in _flat(u)])

    return [[channel(c, sample[c]) for c in range(C)] for sample in x]


class BatchNorm:
    """A BatchNorm layer: γ and β, running statistics, and a training and an evaluation mode,
    with torch's ``BatchNorm1d`` names and defaults.

    ``momentum=None`` keeps the cumulative average of every batch seen (the weight of batch
    ``k`` is ``1/k``).

    >>> bn = BatchNorm(1, momentum=1.0)
    >>> bn([[1.0], [2.0], [4.0], [7.0]])[0]
    [-1.0910884120486357]
    >>> bn.running_mean, bn.running_var
    ([3.5], [7.0])
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True):
        if not isinstance(num_features, int) or isinstance(num_features, bool) or num_features < 1:
            raise NormValueError(f"num_features must be a positive int (got {num_features!r})")
        if momentum is not None and (not _is_number(momentum) or not 0 <= momentum <= 1):
            raise NormValueError(f"momentum must be a number in [0, 1] or None (got {momentum!r})")
        self.num_features, self.eps, self.momentum = num_features, _check_eps(eps), momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight = [1.0] * num_features if affine else None
        self.bias = [0.0] * num_features if affine else None
        self.running_mean = [0.0] * num_features if track_running_stats else None
        self.running_var = [1.0] * num_features if track_running_stats else None
        self.num_batches_tracked = 0
        self.training = True

    def train(self, mode: bool = True) -> "BatchNorm":
        self.training = mode
        return self

    def eval(self) -> "BatchNorm":
        return self.train(False)

    def __call__(self, x):
        factor = 0.0  # the weight of this batch in the running statistics
        if self.training and self.track_running_stats:
            self.num_batches_tracked += 1
            factor = 1 / self.num_batches_tracked if self.momentum is None else self.momentum
        # batch statistics in training, and in evaluation too when there are no running ones
        use_batch = self.training or not self.track_running_stats
        return batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, use_batch, factor, self.eps)

    def __repr__(self) -> str:
        return (f"BatchNorm({self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats})")


def group_norm(x, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
    r"""GroupNorm of an ``(N, C, *)`` input: the ``C`` channels split into ``num_groups`` groups of
    consecutive channels; each group of each sample is normalized over its channels and
    positions, then γ and β are applied per channel. ``num_groups=1`` is LayerNorm over
    ``(C, *)``; ``num_groups=C`` is InstanceNorm.

    Args:
        x: ``(N, C)`` or ``(N, C, *)`` nested lists.
        num_groups: a positive int that divides ``C``.
        weight, bias: γ and β, ``C`` numbers each, or ``None``.
        eps: added to the variance, ``>= 0``.
    """
    N, C = _channels(x, "x")
    if not isinstance(num_groups, int) or isinstance(num_groups, bool) or num_groups < 1:
        raise NormValueError(f"num_groups must be a positive int (got {num_groups!r})")
    if C % num_groups:
        raise NormValueError(f"num_groups={num_groups} must divide the number of channels C={C}")
    gamma, beta, eps = _check_vector(weight, "weight", C), _check_vector(bias, "bias", C), _check_eps(eps)
    g = gamma or [1.0] * C
    b = beta or [0.0] * C
    per = C // num_groups
    out = []
    for sample in x:
        channels = []
        for k in range(num_groups):
            group = range(k * per, (k + 1) * per)
            vals = [v for c in group for v in _flat(sample[c])]
            mu, std = mean(vals), math.sqrt(variance(vals) + eps)
            for c in group:
                channels.append(_like(sample[c], [g[c] * ((v - mu) / std) + b[c]
                                                  for v in _flat(sample[c])]))
        out.append(channels)
    return out


def instance_norm(x, weight=None, bias=None, eps: float = 1e-5):
    """InstanceNorm of an ``(N, C, L, *)`` input: each channel of each sample normalized over its
    positions (:func:`group_norm` with one channel per group), with the input's statistics."""
    return group_norm(x, _rows(x, "x", min_dim=3)[1], weight, bias, eps)


# ----------------------------------------------------------------------------------------------
# attention


def softmax(row):
    """Softmax of a row of numbers (the largest subtracted first, so ``exp`` cannot overflow);
    of rows of rows, along the last dimension."""
    _rows(row, "row")

    def one_row(r):
        top = max(r)
        e = [math.exp(v - top) if top != -math.inf else math.nan for v in r]
        total = math.fsum(e)
        return [v / total for v in e]

    return _map_rows(one_row, row)


def transpose(a):
    """The transpose of a matrix (a list of rows)."""
    s = shape(a, "a")
    if len(s) != 2:
        raise NormValueError(f"a must be a matrix, a list of rows (got shape {s})")
    return [[float(a[i][j]) for i in range(s[0])] for j in range(s[1])]


def matmul(a, b):
    """The matrix product ``a @ b`` of an ``(n, k)`` and a ``(k, m)`` matrix, each entry a correctly
    rounded sum."""
    sa, sb = shape(a, "a"), shape(b, "b")
    if len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0]:
        raise NormValueError(f"a @ b needs an (n, k) and a (k, m) matrix (got shapes {sa} and {sb})")
    cols = transpose(b) if sb[1] else []
    return [[math.fsum(u * v for u, v in zip(row, col)) for col in cols] for row in a]


def attention(q, k, v, attn_mask=None):
    r"""Scaled dot-product attention of one head: ``softmax(q kᵀ / √hs) v``.

    Args:
        q: ``(T, hs)`` queries; k: ``(S, hs)`` keys; v: ``(S, hv)`` values.
        attn_mask: ``None``, or ``(T, S)`` booleans, ``True`` where a query may **not** look at a key
            (the convention of :class:`normlib.MultiHeadAttention` and :class:`torch.nn.MultiheadAttention`);
            a masked score becomes −∞. A query with every key masked gets zero weights (and a zero
            output), as in :class:`normlib.MultiHeadAttention` (torch's softmax would give NaN).

    Returns:
        ``(output, weights)``: ``(T, hv)`` and the ``(T, S)`` attention weights.
    """
    sq, sk, sv = shape(q, "q"), shape(k, "k"), shape(v, "v")
    if len(sq) != 2 or len(sk) != 2 or len(sv) != 2:
        raise NormValueError(f"q, k and v must be matrices (got shapes {sq}, {sk}, {sv})")
    if sq[1] != sk[1] or sk[0] != sv[0] or 0 in sq + sk + sv:
        raise NormValueError(f"q (T, hs), k (S, hs) and v (S, hv) do not fit (got {sq}, {sk}, {sv})")
    hs = sq[1]
    scores = [[s / math.sqrt(hs) for s in row] for row in matmul(q, transpose(k))]  # (T, S)
    if attn_mask is not None:
        if not (isinstance(attn_mask, (list, tuple)) and len(attn_mask) == sq[0]
                and all(isinstance(row, (list, tuple)) and len(row) == sk[0] for row in attn_mask)
                and all(isinstance(m, bool) for row in attn_mask for m in row)):
            raise NormValueError(f"attn_mask must be {sq[0]} rows of {sk[0]} booleans (True where a query may not look "
                             f"at a key), one row per query (got {attn_mask!r:.60})")
        scores = [[-math.inf if m else s for s, m in zip(row, mrow)] for row, mrow in zip(scores, attn_mask)]
    weights = [[0.0] * len(row) if all(s == -math.inf for s in row) else softmax(row)
               for row in scores]  # (T, S): a query with no key left attends to nothing
    return matmul(weights, v), weights  # (T, hv), (T, S)
