"""Where x̂ is rounded before γ multiplies it: the ``round_xhat`` switch of the kernels, in PyTorch ops.

Other libraries round the normalized value at different points (see
:mod:`normlib.interop`): ``0`` keeps x̂ in the accumulation dtype, ``1``
rounds it to the input's dtype first (Llama, Gemma-style RMSNorms), ``2``
to γ's dtype. The kernels take the same code as a compile-time constant;
the plain-PyTorch paths (the custom operator's branch for devices without
the kernels, and the differentiable backward) use this function.
"""

from __future__ import annotations

import torch
from torch import Tensor


def round_xhat(xhat: Tensor, mode: int, x_dtype: torch.dtype, weight) -> Tensor:
    """``xhat`` rounded as ``mode`` says, returned in its own dtype."""
    if mode == 1:
        return xhat.to(x_dtype).to(xhat.dtype)
    if mode == 2:
        return xhat.to(weight.dtype).to(xhat.dtype)
    return xhat
