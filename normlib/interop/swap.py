"""Run a model's norm layers through normlib's fused kernels, in place, changing nothing else.

:func:`swap_norms` does not replace modules or tensors. Each recognised norm
module (see :mod:`normlib.interop`) keeps its identity, parameters (so their
``requires_grad``, sharing between modules and optimizer state), buffers,
hooks, ``state_dict`` and any forward set on the instance; only its class
changes, to a subclass of its class with the same name whose ``forward`` runs
the fused kernels where they apply and calls the class's own ``forward``
everywhere else. One such subclass is made per class and kind, and reused.

Why a class and not a ``forward`` set on the instance: an instance attribute
would have to hold its module (a reference cycle that keeps the weights alive
until ``gc.collect()``), would be shared by a ``copy.copy`` of the module (which
would then compute with the original's parameters), and would hide the class's
forward from ``torch.jit.script``. A method of the class has none of these
problems, and a forward already set on the instance keeps running first.

What was on the instance stays there and keeps running: accelerate's offload
hooks (a forward on the instance that calls ``module._old_forward``) get the
swapped forward inside them; any other forward set on the instance is a
wrapper normlib cannot get inside, so such a module is left alone and
reported. :func:`unswap_norms` restores the class and whatever the swap
rebound; swapping twice is a no-op.
"""

from __future__ import annotations

import copyreg
import functools
import inspect
import threading
import types
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from ..errors import NormTypeError
from . import kinds, recognition

__all__ = ["swap_norms", "unswap_norms", "SwapReport"]


@dataclass
class SwapReport:
    """What :func:`swap_norms` did: swapped modules by class, and what it left alone and why."""

    swapped: Counter[str] = field(default_factory=Counter)  # class name -> count
    kinds: dict[str, str] = field(default_factory=dict)  # class name -> normlib kind(s), comma-separated
    already: Counter[str] = field(default_factory=Counter)  # class name -> count swapped before
    left: dict[str, tuple[int, str]] = field(default_factory=dict)  # class name -> (count, reason)

    def __post_init__(self):
        for name in ("swapped", "already"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(n, int) for k, n in value.items()):
                raise NormTypeError(f"{name} must map class names to counts (got {value!r})")
            setattr(self, name, Counter(value))
        if not isinstance(self.kinds, dict) or not all(isinstance(v, str) for v in self.kinds.values()):
            raise NormTypeError(f"kinds must map class names to kind names (got {self.kinds!r})")
        if not isinstance(self.left, dict) or not all(
            isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str)
            for v in self.left.values()
        ):
            raise NormTypeError(f"left must map class names to (count, reason) pairs (got {self.left!r})")

    @property
    def count(self) -> int:
        """Modules that run through normlib now (swapped by this call or before)."""
        return sum(self.swapped.values()) + sum(self.already.values())

    def __str__(self) -> str:
        lines = [f"swap_norms: {sum(self.swapped.values())} norm module(s) swapped"
                 + (f", {sum(self.already.values())} already swapped" if self.already else "")]
        for name, n in sorted(self.swapped.items()):
            lines.append(f"  swapped  {n:4d} x {name} ({self.kinds[name]})")
        for name, n in sorted(self.already.items()):
            lines.append(f"  already  {n:4d} x {name}")
        for name, (n, why) in sorted(self.left.items()):
            lines.append(f"  left     {n:4d} x {name}: {why}")
        return "\n".join(lines)


# ---- the swapped classes --------------------------------------------------------------------------


class _Swapped:
    """Base of every class :func:`swap_norms` makes (a marker: it adds no state)."""

    __slots__ = ()
    _normlib_class: type[nn.Module]  # set in each swapped class's namespace by _swapped_class


_CLASSES: dict = {}  # (original class, kinds.Binding) -> its swapped subclass
_LOCK = threading.RLock()  # swap_norms and unswap_norms change modules' classes one call at a time
_SLOTS = "_normlib_slots"  # instance attribute: forwards on the instance the swap rebound, to restore


def _input_name(original) -> Optional[str]:
    """The name of ``x`` when the forward's signature is exactly ``forward(self, x)`` (every kind's forward is)."""
    try:
        params = list(inspect.signature(original).parameters.values())
    except (TypeError, ValueError):
        return None
    if len(params) != 2 or any(p.kind != p.POSITIONAL_OR_KEYWORD or p.default is not p.empty for p in params):
        return None
    return params[1].name if params[1].name.isidentifier() and not params[1].name.startswith("_normlib") else None


