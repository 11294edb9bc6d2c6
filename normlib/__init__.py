"""normlib: normalization layers for PyTorch, written to be read.

Reference modules with torch.nn's arguments and state_dict names, their math in
:mod:`normlib.functional`, the same formulas on lists in :mod:`normlib.pure` (the book's
live cells run it in the browser), and a fused Triton path in :mod:`normlib.ops`.
Importing normlib needs neither a GPU nor Triton, and has no side effects.
"""

from . import functional, interop, ops, pure, testing
from .attention import MultiHeadAttention
from .batchnorm import BatchNorm1d, BatchNorm2d, InstanceNorm1d, InstanceNorm2d
from .distributed import SyncBatchNorm
from .errors import NormTypeError, NormValueError
from .normalization import GroupNorm, LayerNorm, RMSNorm
from .interop.swap import SwapReport, swap_norms, unswap_norms
from .transformer import TransformerBlock

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "functional",
    "pure",
    "ops",
    "interop",
    "testing",
    "swap_norms",
    "unswap_norms",
    "SwapReport",
    "NormValueError",
    "NormTypeError",
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "SyncBatchNorm",
    "MultiHeadAttention",
    "TransformerBlock",
]
