"""torch's autocast policy for the norms, asked of torch itself.

Under ``torch.autocast`` torch runs some ops in float32 whatever the input's
dtype: on CUDA, ``layer_norm`` and ``group_norm`` (and ``rms_norm`` since
torch 2.13) are on autocast's float32 list, so ``torch.nn.LayerNorm`` returns
float32 for bfloat16 input; ``batch_norm`` and ``instance_norm`` are on no list
and keep the input's dtype; on CPU no norm is on a list. A drop-in has to do
the same, on every torch release and device.

Rather than copy torch's lists (which change between releases), normlib asks
the dispatcher whether torch registers an autocast kernel for the op on that
device (``Autocast<Device>``). For a norm, such a kernel is always the
float32 policy: every floating-point argument in float16 or bfloat16 is cast
to float32, the op runs with autocast off, and the result is float32.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

__all__ = ["any_autocast", "autocast_enabled", "autocast_float32", "runs_in_float32"]

# torch's op names for normlib's ops (what torch.nn.functional calls).
_ATEN = {
    "layer_norm": "aten::layer_norm",
    "rms_norm": "aten::rms_norm",
    "group_norm": "aten::group_norm",
    "batch_norm": "aten::batch_norm",
    "instance_norm": "aten::instance_norm",
}
_HALF = (torch.float16, torch.bfloat16)


def _has_autocast_kernel(op: str, device_type: str) -> bool:
    key = "Autocast" + {"cuda": "CUDA", "cpu": "CPU", "xpu": "XPU", "mps": "MPS", "hpu": "HPU"}.get(device_type, "")
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(_ATEN[op], key))
    except RuntimeError:  # an op this torch does not have (rms_norm before 2.4), or an unknown key
        return False


# Asked once, at import (a dictionary lookup later, also while torch.compile traces).
_FLOAT32_OPS = {(op, dev) for op in _ATEN for dev in ("cpu", "cuda", "xpu", "mps") if _has_autocast_kernel(op, dev)}


def _any_autocast_fallback() -> bool:  # torch releases without torch._C._is_any_autocast_enabled
    return any(autocast_enabled(d) for d in ("cpu", "cuda", "xpu", "mps"))


any_autocast = getattr(torch._C, "_is_any_autocast_enabled", _any_autocast_fallback)
"""Whether ``torch.autocast`` is on for any device: one call into torch, what a norm asks first."""


def autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def runs_in_float32(op: str, input: Tensor) -> bool:
    """Whether torch, under the autocast state in force, computes ``op`` on ``input`` in float32."""
    device_type = input.device.type
    return (op, device_type) in _FLOAT32_OPS and autocast_enabled(device_type)


def autocast_float32(op: str, input: Tensor, *others: Optional[Tensor]) -> tuple:
    """``(context, input, *others)`` as torch's autocast would hand them to ``op``.

    When autocast is on for ``input``'s device and torch runs ``op`` in float32
    there, float16/bfloat16 tensors come back cast to float32 and ``context``
    switches autocast off for the computation (as torch's own autocast kernel
    does); otherwise everything comes back as given, with a context that does
    nothing.

    Example:
        >>> ctx, x, w = autocast_float32("layer_norm", torch.randn(2, 4, dtype=torch.bfloat16), None)
        >>> x.dtype  # autocast is off here
        torch.bfloat16
    """
    if not isinstance(input, Tensor) or not runs_in_float32(op, input):
        return (contextlib.nullcontext(), input) + others
    cast = tuple(t.float() if t is not None and t.dtype in _HALF else t for t in (input,) + others)
    return (torch.autocast(input.device.type, enabled=False),) + cast