# The swapped forward, written out for the class's own `forward(self, x)` (every kind's forward has
# that signature): a call by keyword works as before, and no *args/**kwargs are packed and unpacked
# on the way (on a CPU, where every call goes to the class's forward, that is most of what a swap
# costs). Any other signature gets the general version, which takes one positional argument only.
_TEMPLATE = """
def make(_normlib_fused, _normlib_original, _normlib_binding):
    _normlib_swapped = None

    def forward(self, {params}):
        # A bound method captured before unswap_norms (by a wrapper) runs the class's forward again.
        if isinstance(self, _normlib_swapped){one_input}:
            y = _normlib_fused(_normlib_binding, self, {x})
            if y is not None:
                return y
        return _normlib_original(self, {params})

    def belongs_to(cls):
        nonlocal _normlib_swapped
        _normlib_swapped = cls

    return forward, belongs_to
"""


def _forward_for(original, binding):
    """The swapped ``forward``: the kernels where they apply, ``original`` for every other call.

    Returns the function and a setter for the class it belongs to. The
    function is built with ``original``'s globals and ``__wrapped__`` set to it,
    and reads nothing but its closure and builtins: ``torch.jit.script`` (which
    follows ``__wrapped__`` to the source and resolves names in those globals)
    then compiles the class's own forward, as it would without the swap.
    """
    x = _input_name(original)
    if x is not None:
        source = _TEMPLATE.format(params=x, one_input="", x=x)
    else:
        source = _TEMPLATE.format(params="*args, **kwargs", one_input=" and len(args) == 1 and not kwargs", x="args[0]")
    namespace: dict = {}
    exec(compile(source, "<normlib.interop.swap: the swapped forward>", "exec"), namespace)  # a name for tracebacks
    forward, belongs_to = namespace["make"](kinds.fused, original, binding)
    fn = types.FunctionType(forward.__code__, original.__globals__, original.__name__, None, forward.__closure__)
    functools.update_wrapper(fn, original)
    fn._normlib_forward = True  # type: ignore[attr-defined]  # a marker on the function, read by _runs_the_class_forward
    return fn, belongs_to


def _rebuild(cls: type[nn.Module], binding, *args):
    """Unpickle (or copy) a swapped module: an instance of the swapped class of ``cls``, made here if need be."""
    sub = _swapped_class(cls, binding)
    return sub.__new__(sub, *args)


def _reconstruct(cls: type[nn.Module], binding, base, state):
    """Unpickle a swapped module saved with pickle protocol 0 or 1: as :func:`_rebuild`, through copyreg."""
    return copyreg._reconstructor(_swapped_class(cls, binding), base, state)  # type: ignore[attr-defined]  # private


def _reduce_ex(self, protocol):
    """Pickle and copy a swapped module as its class plus its kind, so that a copy is swapped too."""
    sub = type(self)
    rv = sub._normlib_class.__reduce_ex__(self, protocol)
    if isinstance(rv, tuple) and len(rv) >= 2:
        if rv[0] is copyreg.__newobj__ and rv[1][:1] == (sub,):  # type: ignore[attr-defined]  # not in typeshed's copyreg
            return (_rebuild, (sub._normlib_class, sub._normlib_binding) + tuple(rv[1][1:])) + tuple(rv[2:])
        if rv[0] is copyreg._reconstructor and rv[1][:1] == (sub,):  # type: ignore[attr-defined]  # protocols 0 and 1; private, not in typeshed
            return (_reconstruct, (sub._normlib_class, sub._normlib_binding) + tuple(rv[1][1:])) + tuple(rv[2:])
    return rv


def _swapped_class(cls: type[nn.Module], binding) -> type:
    """The subclass of ``cls`` that runs ``binding``'s kind: the same name, a new ``forward``, nothing else."""
    key = (cls, binding)
    sub = _CLASSES.get(key)
    if sub is None:
        original = cls.forward
        forward, belongs_to = _forward_for(original, binding)
        namespace = {
            "forward": forward,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "__doc__": cls.__doc__,
            "__reduce_ex__": _reduce_ex,
            "_normlib_kind": binding.kind,
            "_normlib_binding": binding,
            "_normlib_class": cls,
        }
        metaclass: type = type(cls)
        sub = metaclass(cls.__name__, (cls, _Swapped), namespace)
        belongs_to(sub)
        sub = _CLASSES.setdefault(key, sub)  # one class per key, also when threads swap at the same moment
    return sub


