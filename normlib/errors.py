"""The errors normlib raises for a bad argument: catchable as torch's would be.

torch answers many bad calls with a ``RuntimeError`` (a shape that does not
match ``normalized_shape``, a weight of the wrong size), where normlib checks
the arguments first and raises a ``ValueError`` or ``TypeError`` that names
the argument. Code written for torch that catches ``RuntimeError`` must catch
normlib's too, so each of normlib's argument errors is both.

Example:
    >>> import torch, normlib as nl
    >>> try:
    ...     nl.functional.layer_norm(torch.randn(2, 3), (4,))
    ... except RuntimeError as e:
    ...     print(type(e).__name__, isinstance(e, ValueError))
    NormValueError True
"""

__all__ = ["NormValueError", "NormTypeError"]


class NormValueError(ValueError, RuntimeError):
    """A bad value for an argument of normlib: a ``ValueError``, and a ``RuntimeError`` as torch's errors are."""


class NormTypeError(TypeError, RuntimeError):
    """An argument of the wrong type: a ``TypeError``, and a ``RuntimeError`` as torch's errors are."""
