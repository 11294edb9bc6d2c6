"""Which implementation computes a norm: the one routing decision of normlib.

Three implementations can compute a call:

* ``"fused"``: normlib's Triton kernels (CUDA tensors; CPU tensors only
  through Triton's interpreter, and only inside :func:`force_path`);
* ``"native"``: torch's own ATen op, with a check of its statistics
  (:mod:`normlib.ops.native`) that hands the call to the reference whenever
  torch's single-pass statistics could be wrong for it;
* ``"reference"``: :mod:`normlib.functional`, the readable math of the book.

:func:`route` decides, from the call's device, dtypes, shape, grad mode,
compile and transform state, and from a crossover table measured on a
machine and committed with its provenance (``crossover.json`` beside this
file, written by ``python -m normlib.benchmark.crossover``). Every other
question in normlib about "which code runs?" (:func:`normlib.ops.path_for`,
:func:`normlib.ops.use_fused`, :mod:`normlib.interop`, the custom operator's
choice between kernels and plain PyTorch) is answered by calling it.

Example:
    >>> route("layer_norm", torch.randn(4, 8))
    'native'
    >>> with force_path("reference"):
    ...     route("layer_norm", torch.randn(4, 8))
    'reference'
"""

from __future__ import annotations

import bisect
import contextlib
import importlib.util
import json
import os
import threading
from pathlib import Path as _FilePath
from typing import Iterator, Literal, Optional

import torch
from torch import Tensor

from .._autocast import autocast_enabled
from . import native
from ..errors import NormValueError

__all__ = ["FUSED", "NATIVE", "REFERENCE", "PATHS", "OPS", "route", "plan", "force_path", "forced_path",
           "kernels_cover", "kernels_run_on", "wants_grad", "crossover_table", "HAS_TRITON"]

FUSED, NATIVE, REFERENCE = "fused", "native", "reference"
Path = Literal["fused", "native", "reference"]  #: what force_path takes
CompileMode = Literal["reference", "kernels"]  #: what set_compile_mode and use_compile_mode take
PATHS = (FUSED, NATIVE, REFERENCE)
# How the kernels are entered, decided with the path (see plan): as the custom operator while
# torch.compile traces, through the autograd Function where a gradient is wanted, directly otherwise.
FUSED_OP, FUSED_GRAD = "fused:op", "fused:grad"
PLANS = (FUSED, FUSED_GRAD, FUSED_OP, NATIVE, REFERENCE)
PATH_OF = {FUSED: FUSED, FUSED_GRAD: FUSED, FUSED_OP: FUSED, NATIVE: NATIVE, REFERENCE: REFERENCE}

# The ops normlib routes ("batch_norm_eval": BatchNorm with its running statistics, which has its own
# crossover), and which of them torch has a native op for whose statistics normlib can check
# (RMSNorm where torch has _fused_rms_norm, which returns its rstd: see normlib.ops.native).
OPS = ("layer_norm", "rms_norm", "group_norm", "batch_norm", "batch_norm_eval", "instance_norm")
_ROW_OPS = ("layer_norm", "rms_norm")  # over the last dimension: what the kernels compute
_HAS_NATIVE = ("layer_norm", "group_norm", "batch_norm", "batch_norm_eval", "instance_norm") + (
    ("rms_norm",) if native.HAS_RMS_NORM else ())
_NATIVE_DTYPES = (torch.float32, torch.float64)

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTERPRETER_WRONG = {torch.float64, torch.bfloat16}  # an input and residual pair the interpreter computes wrong
MAX_ROW_BYTES = 64 * 1024  # the widest row the kernels take: they hold one row in registers/shared memory


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # e.g. sys.modules["triton"] = None
        return False


HAS_TRITON: bool = _triton_installed()

class _Setting:
    """A process-wide setting: a base value, and blocks that set it while they run, in any thread.

    The value is kept in a module global of this module (``name``), not a
    ContextVar: ``torch.compile`` reads a global (and guards on it). It is
    always the value of the innermost block still open, else the base; the
    open blocks are kept under one lock, so that blocks of several threads may
    end in any order and the global still ends as it began.
    """

    _lock = threading.Lock()

    def __init__(self, name: str, base) -> None:
        self.name, self.base = name, base
        self.open: list[tuple[object, object]] = []  # (token, value) of every open block, oldest first
        globals()[name] = base

    def _publish(self) -> None:
        globals()[self.name] = self.open[-1][1] if self.open else self.base

    @contextlib.contextmanager
    def block(self, value) -> Iterator[None]:
        token = object()
        with self._lock:
            self.open.append((token, value))
            self._publish()
        try:
            yield
        finally:
            with self._lock:
                self.open[:] = [entry for entry in self.open if entry[0] is not token]
                self._publish()

    def set_base(self, value):
        """Set the value outside every block; returns the old base."""
        with self._lock:
            old, self.base = self.base, value
            self._publish()
        return old


