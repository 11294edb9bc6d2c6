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
non-powers of two, 3-D and 4-D), dtypes (float32, float64, and bfloat16 for
the forward pass), weight and bias present or absent, and adversarial inputs
(values far from zero with a small spread, constant rows, non-contiguous
tensors, a large ``eps``) — and compares the output, and the gradients when
your output is differentiable, with a float64 evaluation of
:mod:`normlib.functional` on the same inputs. It also checks that the input
was not modified in place and that the output has the input's shape and
dtype.

Every checker returns a :class:`CheckReport`. By default
(``raise_on_failure=True``) it raises ``AssertionError`` describing the first
case that failed in plain words: the input, what was expected, what came and
by how much. With ``raise_on_failure=False`` it only returns the report;
``report.passed`` says whether every case passed and ``print(report)`` lists
them.

Tolerances follow the dtype: ``|got - expected| <= atol + rtol * |expected|``
with ``atol = rtol = 1e-9`` for float64, ``1e-5`` for float32 (``1e-4`` for
gradients) and ``4e-2`` for bfloat16 (a few of its rounding steps). Where the
mean is ``κ`` times larger than the spread, any float arithmetic loses about
``log10 κ`` digits, so those cases allow ``32 κ`` units in the last place;
computing the variance as ``E[x²] - E[x]²`` loses all of them and still fails.

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