def _original_class(module: nn.Module) -> type[nn.Module]:
    return getattr(type(module), "_normlib_class", type(module))


def _class_name(module: nn.Module) -> str:
    cls = _original_class(module)
    return f"{cls.__module__}.{cls.__qualname__}"


# ---- forwards set on the instance -------------------------------------------------------------------


def _runs_the_class_forward(f, module: nn.Module) -> bool:
    """``f`` is the module's class forward (or a swapped one) bound to the module, e.g. accelerate's ``_old_forward``."""
    if not isinstance(f, types.MethodType) or f.__self__ is not module:
        return False
    return f.__func__ is _original_class(module).forward or getattr(f.__func__, "_normlib_forward", False)


def _describe(f) -> str:
    name = getattr(f, "__qualname__", None) or getattr(getattr(f, "func", None), "__qualname__", None)
    return f"{type(f).__name__} {name}" if name else repr(f)[:80]


def _instance_forwards(module: nn.Module) -> tuple[Optional[dict], str]:
    """The forwards on the instance the swap rebinds, or ``None`` and why the module cannot be swapped.

    A bound class forward (``forward`` or accelerate's ``_old_forward``) is
    rebound to the swapped forward; accelerate's hook, a ``forward`` on the
    instance that calls ``_old_forward``, then runs it inside the hook. Any
    other forward on the instance is a wrapper normlib cannot get inside.
    """
    d = module.__dict__
    slots = {}
    for slot in ("forward", "_old_forward"):
        if slot not in d:
            continue
        f = d[slot]
        if _runs_the_class_forward(f, module):
            slots[slot] = f
        elif slot == "forward" and "_hf_hook" in d and "_old_forward" in d:
            continue  # accelerate's hook: it calls _old_forward, checked next
        else:
            where = "forward" if slot == "forward" else "accelerate's _old_forward"
            return None, (f"its {where} is replaced on the instance by {_describe(f)}, a wrapper normlib cannot run "
                          "inside; it runs unchanged (swap the norms before wrapping them)")
    return slots, ""


def _swap(module: nn.Module, binding) -> None:
    slots, _ = _instance_forwards(module)
    module.__class__ = _swapped_class(type(module), binding)
    if slots:
        module.__dict__[_SLOTS] = slots  # what was there, to restore exactly
        for slot in slots:
            module.__dict__[slot] = types.MethodType(type(module).forward, module)


def _unswap(module: nn.Module) -> None:
    cls = _original_class(module)  # its _normlib_class: callers pass swapped modules only
    module.__class__ = cls
    saved = module.__dict__.pop(_SLOTS, {})
    for slot in ("forward", "_old_forward"):
        if slot in saved:
            module.__dict__[slot] = saved[slot]
        elif getattr(getattr(module.__dict__.get(slot), "__func__", None), "_normlib_forward", False):
            # captured after the swap (accelerate hooked a swapped module): the class's forward, as it would be
            module.__dict__[slot] = types.MethodType(cls.forward, module)


# ---- the public functions ----------------------------------------------------------------------------


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise NormTypeError(f"model must be a torch.nn.Module (got {type(model).__name__})")


def _scripted(model: nn.Module) -> tuple[list, set]:
    """The outermost TorchScript modules in ``model``, and the ids of every module inside them."""
    outer: list[torch.jit.ScriptModule] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, torch.jit.ScriptModule):
            continue
        outer.append(m)
        inside.update(id(s) for s in m.modules())
    return outer, inside


_SCRIPTED = ("compiled TorchScript (torch.jit.script or torch.jit.trace): normlib cannot change what it computes; "
             "swap the norms of the eager model, then script or trace it")


def _listed(module: nn.Module, verdict: recognition.Verdict) -> bool:
    """Worth listing as left alone: a reason of its own, or a leaf module whose class is named like a norm.

    Containers (StableLM's per-head LayerNorm, an encoder layer named
    ``...StableLayerNorm``) are not norms: the norms inside them are listed
    (or swapped) on their own.
    """
    if verdict.status != "unknown":
        return verdict.status == "left"
    return next(module.children(), None) is None and "norm" in type(module).__name__.lower()