_FORCED: Optional[str] = None  # kept by _FORCE
_FORCE = _Setting("_FORCED", None)


def force_path(path: Path):
    """Run every normlib call inside the block on ``path`` wherever it can compute that call.

    ``"fused"`` takes the kernels wherever they cover the call, CPU tensors
    included when ``TRITON_INTERPRET=1`` was set before Triton was imported;
    ``"native"`` takes torch's op (with its statistics checked) for the norms
    that have one; ``"reference"`` always runs :mod:`normlib.functional`. A
    call the forced path cannot compute takes the reference. For tests and
    for comparing implementations; nests, and holds for the whole process
    while the block runs (the innermost open block wins; blocks in several
    threads may end in any order).

    Example:
        >>> with force_path("reference"):
        ...     route("layer_norm", torch.randn(2, 4))
        'reference'
    """
    if path not in PATHS:
        raise NormValueError(f"path must be one of {PATHS} (got {path!r})")
    return _FORCE.block(path)


def forced_path() -> Optional[str]:
    """The path :func:`force_path` imposes here, or ``None``."""
    return _FORCED


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_run_on(x: Tensor) -> bool:
    """Whether the kernels can run on ``x``'s device at all: CUDA, or CPU through the interpreter when forced.

    :func:`force_path` ``("reference")`` or ``("native")`` answers ``False``:
    then even the custom operator computes with plain PyTorch.
    """
    forced = _FORCED
    if not HAS_TRITON or forced in (NATIVE, REFERENCE):
        return False
    if x.is_cuda:
        return True
    return forced == FUSED and x.device.type == "cpu" and _interpreter_on()


def kernels_cover(x: Tensor, residual: Optional[Tensor] = None) -> bool:
    """Whether the kernels compute rows of ``x`` (and ``residual``): dtype and row size.

    float16/bfloat16/float32/float64 rows of at most 64 KiB (16384 float32
    or 32768 bfloat16 values), never empty.
    """
    return _covered("layer_norm", x, residual, None, None, True)


# ---- the crossover table -------------------------------------------------------------------------

_TABLE_FILE = _FilePath(__file__).with_name("crossover.json")


def _load_table() -> dict:
    try:
        data = json.loads(_TABLE_FILE.read_text())
    except (OSError, ValueError):  # an installation without it: torch's op wherever normlib has one
        return {}
    return data.get("routes", {})


def _bands(table: dict) -> dict:
    """``{(device, op, grad): (lower bounds, paths)}``: the table as route reads it, one bisect a call."""
    out = {}
    for dev, ops in table.items():
        for op, dirs in ops.items():
            for key, bands in dirs.items():
                if bands:
                    out[(dev, op, key == "backward")] = (tuple(int(lo) for lo, _ in bands), tuple(str(p) for _, p in bands))
    return out


def _band_path(bands: tuple, numel: int) -> str:
    """The path of the last band whose lower bound is at most ``numel`` (the first band below them all)."""
    los, paths = bands
    return paths[max(bisect.bisect_right(los, numel) - 1, 0)]


_BANDS = _bands(_load_table())


def crossover_table() -> dict:
    """The committed crossover table: ``{device: {op: {"forward"|"backward": [(min_numel, path), ...]}}}``.

    In each band list the last band whose ``min_numel`` is at most the
    call's element count names the path; ``"backward"`` applies to calls that
    record a graph for a gradient. Its provenance is in ``crossover.json``.
    """
    table: dict = {}
    for (dev, op, grad), (los, paths) in _BANDS.items():
        table.setdefault(dev, {}).setdefault(op, {})["backward" if grad else "forward"] = list(zip(los, paths))
    return table


# ---- the decision ----------------------------------------------------------------------------------

_COMPILE_MODES = ("reference", "kernels")
# Measured on an H100 (book/data/model_benchmark.json): a compiled GPT-2-small training step ran
# 1.58x eager when inductor generated its own norm kernels ("reference"), 1.26x when normlib's
# kernels stayed in the graph as opaque operators ("kernels"), which inductor cannot fuse with
# their neighbours. So "reference" is the default.
_COMPILE_MODE: str = "reference"  # kept by _MODE
_MODE = _Setting("_COMPILE_MODE", "reference")


def _check_mode(mode: str) -> str:
    if mode not in _COMPILE_MODES:
        raise NormValueError(f"mode must be one of {_COMPILE_MODES} (got {mode!r})")
    return mode


