"""The fused path: LayerNorm, RMSNorm and residual-add + norm in Triton.

Public functions (all differentiable, all with a reference fallback):

* :func:`layer_norm` ``(x, weight, bias, eps)`` and :func:`rms_norm` ``(x, weight, eps)``
  normalize over the last dimension;
* :func:`add_layer_norm` ``(x, residual, weight, bias, eps)`` and
  :func:`add_rms_norm` ``(x, residual, weight, eps)`` return ``(y, residual_out)``
  with ``residual_out = x + residual`` rounded to the residual's dtype and
  ``y`` the norm of exactly that value — the two halves of a Pre-Norm
  residual step, in one pass over memory.

:func:`path_for` tells which implementation a call will use: ``"triton"``
(CUDA tensors, Triton installed), ``"triton-interpreter"`` (CPU tensors with
``TRITON_INTERPRET=1`` set before Triton was imported: slow, for testing),
or ``"reference"`` (everything else, including shapes and dtypes the kernels
do not cover). The reference path is :mod:`normlib.functional`, so every call
returns a correct answer on any machine.

Triton is imported lazily, on the first call that needs it; ``import normlib``
works without it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch
from torch import Tensor

from .. import functional as F
from .._autocast import autocast_float32, runs_in_float32
from .._checks import check_dtypes, check_eps, check_float_tensor, check_param
from . import _custom_ops  # registers normlib::fused_norm and its backward with torch.library

__all__ = [
    "HAS_TRITON",
    "path_for",
    "use_fused",
    "set_compile_mode",
    "compile_mode",
    "layer_norm",
    "rms_norm",
    "add_layer_norm",
    "add_rms_norm",
]

def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None
        return False


HAS_TRITON: bool = _triton_installed()

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF = (torch.float16, torch.bfloat16)


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _transformed() -> bool:
    """Whether a ``torch.func`` transform or a forward-mode AD level is active."""
    return bool(torch._C._are_functorch_transforms_active()) or torch.autograd.forward_ad._current_level >= 0


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def path_for(x: Tensor, residual: Optional[Tensor] = None) -> str:
    """Which implementation normalizes ``x`` (and adds ``residual``) over its last dimension.

    Returns ``"triton"``, ``"triton-interpreter"`` or ``"reference"``. The
    kernels cover float16/bfloat16/float32/float64 rows of up to 64 KiB
    (e.g. 16384 float32 or 32768 bfloat16 values); larger rows, other dtypes,
    tensors on other devices, and calls made while ``torch.compile`` traces
    (which compiles the reference math itself) use the reference path.

    Example:
        >>> path_for(torch.randn(4, 8))  # a CPU tensor, no interpreter
        'reference'
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor (got {type(x).__name__})")
    if residual is not None and not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor or None (got {type(residual).__name__})")
    if not HAS_TRITON or x.dim() == 0:
        return "reference"
    if _transformed():
        # torch.func transforms (vmap, grad, jvp, jacfwd, ...) and forward-mode AD see inside
        # the autograd Functions of the reference math; the kernels are opaque to them.
        return "reference"
    if x.is_cuda:
        if residual is not None and not residual.is_cuda:
            return "reference"
        where = "triton"
    elif x.device.type == "cpu" and (residual is None or residual.device.type == "cpu") and _interpreter_on():
        where = "triton-interpreter"
    else:
        return "reference"
    if x.dtype not in _KERNEL_DTYPES or (residual is not None and residual.dtype not in _KERNEL_DTYPES):
        return "reference"
    N = x.shape[-1]
    size = x.element_size() if residual is None else max(x.element_size(), residual.element_size())
    if N == 0 or N * size > 64 * 1024:
        return "reference"
    if _compiling() and _COMPILE_MODE == "reference":
        return "reference"
    return where


_COMPILE_MODES = ("reference", "kernels")
# Measured on an H100 (book/data/model_benchmark.json): a compiled GPT-2-small training step ran
# 1.58x eager when inductor generated its own norm kernels ("reference"), 1.26x when normlib's
# kernels stayed in the graph as opaque operators ("kernels"), which inductor cannot fuse with
# their neighbours. So "reference" is the default.
_COMPILE_MODE = "reference"


def set_compile_mode(mode: str) -> str:
    """What ``torch.compile`` does with normlib's norms on the tensors the kernels cover; returns the old mode.

    * ``"reference"`` (default): the compiler traces normlib's reference math
      and generates its own kernels for it, fusing the norm with its
      neighbours (a bias add, a cast, the residual add);
    * ``"kernels"``: the fused kernels stay in the compiled graph as the
      custom operators ``normlib::fused_norm`` / ``normlib::fused_norm_backward``.

    On an H100 a compiled GPT-2-small training step ran 1.58x eager PyTorch
    with ``"reference"`` and 1.26x with ``"kernels"`` (``book/data/model_benchmark.json``).

    Example:
        >>> old = set_compile_mode("reference"); _ = set_compile_mode(old)
    """
    global _COMPILE_MODE
    if mode not in _COMPILE_MODES:
        raise ValueError(f"mode must be one of {_COMPILE_MODES} (got {mode!r})")
    old, _COMPILE_MODE = _COMPILE_MODE, mode
    return old


def compile_mode() -> str:
    """The current :func:`set_compile_mode` setting."""
    return _COMPILE_MODE


