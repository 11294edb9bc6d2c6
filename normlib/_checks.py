"""Argument checks shared by the functional ops and the modules.

Every check raises a ``TypeError`` or ``ValueError`` whose message names the
argument, what was expected and what came, so that a bad call fails at the
call site instead of deep inside a kernel with a confusing message.
"""

from __future__ import annotations

import math
import numbers
from typing import Literal, Optional, Sequence, Union, overload

import torch

from .numerics import acc_dtype, numel
from .errors import NormValueError, NormTypeError

_shape_t = Union[int, Sequence[int], torch.Size]


def check_float_tensor(x: object, name: str = "input") -> torch.Tensor:
    """``x`` must be a dense, real floating-point tensor."""
    if not isinstance(x, torch.Tensor):
        raise NormTypeError(f"{name} must be a torch.Tensor (got {type(x).__name__})")
    if x.is_nested:
        raise NormTypeError(
            f"{name} must be a regular (strided) tensor, not a nested tensor; normalize each "
            f"component (e.g. torch.stack of {name}.unbind() when they share a shape, or {name}.to_padded_tensor(0))"
        )
    if x.layout != torch.strided:
        raise NormTypeError(
            f"{name} must be a dense (strided) tensor (got layout {x.layout}); convert it with {name}.to_dense()"
        )
    if not x.is_floating_point():
        raise NormTypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 "
            f"or float64), got dtype {x.dtype}; convert it first, e.g. {name}.float()"
        )
    return x


_HALF = (torch.float16, torch.bfloat16)