def set_compile_mode(mode: CompileMode) -> str:
    """What ``torch.compile`` does with normlib's norms on the tensors the kernels cover; returns the old mode.

    * ``"reference"`` (default): the compiler traces normlib's reference math
      and generates its own kernels for it, fusing the norm with its
      neighbours (a bias add, a cast, the residual add);
    * ``"kernels"``: the fused kernels stay in the compiled graph as the
      custom operators ``normlib::fused_norm`` / ``normlib::fused_norm_backward``.

    A process-wide setting (inside a :func:`use_compile_mode` block, the
    block's mode holds until it ends). On an H100 a compiled GPT-2-small
    training step ran 1.58x eager PyTorch with ``"reference"`` and 1.26x with
    ``"kernels"`` (``book/data/model_benchmark.json``).

    Example:
        >>> old = set_compile_mode("reference"); _ = set_compile_mode(old)
    """
    return _MODE.set_base(_check_mode(mode))


def use_compile_mode(mode: CompileMode):
    """:func:`set_compile_mode` for the duration of a block: nests, and blocks in several threads may end in
    any order (the setting then ends as it began).

    Example:
        >>> with use_compile_mode("kernels"):
        ...     compile_mode()
        'kernels'
    """
    return _MODE.block(_check_mode(mode))


def compile_mode() -> str:
    """The compile mode in force here: the innermost :func:`use_compile_mode` block's, else :func:`set_compile_mode`'s."""
    return _COMPILE_MODE


def wants_grad(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor]) -> bool:
    """Whether autograd records this call: grad mode is on and a tensor given requires a gradient."""
    return torch.is_grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad)
                                        or (weight is not None and weight.requires_grad)
                                        or (bias is not None and bias.requires_grad))


def route(
    op: str,
    x: Tensor,
    residual: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *,
    rows: bool = True,
) -> str:
    """The implementation that computes ``op`` on ``x``: ``"fused"``, ``"native"`` or ``"reference"``.

    Args:
        op: one of ``OPS`` (``"layer_norm"``, ``"rms_norm"``, ``"group_norm"``, ``"batch_norm"``,
            ``"batch_norm_eval"``, ``"instance_norm"``).
        x: the (already validated) input.
        residual: for the add + norm of a Pre-Norm step (row norms only).
        weight, bias: the parameters (their dtypes and whether they want a gradient count).
        rows: whether the norm is over the last dimension alone (the only one the kernels compute).

    The rules, in order:

    1. under a ``torch.func`` transform or forward-mode AD, or while
       ``torch.jit.trace`` records: the reference, whose autograd Functions
       carry the derivatives the transforms need and which branches on no value;
    2. inside :func:`force_path`, the forced path wherever it can compute the
       call (while ``torch.compile`` traces: the kernels only in compile mode
       ``"kernels"``, torch's op with its check never);
    3. while ``torch.compile`` traces: the kernels as custom operators in
       compile mode ``"kernels"`` where they cover the call, else the
       reference, which the compiler fuses with its neighbours;
    4. CUDA: the kernels wherever they cover the call (row norms, kernel
       dtypes, rows up to 64 KiB, γ in the input's dtype or float32), else the
       reference; where the crossover table has a ``cuda`` entry (measured on
       a GPU), torch's op (checked) for the sizes it names;
    5. elsewhere: the crossover table for this device, op, grad mode and
       element count; without an entry, torch's native op where normlib has
       one, else the reference; under autocast, the reference (which follows
       torch's autocast policy op by op).

    It is :func:`plan`'s answer without the way the kernels are entered.
    """
    return PATH_OF[plan(op, x, residual, weight, bias, rows=rows)]