def use_fused(x: Tensor, residual: Optional[Tensor] = None) -> bool:
    """Whether normlib's modules route ``x`` through the kernels: CUDA tensors the kernels cover.

    Modules never take the interpreter path on their own (it is for testing),
    and fall back to the reference math everywhere else.
    """
    return path_for(x, residual) == "triton"


def _check(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], eps,
           is_rms: bool = False) -> float:
    check_float_tensor(x)
    if x.dim() == 0:
        raise ValueError("input must have at least one dimension (got a 0-D tensor)")
    N = x.shape[-1]
    if residual is not None:
        check_float_tensor(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual must have the shape of input {list(x.shape)} (got {list(residual.shape)})")
    check_param(weight, "weight", (N,))
    check_param(bias, "bias", (N,))
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            # the kernels would be handed a pointer they cannot read
            raise ValueError(f"{name} must be on the input's device {x.device} (got {t.device})")
    if not is_rms:  # torch.nn.RMSNorm takes any weight dtype; LayerNorm the input's (or float32)
        check_dtypes(x, weight=weight, bias=bias)
    return check_eps(eps)


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fused(x, residual, weight, bias, eps, is_rms, out_dtype=None, w_plus_one=False, round_xhat=0):
    """The kernels, through the autograd Function when a gradient is wanted, directly otherwise.

    ``out_dtype``, ``w_plus_one`` and ``round_xhat`` select another library's
    rounding order (see :mod:`normlib.interop`).
    """
    from . import _functions, _kernels  # Triton is imported on first use only

    if _compiling():
        return _custom_ops.fused_norm(x, residual, weight, bias, eps, is_rms, out_dtype, w_plus_one, round_xhat)
    if _needs_grad(x, residual, weight, bias):
        return _functions.FusedNormFunction.apply(x, residual, weight, bias, eps, is_rms, out_dtype, w_plus_one, round_xhat)
    N = x.shape[-1]
    x, sx = _functions._rows(x, N)
    sr = 0
    if residual is not None:
        residual, sr = _functions._rows(residual, N)
    y, res_out, _, _ = _kernels.norm_fwd(
        x, residual, weight, bias, eps, is_rms, strides=(sx, sr),
        out_dtype=out_dtype, w_plus_one=w_plus_one, round_xhat=round_xhat,
    )
    return y, res_out



def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dimension; fused on GPU, reference elsewhere.

    Same result as ``normlib.functional.layer_norm(x, x.shape[-1:], weight, bias, eps)``.
    """
    ctx, x, weight, bias = autocast_float32("layer_norm", x, weight, bias)
    eps = _check(x, None, weight, bias, eps)
    with ctx:
        if path_for(x) == "reference":
            return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
        return _fused(x, None, weight, bias, eps, False)[0]


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: Optional[float] = None) -> Tensor:
    """RMSNorm over the last dimension; ``eps=None`` as in :func:`normlib.functional.rms_norm`."""
    ctx, x, weight = autocast_float32("rms_norm", x, weight)
    if eps is None:
        check_float_tensor(x)
        eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    eps = _check(x, None, weight, None, eps, is_rms=True)
    with ctx:
        if path_for(x) == "reference":
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        return _fused(x, None, weight, None, eps, True)[0]


def _to_float32(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.float() if t is not None and t.dtype in _HALF else t


def _autocast_out_dtype(op: str, x: Tensor) -> torch.dtype:
    """The dtype of the norm's output: float32 where torch's autocast runs ``op`` in float32, else ``x``'s."""
    return torch.float32 if x.dtype in _HALF and runs_in_float32(op, x) else x.dtype


def _reference_add(x: Tensor, residual: Tensor) -> Tensor:
    acc = torch.float64 if torch.float64 in (x.dtype, residual.dtype) else torch.float32
    return (x.to(acc) + residual.to(acc)).to(residual.dtype)


def add_layer_norm(
    x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5
) -> tuple[Tensor, Tensor]:
    """``residual_out = x + residual`` (in the residual's dtype) and ``y = LayerNorm(residual_out)``.

    Returns ``(y, residual_out)``; ``y`` has ``x``'s dtype. Gradients flow to
    ``x``, ``residual``, ``weight`` and ``bias`` through both outputs.
    """
    if isinstance(x, Tensor) and runs_in_float32("layer_norm", x):  # as torch's autocast: γ, β in float32
        weight, bias = _to_float32(weight), _to_float32(bias)
    eps = _check(x, residual, weight, bias, eps)
    out_dtype = _autocast_out_dtype("layer_norm", x)
    if path_for(x, residual) == "reference":
        res_out = _reference_add(x, residual)
        return F.layer_norm(res_out, x.shape[-1:], weight, bias, eps).to(out_dtype), res_out
    return _fused(x, residual, weight, bias, eps, False, out_dtype=out_dtype)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Optional[Tensor] = None, eps: Optional[float] = None
) -> tuple[Tensor, Tensor]:
    """``residual_out = x + residual`` (in the residual's dtype) and ``y = RMSNorm(residual_out)``."""
    if eps is None:
        check_float_tensor(x)
        eps = torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    if isinstance(x, Tensor) and runs_in_float32("rms_norm", x):
        weight = _to_float32(weight)
    eps = _check(x, residual, weight, None, eps, is_rms=True)
    out_dtype = _autocast_out_dtype("rms_norm", x)
    if path_for(x, residual) == "reference":
        res_out = _reference_add(x, residual)
        return F.rms_norm(res_out, x.shape[-1:], weight, eps).to(out_dtype), res_out
    return _fused(x, residual, weight, None, eps, True, out_dtype=out_dtype)