def swap_norms(model: nn.Module, *, warn: bool = True) -> SwapReport:
    """Run every norm module of ``model`` that normlib recognises through its fused kernels, in place.

    Each recognised module keeps its identity, parameters, buffers, hooks and
    any forward set on it; only how its forward is computed changes: the
    fused kernels on CUDA tensors they cover, in the module's own rounding
    order (``normlib.interop``), and the class's own forward everywhere else
    (so on CPU the outputs are bit for bit the original's). Modules normlib
    leaves alone are listed in the report with the reason; with ``warn``,
    ``swap_norms`` warns whenever it leaves a norm-like module alone, and when
    the model is (or holds) a TorchScript module, which it cannot swap.
    Undo with ``normlib.unswap_norms``.

    Args:
        model: any ``torch.nn.Module`` (a norm layer itself, or a model holding some).
        warn: whether to warn about modules left alone.

    Returns:
        a ``normlib.SwapReport`` (``print`` it for a summary).

    Example:
        >>> enc = torch.nn.TransformerEncoderLayer(16, 4, batch_first=True)
        >>> swap_norms(enc).count
        2
    """
    _check_model(model)
    if not isinstance(warn, bool):
        raise NormTypeError(f"warn must be True or False (got {warn!r})")
    report = SwapReport()
    left: Counter[str] = Counter()
    why_left: dict[str, Counter[str]] = {}  # class name -> reason -> how many modules it left alone
    scripted, inside = _scripted(model)
    for m in scripted:
        name = f"{type(m).__module__}.{type(m).__qualname__}({m.original_name})"
        left[name] += 1
        why_left.setdefault(name, Counter())[_SCRIPTED] += 1
    with _LOCK:  # one swap at a time: two threads swapping one model would each see a module unswapped
        for module in model.modules():
            if id(module) in inside:
                continue
            name = _class_name(module)
            if isinstance(module, _Swapped):
                report.already[name] += 1
                continue
            verdict = recognition._verdict(module)
            if verdict.binding is not None:
                slots, why_not = _instance_forwards(module)
                if slots is None:
                    verdict = recognition.Verdict.left(why_not)
            if verdict.binding is not None:
                try:
                    _swap(module, verdict.binding)
                except Exception as e:  # a class that refuses subclasses, or a layout __class__ cannot be assigned over
                    verdict = recognition.Verdict.left(f"normlib cannot give it a swapped class ({e}); it runs unchanged")
            if verdict.binding is not None:
                report.swapped[name] += 1
                kinds = set(report.kinds.get(name, "").split(", ")) - {""}
                report.kinds[name] = ", ".join(sorted(kinds | {verdict.binding.kind}))
            elif _listed(module, verdict):
                left[name] += 1
                why_left.setdefault(name, Counter())[verdict.reason] += 1
    # one class may be left alone for several reasons (modules of it configured differently): every one is said
    report.left = {n: (c, _reasons(why_left[n])) for n, c in left.items()}
    if warn and report.left:
        head = f"swap_norms left {sum(left.values())} norm-like module(s) alone; they run unchanged"
        if scripted:
            head = ("swap_norms cannot swap a TorchScript module (scripted or traced): its forward is compiled code; "
                    "swap the eager model before scripting or tracing it. " + head)
        warnings.warn(f"{head}:\n{report}", stacklevel=2)
    return report


def _reasons(why: Counter) -> str:
    """The reasons one class was left alone, each with its count where there is more than one reason."""
    if len(why) == 1:
        return next(iter(why))
    return "; ".join(f"{n} of them: {reason}" for reason, n in sorted(why.items(), key=lambda kv: (-kv[1], kv[0])))


def unswap_norms(model: nn.Module) -> int:
    """Undo :func:`swap_norms`: each swapped module gets its class, and its instance forwards, back. Returns how many.

    Example:
        >>> ln = torch.nn.LayerNorm(4); _ = swap_norms(ln)
        >>> unswap_norms(ln), type(ln) is torch.nn.LayerNorm
        (1, True)
    """
    _check_model(model)
    n = 0
    with _LOCK:
        for module in model.modules():
            if not isinstance(module, _Swapped):
                continue
            if _Swapped not in type(module).__bases__:
                warnings.warn(f"unswap_norms cannot restore {_class_name(module)}: its class was changed again after "
                              f"the swap (to {type(module).__qualname__}); it keeps normlib's forward", stacklevel=2)
                continue
            _unswap(module)
            n += 1
    return n