def check_dtypes(input: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """torch.nn's dtype rule for a norm's parameters and buffers; returns ``input`` (checked before: a float tensor).

    Each tensor given (``weight=...``, ``running_mean=...``; ``None`` is
    skipped) must have the input's dtype, or be float32 when the input is
    float16/bfloat16 (mixed precision). That is what ``torch.nn``'s LayerNorm,
    GroupNorm, BatchNorm and InstanceNorm accept; where they raise a
    ``RuntimeError`` ("mixed dtype (CPU): ..."), this raises a ``TypeError``
    that names both dtypes and the way out.
    """
    for name, t in tensors.items():
        if t is None or t.dtype == input.dtype or (t.dtype == torch.float32 and input.dtype in _HALF):
            continue
        raise NormTypeError(
            f"input has dtype {input.dtype} but {name} has dtype {t.dtype}; the parameters and buffers "
            f"of a norm must have the input's dtype (or float32 for float16/bfloat16 input), as in "
            f"torch.nn: convert the module (module.to({input.dtype})) or the input (input.to({t.dtype}))"
        )
    return input


def check_eps(eps: object, name: str = "eps") -> float:
    """``eps`` must be a finite, non-negative real number.

    Under ``torch.compile(dynamic=True)`` a float argument may arrive as a
    symbolic ``torch.SymFloat`` whose value is unknown while tracing; it is
    passed through unchecked (a module checked its ``eps`` when it was built).
    """
    if type(eps) is float and 0.0 <= eps < math.inf:  # the common case, decided without the checks below
        return eps
    if isinstance(eps, (torch.SymFloat, torch.SymInt)) or torch.compiler.is_compiling():
        # While tracing, dynamo may hand a float argument over as a symbolic value
        # even where isinstance says float; math.isfinite cannot be traced on it.
        return eps  # type: ignore[return-value]  # a SymFloat/SymInt stands in for the float
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise NormTypeError(f"{name} must be a real number (got {type(eps).__name__})")
    try:
        eps = float(eps)
    except OverflowError:  # a number beyond float's range (10**400)
        raise NormValueError(f"{name} must be a finite number >= 0 (got {_shown(eps)})") from None
    if not math.isfinite(eps) or eps < 0:
        raise NormValueError(f"{name} must be a finite number >= 0 (got {eps})")
    return eps


@overload
def check_momentum(momentum: object, allow_none: Literal[False]) -> float: ...
@overload
def check_momentum(momentum: object, allow_none: bool = True) -> float | None: ...
def check_momentum(momentum: object, allow_none: bool = True) -> float | None:
    """``momentum`` must lie in [0, 1] (or be ``None`` for a cumulative average)."""
    if momentum is None:
        if allow_none:
            return None
        raise NormTypeError("momentum must be a number in [0, 1] (got None)")
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise NormTypeError(f"momentum must be a number in [0, 1] or None (got {type(momentum).__name__})")
    if not 0 <= momentum <= 1:  # type: ignore[operator]  # any Real compares; before float(): 10**400 overflows
        raise NormValueError(f"momentum must be in [0, 1] (got {_shown(momentum)})")
    return float(momentum)


def check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise NormTypeError(f"{name} must be a positive int (got {type(value).__name__} {value!r})")
    if value <= 0:
        raise NormValueError(f"{name} must be a positive int (got {value})")
    return int(value)


def _shown(value: object) -> str:
    """``value`` for a message: a number too large to print in full (10**5000) as its size."""
    try:
        if abs(float(value)) < 1e15:  # type: ignore[arg-type]
            return str(value)
    except (OverflowError, TypeError, ValueError):
        pass
    if isinstance(value, numbers.Integral):
        return f"a number of about {int(int(value).bit_length() * 0.30103) + 1} digits"
    return f"a number beyond float's range ({type(value).__name__})"


def normalize_shape(normalized_shape: _shape_t) -> tuple[int, ...]:
    """Turn an int or a sequence of ints into a tuple, rejecting anything else."""
    if type(normalized_shape) is tuple and normalized_shape and all(type(s) is int and s >= 0 for s in normalized_shape):
        return normalized_shape  # a module's own, already normalized
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        shape: tuple = (int(normalized_shape),)
    else:
        try:
            shape = tuple(normalized_shape)  # type: ignore[arg-type]  # mypy cannot rule int out through numbers.Integral
        except TypeError:
            raise NormTypeError(
                f"normalized_shape must be an int or a sequence of ints "
                f"(got {type(normalized_shape).__name__})"
            ) from None
    if len(shape) == 0:
        raise NormValueError("normalized_shape must have at least one dimension (got ())")
    if torch._C._get_tracing_state() is not None:  # torch.jit.trace hands x.shape's sizes over as 0-d int tensors
        shape = tuple(int(s) if isinstance(s, torch.Tensor) and s.dim() == 0 and not s.is_floating_point() else s
                      for s in shape)
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0:
            raise NormValueError(f"normalized_shape must hold non-negative ints (got {shape})")
    return tuple(int(s) for s in shape)


def check_trailing_shape(x: torch.Tensor, shape: tuple[int, ...]) -> None:
    """The last ``len(shape)`` dimensions of ``x`` must equal ``shape``."""
    if x.dim() < len(shape) or tuple(x.shape[-len(shape):]) != shape:
        raise NormValueError(
            f"normalized_shape={list(shape)} must match the last {len(shape)} "
            f"dimension(s) of input, but input has shape {list(x.shape)}"
        )


def check_param(
    p: torch.Tensor | None, name: str, shape: tuple[int, ...], input: torch.Tensor | None = None
) -> None:
    """An optional parameter or buffer must be a float tensor of exactly ``shape`` (on ``input``'s device)."""
    if p is None:
        return
    check_float_tensor(p, name)
    if tuple(p.shape) != shape:
        raise NormValueError(f"{name} must have shape {list(shape)} (got {list(p.shape)})")
    if input is not None:
        check_same_device(input, **{name: p})


def check_same_device(input: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Each tensor given must be on ``input``'s device (``None`` is skipped).

    A parameter left on the ``meta`` device (a model built under
    ``torch.device("meta")`` and only partly loaded) has no values: computing
    with it would silently leave it out, so it is refused like any other
    device mismatch.
    """
    for name, t in tensors.items():
        if t is not None and t.device != input.device:
            hint = (
                " (it was never loaded: a model built on the meta device needs load_state_dict(..., assign=True) "
                "or to_empty() and initialisation before use)"
                if t.device.type == "meta"
                else ""
            )
            raise NormValueError(
                f"{name} is on device {t.device} but input is on {input.device}{hint}; move the module or the "
                f"input so that both are on one device"
            )


def check_channels(x: torch.Tensor, what: str, min_dim: int = 2) -> int:
    """Input of a channel norm is (N, C, *); returns C."""
    if x.dim() < min_dim:
        raise NormValueError(
            f"{what} expects input of shape (N, C, *) with at least {min_dim} "
            f"dimensions (got {x.dim()}D input of shape {list(x.shape)})"
        )
    return x.shape[1]


# ---- the arguments of each norm -------------------------------------------------------------------
#
# Each check_*_args below first tries the call that normlib's modules make on every forward (a dense
# tensor of a common float dtype, the module's own normalized_shape tuple, its own parameters, a float
# eps): a few attribute reads accept it. Whatever that test does not accept at once goes through the
# checks one by one, which accept it or say what is wrong; the quick test only ever accepts calls that
# they accept too (tests/test_checks.py holds it to that).

_QUICK = True  # False: every call takes the full checks (tests/test_checks.py compares the two)
_COMMON = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MACHINE_EPS = {dt: torch.finfo(acc_dtype(dt)).eps for dt in _COMMON}  # RMSNorm's eps=None, looked up
_STRIDED = torch.strided
_INF = math.inf


def _common_row_call(input, normalized_shape, eps) -> bool:
    """A dense tensor of a common float dtype, normalized over its last dimension, as a module calls it."""
    return (_QUICK and type(normalized_shape) is tuple and len(normalized_shape) == 1 and type(normalized_shape[0]) is int
            and type(eps) is float and 0.0 <= eps < _INF and isinstance(input, torch.Tensor)
            and input.dtype in _COMMON and input.layout == _STRIDED and not input.is_nested and input.dim() > 0
            and input.shape[-1] == normalized_shape[0])


def _common_channel_call(input, eps) -> bool:
    """A dense ``(N, C, *)`` tensor of a common float dtype, as a channel norm's module calls it."""
    return (_QUICK and type(eps) is float and 0.0 <= eps < _INF and isinstance(input, torch.Tensor)
            and input.dtype in _COMMON and input.layout == _STRIDED and not input.is_nested and input.dim() >= 2)


def _fits(p, shape: tuple, input: torch.Tensor) -> bool:
    """``p`` is ``None``, or a dense tensor of ``shape`` on ``input``'s device whose dtype torch.nn's rule accepts."""
    return p is None or (isinstance(p, torch.Tensor) and (p.dtype == input.dtype or (
        p.dtype == torch.float32 and input.dtype in _HALF)) and p.layout == _STRIDED and not p.is_nested
        and p.shape == shape and p.device == input.device)


def _fits_any_dtype(p, shape: tuple, input: torch.Tensor) -> bool:
    """As :func:`_fits`, with any common float dtype (RMSNorm's rule)."""
    return p is None or (isinstance(p, torch.Tensor) and p.dtype in _COMMON and p.layout == _STRIDED
                         and not p.is_nested and p.shape == shape and p.device == input.device)


def check_layer_norm_args(input, normalized_shape, weight, bias, eps) -> tuple[tuple[int, ...], float]:
    """Validate :func:`~normlib.functional.layer_norm`'s arguments; returns ``(normalized_shape, eps)``."""
    # _common_row_call and _fits, written out: this runs on every LayerNorm call (see above)
    if (_QUICK and type(normalized_shape) is tuple and len(normalized_shape) == 1
            and type(normalized_shape[0]) is int and type(eps) is float and 0.0 <= eps < _INF
            and isinstance(input, torch.Tensor) and input.dtype in _COMMON and input.layout == _STRIDED
            and not input.is_nested and input.dim() > 0 and input.shape[-1] == normalized_shape[0]):
        dtype, device = input.dtype, input.device
        if ((weight is None or (isinstance(weight, torch.Tensor) and (weight.dtype == dtype or (
                weight.dtype == torch.float32 and dtype in _HALF)) and weight.layout == _STRIDED
                and not weight.is_nested and weight.shape == normalized_shape and weight.device == device))
                and (bias is None or (isinstance(bias, torch.Tensor) and (bias.dtype == dtype or (
                    bias.dtype == torch.float32 and dtype in _HALF)) and bias.layout == _STRIDED
                    and not bias.is_nested and bias.shape == normalized_shape and bias.device == device))):
            return normalized_shape, eps
    check_float_tensor(input)
    shape = normalize_shape(normalized_shape)
    check_trailing_shape(input, shape)
    check_param(weight, "weight", shape, input)
    check_param(bias, "bias", shape, input)
    check_dtypes(input, weight=weight, bias=bias)
    return shape, check_eps(eps)


def check_rms_norm_args(input, normalized_shape, weight, eps) -> tuple[tuple[int, ...], float]:
    """Validate :func:`~normlib.functional.rms_norm`'s arguments; returns ``(normalized_shape, eps)``, resolving
    ``eps=None`` to the machine epsilon of the compute dtype."""
    if eps is None and isinstance(input, torch.Tensor) and input.dtype in _COMMON:
        eps = _MACHINE_EPS[input.dtype]
    if _common_row_call(input, normalized_shape, eps) and _fits_any_dtype(weight, normalized_shape, input):
        return normalized_shape, eps
    check_float_tensor(input)
    shape = normalize_shape(normalized_shape)
    check_trailing_shape(input, shape)
    check_param(weight, "weight", shape, input)
    eps = torch.finfo(acc_dtype(input.dtype)).eps if eps is None else check_eps(eps)
    return shape, eps


def check_batch_norm_args(input, running_mean, running_var, weight, bias, training, momentum, eps) -> tuple[float, float]:
    """Validate :func:`~normlib.functional.batch_norm`'s arguments; returns ``(momentum, eps)``."""
    # _common_channel_call and _fits, written out: this runs on every BatchNorm call
    if (_QUICK and type(momentum) is float and 0.0 <= momentum <= 1.0 and type(eps) is float and 0.0 <= eps < _INF
            and isinstance(input, torch.Tensor) and input.dtype in _COMMON and input.layout == _STRIDED
            and not input.is_nested and input.dim() >= 2 and (running_mean is None) == (running_var is None)
            and (running_mean is not None or training) and (not training or input.numel() > input.shape[1])):
        dtype, device, shape = input.dtype, input.device, input.shape[1:2]
        for p in (weight, bias, running_mean, running_var):
            if p is not None and not (isinstance(p, torch.Tensor) and (p.dtype == dtype or (
                    p.dtype == torch.float32 and dtype in _HALF)) and p.layout == _STRIDED and not p.is_nested
                    and p.shape == shape and p.device == device):
                break
        else:
            return momentum, eps
    C = _check_channel_norm_args("batch_norm", input, running_mean, running_var, weight, bias)
    momentum = check_momentum(momentum, allow_none=False)
    eps = check_eps(eps)
    if not training and running_mean is None:
        raise NormValueError("batch_norm in evaluation (training=False) needs running_mean and running_var")
    if training and C and input.numel() // C == 1:
        raise NormValueError(
            f"batch_norm in training needs more than 1 value per channel to "
            f"estimate a variance (got input of shape {list(input.shape)})"
        )
    return momentum, eps


def _check_channel_norm_args(what, input, running_mean, running_var, weight, bias) -> int:
    """Shared checks of the (N, C, *) norms; returns ``C``."""
    check_float_tensor(input)
    C = check_channels(input, what, min_dim=3 if what == "instance_norm" else 2)
    _check_running(running_mean, "running_mean", C, input)
    _check_running(running_var, "running_var", C, input)
    if (running_mean is None) != (running_var is None):
        raise NormValueError("running_mean and running_var must be given together (got one of them)")
    check_param(weight, "weight", (C,), input)
    check_param(bias, "bias", (C,), input)
    check_dtypes(input, weight=weight, bias=bias, running_mean=running_mean, running_var=running_var)
    return C


def check_group_norm_args(input, num_groups, weight, bias, eps) -> tuple[int, float]:
    """Validate :func:`~normlib.functional.group_norm`'s arguments; returns ``(num_groups, eps)``."""
    if type(num_groups) is int and num_groups > 0 and _common_channel_call(input, eps):
        C = input.shape[1]
        if C % num_groups == 0 and _fits(weight, (C,), input) and _fits(bias, (C,), input):
            return num_groups, eps
    C = _check_channel_norm_args("group_norm", input, None, None, weight, bias)
    G = check_positive_int(num_groups, "num_groups")
    if C % G != 0:
        raise NormValueError(
            f"num_groups must divide the number of channels: got num_groups={G} "
            f"for input with {C} channels"
        )
    return G, check_eps(eps)


def check_instance_norm_args(input, running_mean, running_var, weight, bias, use_input_stats, momentum,
                             eps) -> tuple[float, float]:
    """Validate :func:`~normlib.functional.instance_norm`'s arguments; returns ``(momentum, eps)``."""
    _check_channel_norm_args("instance_norm", input, running_mean, running_var, weight, bias)
    momentum = check_momentum(momentum, allow_none=False)
    eps = check_eps(eps)
    if not use_input_stats and running_mean is None:
        raise NormValueError("instance_norm with use_input_stats=False needs running_mean and running_var")
    if use_input_stats and numel(input, range(2, input.dim())) == 1:
        raise NormValueError(
            f"instance_norm needs more than 1 spatial element per channel "
            f"(got input of shape {list(input.shape)})"
        )
    return momentum, eps


def _check_running(stat: Optional[torch.Tensor], name: str, num_channels: int, input: torch.Tensor) -> None:
    check_param(stat, name, (num_channels,), input)
