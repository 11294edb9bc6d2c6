r"""Checkers for your own implementations of the book's layers.

Write a layer yourself, then ask whether it computes what PyTorch's does::

    import normlib as nl

    def my_layer_norm(x, normalized_shape, weight, bias, eps):
        dims = tuple(range(-len(normalized_shape), 0))
        mean = x.mean(dims, keepdim=True)
        var = ((x - mean) ** 2).mean(dims, keepdim=True)
        y = (x - mean) / torch.sqrt(var + eps)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    report = nl.testing.check_layer_norm(my_layer_norm)   # raises AssertionError if a case fails
    print(report)                                          # every case that was run

Each checker calls your implementation on many cases — shapes (one element,
non-powers of two, 3-D and 4-D), dtypes (float32 and float64, forward and
backward; bfloat16 and float16, forward only), weight and bias present or
absent (each alone too), and adversarial inputs (values far from zero with a
small spread, constant rows, non-contiguous tensors, a large ``eps``; and in
16 bits the mistakes of chapter 05d: statistics kept in the input's dtype,
squares that overflow float16, an ``eps`` that float16 rounds to 0) — and
compares the output, and the gradients when your output is differentiable,
with a float64 evaluation of :mod:`normlib.functional` on the same inputs. It
also checks that the input was not modified in place and that the output has
the input's shape and dtype.

Every checker returns a :class:`CheckReport`. By default
(``raise_on_failure=True``) it raises ``AssertionError`` describing the first
case that failed in plain words: the input, what was expected, what came and
by how much. With ``raise_on_failure=False`` it only returns the report;
``report.passed`` says whether every case passed and ``print(report)`` lists
them.

Tolerances come from the one rule of ``normlib.testing.tolerance``,
2(r·u_out + κλ√n·u_acc), applied to each output element with what it is made
of: the roundings (up to ``r = 8``, one per step of the formula written out in
the input's dtype) relative to ``|x̂·γ| + |β|``, the error of the statistics
(sums of at most the input's ``n`` elements, in float32 for 16-bit input,
times the input's condition number κ = ``|mean| / spread``) relative to
``|γ|``. Every correct implementation tried stays below a quarter of that;
computing the variance as ``E[x²] - E[x]²``, or in 16 bits without an up-cast
to float32, is off by many times more.

The checkers draw their inputs from their own seeded generator: they do not
touch PyTorch's global random state, and they give the same report every run.
"""

from ._report import CaseResult, CheckReport
from .batch_norm import check_batch_norm
from .group_norm import check_group_norm
from .row_norms import check_layer_norm, check_rms_norm

# The public home of the report classes (pickles and the API page name it, not the private module).
CaseResult.__module__ = CheckReport.__module__ = __name__

__all__ = [
    "check_layer_norm",
    "check_rms_norm",
    "check_group_norm",
    "check_batch_norm",
    "CheckReport",
    "CaseResult",
]