def plan(
    op: str,
    x: Tensor,
    residual: Optional[Tensor] = None,
    weight: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
    *,
    rows: bool = True,
    autocast: Optional[bool] = None,
    grad: Optional[bool] = None,
) -> str:
    """:func:`route`'s decision, with the way into the kernels decided too: one of ``PLANS``.

    ``"fused:op"`` (the custom operator, while ``torch.compile`` traces),
    ``"fused:grad"`` (the autograd Function, where a gradient is wanted),
    ``"fused"`` (the kernels called directly), ``"native"`` or ``"reference"``.
    Every normlib call asks this once and runs what it names; nothing below
    decides again. ``autocast``: whether any autocast is on, where the caller
    already asked (``None``: ask); ``grad``: whether a gradient is wanted, for
    a caller that does not hand over its parameters (``None``: read it off
    the tensors given).

    The common calls (CPU and CUDA, nothing forced, nothing traced) are
    decided in this one function, its helpers written out (:func:`wants_grad`,
    ``_native_takes``, the crossover table's bands): each call into a
    Python function costs about as much as the question it answers
    (``tests/test_routing.py`` holds the written-out rule to
    ``_native_takes``).
    """
    if (torch._C._are_functorch_transforms_active() or torch.autograd.forward_ad._current_level >= 0
            or torch._C._get_tracing_state() is not None):
        return REFERENCE
    if _FORCED is not None or torch.compiler.is_compiling():
        return _plan_forced_or_compiling(op, x, residual, weight, bias, rows, grad)
    if grad is None:  # wants_grad
        grad = torch.is_grad_enabled() and (x.requires_grad or (residual is not None and residual.requires_grad)
                                            or (weight is not None and weight.requires_grad)
                                            or (bias is not None and bias.requires_grad))
    if x.is_cuda:
        if not (HAS_TRITON and _covered(op, x, residual, weight, bias, rows)):
            return REFERENCE
        bands = _BANDS.get(("cuda", op, grad))  # measured on a GPU: small calls may be done sooner by torch's op
        if bands is not None and _band_path(bands, x.numel()) == NATIVE and _native_takes(op, x, residual, weight):
            return NATIVE
        return FUSED_GRAD if grad else FUSED
    numel = x.numel()
    # _native_takes
    if not (op in _HAS_NATIVE and x.is_cpu and x.dtype in _NATIVE_DTYPES and numel > 0
            and (residual is None or residual.dtype == x.dtype)
            and (op != "rms_norm" or weight is None or weight.dtype == x.dtype)):
        return REFERENCE
    if autocast is None:
        autocast = autocast_enabled("cpu")
    if autocast:
        return REFERENCE
    bands = _BANDS.get(("cpu", op, grad))
    if bands is None:
        return NATIVE
    return bands[1][0] if len(bands[1]) == 1 else _band_path(bands, numel)  # one band: no lookup, no frame


def _plan_forced_or_compiling(op: str, x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                              bias: Optional[Tensor], rows: bool, grad: Optional[bool]) -> str:
    """:func:`plan` inside :func:`force_path` or while ``torch.compile`` traces (rules 2 and 3 of :func:`route`)."""
    forced, compiling = _FORCED, torch.compiler.is_compiling()
    if forced is not None:
        if forced == FUSED and _covered(op, x, residual, weight, bias, rows) and kernels_run_on(x):
            if compiling:
                return REFERENCE if _COMPILE_MODE == "reference" else FUSED_OP
            wanted = wants_grad(x, residual, weight, bias) if grad is None else grad
            return FUSED_GRAD if wanted else FUSED
        if forced == NATIVE and _native_takes(op, x, residual, weight) and not compiling:
            return NATIVE
        return REFERENCE
    kernels = _COMPILE_MODE == "kernels" and kernels_run_on(x) and _covered(op, x, residual, weight, bias, rows)
    return FUSED_OP if kernels else REFERENCE


def _native_takes(op: str, x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor] = None) -> bool:
    """Whether torch's op computes this call as normlib would: non-empty float32/float64 CPU tensors, or
    CUDA tensors of the kernels' dtypes (where the crossover table sends small calls to torch's op).

    With float16/bfloat16 input torch's CPU LayerNorm returns γ's and β's
    gradients far less accurately than normlib's float32 accumulation
    (chapter 07 measures it: γ's gradient off by more than 1e-3, the
    reference's by less than 1e-4), so those take the reference. RMSNorm
    also needs γ in the input's dtype (torch's op would promote the output),
    and an add + norm a residual of the input's dtype: the sum, in the
    residual's dtype, is what torch's op would normalize with γ/β of the
    input's (torch refuses the mix, the reference computes it).
    """
    if op not in _HAS_NATIVE or x.numel() == 0 or (op == "rms_norm" and weight is not None and weight.dtype != x.dtype):
        return False
    if x.is_cuda:
        return x.dtype in KERNEL_DTYPES
    return x.is_cpu and x.dtype in _NATIVE_DTYPES and (residual is None or residual.dtype == x.dtype)


def _covered(op: str, x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
             rows: bool) -> bool:
    """Whether the kernels compute this call: a row norm, rows they hold, γ/β as they read them.

    One function, not several: it runs on every CUDA call.
    """
    if not (rows and op in _ROW_OPS and x.dim() > 0 and x.dtype in KERNEL_DTYPES):
        return False
    size, N, device = x.element_size(), x.shape[-1], x.device
    if residual is not None:
        if residual.dtype not in KERNEL_DTYPES or residual.device != device:
            return False
        if not x.is_cuda and {x.dtype, residual.dtype} == _INTERPRETER_WRONG:
            return False  # Triton 3.7.1's interpreter turns float64 into bfloat16 wrongly (a GPU converts it right)
        size = max(size, residual.element_size())
    if not 0 < N * size <= MAX_ROW_BYTES:
        return False
    for t in (weight, bias):
        if t is not None and (t.dtype not in (x.dtype, torch.float32) or t.dim() != 1 or t.device != device):
            return False
    return True
