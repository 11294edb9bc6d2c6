"""What other libraries' norm classes compute, one small entry each.

:func:`normlib.swap_norms` uses this table to decide, for each module of a
model, whether normlib can run it through its fused kernels *without changing
its numbers*: a norm's result depends not only on its formula but on where it
rounds. Each entry says how a class is recognised and in which order it
rounds (up-cast to float32, where the result is cast back, whether the weight
multiplies before or after that cast):

=============================  ==================================================================
kind                           rounding order
=============================  ==================================================================
``layer_norm``                 ``torch.nn.LayerNorm``: statistics and ``x̂ ⊙ γ + β`` in float32,
                               one cast to the input's dtype at the end; under autocast the
                               input is first cast to float32 (so is the output). Also timm's
                               ``LayerNorm`` (which calls ``F.layer_norm``) when its fast-norm
                               mode is off, and transformers' ``ConvNextLayerNorm`` with
                               ``data_format="channels_last"``.
``channels_first_layer_norm``  ConvNeXt-style LayerNorm over the channels of ``(N, C, H, W)``
                               input (transformers' ``ConvNextLayerNorm`` with
                               ``data_format="channels_first"`` and its copies, timm's
                               ``LayerNorm2d``, transformers' ``EomtLayerNorm2d``): the channel
                               dimension is moved last, normalized in ``layer_norm``'s order,
                               and moved back, so the output is a permuted view, as theirs.
``rms_norm``                   ``torch.nn.RMSNorm``: like ``layer_norm``, without mean and β.
``llama_rms_norm``             Llama, Mistral, Qwen2/3 and the other classes whose forward is
                               Llama's: ``x̂`` in float32 is cast to the input's dtype *before*
                               multiplying by γ; the output has the promoted dtype of γ and x.
``gemma_rms_norm``             Gemma: ``x̂ ⊙ (1 + γ)`` all in float32, cast to the input's dtype
                               at the end.
``t5_layer_norm``              T5: RMS statistics in float32; ``x̂`` is cast to γ's dtype when
                               γ is float16/bfloat16, then multiplied by γ; else the output is
                               float32.
=============================  ==================================================================

Recognition is by what a module computes, never by its name: a ``torch.nn``
class counts when its subclass does not override ``forward``; another
library's class counts when its ``forward`` is the same code as the forward
of one of the *anchor* classes below: the same syntax tree (comments,
docstrings and formatting aside), the same objects behind the global names it
uses (``torch``, ``F``, ...), the same code behind every method it calls on
``self``, and the same method behind every ``super().…`` call; and the module
holds the attributes that forward reads. An anchor is only consulted when its
library is already imported (then its file is imported too: a Qwen2 model
loads Qwen2's modeling file, not Llama's), so normlib itself imports neither
transformers nor timm. Anything else is left alone and reported, e.g. VitDet's LayerNorm, whose
statistics are computed in the input's own dtype (the kernels accumulate in
float32 and cannot round like it).

On tensors the kernels do not cover (CPU, other dtypes, wide rows), a
swapped module runs its class's own ``forward``: the same numbers, bit for bit.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from . import ops

__all__ = ["NormKind", "KINDS", "recognise"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_UNKNOWN = "not a norm normlib knows"
# torch.nn norms that have no fused kernel: left alone, with this reason
_NO_KERNEL = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm)


@dataclass(frozen=True)
class NormKind:
    """One kind of norm: how to recognise it, and its fused forward."""

    name: str
    rounding: str  # one sentence: where it up-casts and casts back
    attributes: tuple[str, ...]  # what its forward reads from the module
    anchors: tuple[tuple[str, str], ...]  # (module, class) whose forward defines the kind
    torch_classes: tuple[type, ...]  # torch.nn classes (and subclasses keeping their forward)
    fused: Callable[[nn.Module, Tensor], Optional[Tensor]]  # None where the kernels do not apply
    # the kind a recognised module gets, from its settings: (kind name, "") or (None, why not)
    select: Optional[Callable[[nn.Module], tuple[Optional[str], str]]] = None


def _kernels_cover(x: Tensor, weight: Optional[Tensor]) -> bool:
    """The fused path applies: a tensor the kernels take, and a weight on the same device."""
    if not isinstance(x, Tensor) or not ops.use_fused(x) or x.dtype not in _KERNEL_DTYPES:
        return False
    return weight is None or (weight.device == x.device and weight.dtype in _KERNEL_DTYPES)


_AUTOCAST_FP32: dict = {}


def _autocast_to_fp32(op: str, x: Tensor) -> bool:
    """Whether autocast (enabled now, on ``x``'s device) runs ``op`` in float32: asked once of torch itself."""
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return False
    key = (op, dev, torch.get_autocast_dtype(dev))
    if key not in _AUTOCAST_FP32:
        probe = torch.ones(1, 2, device=x.device, dtype=key[2])
        out = F_layer_norm(probe, (2,)) if op == "layer_norm" else torch.nn.functional.rms_norm(probe, (2,))
        _AUTOCAST_FP32[key] = out.dtype == torch.float32
    return _AUTOCAST_FP32[key]


F_layer_norm = torch.nn.functional.layer_norm


def _layer_norm(m: nn.Module, x: Tensor) -> Optional[Tensor]:
    if len(m.normalized_shape) != 1 or not _kernels_cover(x, m.weight):
        return None
    if _autocast_to_fp32("layer_norm", x):
        x = x.float()
    return ops._fused(x, None, m.weight, m.bias, m.eps, False)[0]


def _channels_first_layer_norm(m: nn.Module, x: Tensor) -> Optional[Tensor]:
    if not isinstance(x, Tensor) or x.dim() != 4:
        return None
    y = _layer_norm(m, x.permute(0, 2, 3, 1))  # (N, H, W, C)
    return None if y is None else y.permute(0, 3, 1, 2)  # (N, C, H, W), a view as in the original


def _rms_norm(m: nn.Module, x: Tensor) -> Optional[Tensor]:
    if len(m.normalized_shape) != 1 or not _kernels_cover(x, m.weight):
        return None
    if _autocast_to_fp32("rms_norm", x):
        x = x.float()
    eps = m.eps if m.eps is not None else torch.finfo(torch.float32).eps
    return ops._fused(x, None, m.weight, None, eps, True)[0]


def _llama_rms_norm(m: nn.Module, x: Tensor) -> Optional[Tensor]:
    w = m.weight
    if not _kernels_cover(x, w):
        return None
    return ops._fused(x, None, w, None, m.variance_epsilon, True, torch.promote_types(w.dtype, x.dtype), False, 1)[0]


def _gemma_rms_norm(m: nn.Module, x: Tensor) -> Optional[Tensor]:
    if not _kernels_cover(x, m.weight):
        return None
    return ops._fused(x, None, m.weight, None, m.eps, True, x.dtype, True, 0)[0]


def _t5_layer_norm(m: nn.Module, x: Tensor) -> Optional[Tensor]:
    w = m.weight
    if not _kernels_cover(x, w):
        return None
    if w.dtype in (torch.float16, torch.bfloat16):
        return ops._fused(x, None, w, None, m.variance_epsilon, True, w.dtype, False, 2)[0]
    return ops._fused(x, None, w, None, m.variance_epsilon, True, torch.promote_types(w.dtype, torch.float32), False, 0)[0]


_FAST_NORM = "timm's fast-norm mode is on (its rounding depends on apex and the autocast dtype)"


def _select_layer_norm(m: nn.Module) -> tuple[Optional[str], str]:
    if getattr(m, "_fast_norm", False):
        return None, _FAST_NORM
    return "layer_norm", ""


def _select_channels_first(m: nn.Module) -> tuple[Optional[str], str]:
    if getattr(m, "_fast_norm", False):
        return None, _FAST_NORM
    fmt = getattr(m, "data_format", "channels_first")
    if fmt == "channels_last":  # ConvNextLayerNorm: then it is a plain LayerNorm
        return "layer_norm", ""
    if fmt != "channels_first":
        return None, f"data_format={fmt!r}"
    return "channels_first_layer_norm", ""


KINDS: dict[str, NormKind] = {
    k.name: k
    for k in (
        NormKind(
            "layer_norm",
            "statistics and x̂·γ + β in float32, cast to the input's dtype at the end (float32 under autocast)",
            ("normalized_shape", "weight", "bias", "eps"),
            (("timm.layers.norm", "LayerNorm"),),
            (nn.LayerNorm,),
            _layer_norm,
            _select_layer_norm,
        ),
        NormKind(
            "channels_first_layer_norm",
            "channels moved last, then layer_norm's order (float32, one cast at the end), moved back as a view",
            ("normalized_shape", "weight", "bias", "eps"),
            (
                ("transformers.models.convnext.modeling_convnext", "ConvNextLayerNorm"),
                ("timm.layers.norm", "LayerNorm2d"),
                ("transformers.models.eomt.modeling_eomt", "EomtLayerNorm2d"),
            ),
            (),
            _channels_first_layer_norm,
            _select_channels_first,
        ),
        NormKind(
            "rms_norm",
            "statistics and x̂·γ in float32, cast to the input's dtype at the end",
            ("normalized_shape", "weight", "eps"),
            (),
            (nn.RMSNorm,),
            _rms_norm,
        ),
        NormKind(
            "llama_rms_norm",
            "x̂ in float32, cast to the input's dtype, then multiplied by γ (output: promoted dtype of γ and x)",
            ("weight", "variance_epsilon"),
            (("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),),
            (),
            _llama_rms_norm,
        ),
        NormKind(
            "gemma_rms_norm",
            "x̂·(1 + γ) all in float32, cast to the input's dtype at the end",
            ("weight", "eps"),
            (("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm"),),
            (),
            _gemma_rms_norm,
        ),
        NormKind(
            "t5_layer_norm",
            "RMS statistics in float32; x̂ cast to γ's dtype if γ is half precision, then multiplied by γ",
            ("weight", "variance_epsilon"),
            (("transformers.models.t5.modeling_t5", "T5LayerNorm"),),
            (),
            _t5_layer_norm,
        ),
    )
}


# ---- what a method computes: its code, the globals it reads, the methods it calls --------------


def _owner(cls: type, name: str, after: Optional[type] = None) -> Optional[type]:
    """The class in ``cls.__mro__`` (after ``after``, if given) whose ``__dict__`` defines ``name``."""
    mro = cls.__mro__
    if after is not None:
        mro = mro[mro.index(after) + 1:] if after in mro else ()
    return next((c for c in mro if name in c.__dict__), None)


def _tree(fn) -> Optional[ast.AST]:
    """The syntax tree of a function without its decorators and docstring; ``None`` without source."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return None
    if not isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    tree.decorator_list = []
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(getattr(tree.body[0], "value", None), ast.Constant):
        tree.body = tree.body[1:] or [ast.Pass()]
    return tree


def _is_self_call(node: ast.AST, self_name: str) -> Optional[str]:
    """``name`` for a call ``self.name(...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        v = node.func.value
        if isinstance(v, ast.Name) and v.id == self_name:
            return node.func.attr
    return None


def _is_super_attr(node: ast.AST) -> Optional[str]:
    """``name`` for ``super().name``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
        f = node.value.func
        if isinstance(f, ast.Name) and f.id == "super" and not node.value.args:
            return node.attr
    return None


_MISSING = object()
_SIGS: dict = {}


def _signature(cls: type, name: str, depth: int = 0):
    """A value equal for two classes exactly when their method ``name`` computes the same thing.

    Built from the method's syntax tree, the identity of every global it reads,
    the signatures of the methods it calls on ``self`` and the identity of
    what its ``super().…`` calls resolve to. ``None`` when it cannot be told
    (no source, a closure, too deep).
    """
    key = (cls, name)
    if key in _SIGS:
        return _SIGS[key]
    _SIGS[key] = None  # guards against recursion
    owner = _owner(cls, name)
    fn = owner.__dict__.get(name) if owner is not None else None
    if not inspect.isfunction(fn) or depth > 3:
        return None
    if set(fn.__code__.co_freevars) - {"__class__"}:  # a closure: only the very same function is the same
        _SIGS[key] = ("function", id(fn))
        return _SIGS[key]
    tree = _tree(fn)
    if tree is None:
        return None
    self_name = tree.args.args[0].arg if tree.args.args else None
    local = set(fn.__code__.co_varnames)
    globals_, calls, supers = {}, {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
            obj = fn.__globals__.get(node.id, getattr(builtins, node.id, _MISSING))
            globals_[node.id] = id(obj)
        called = _is_self_call(node, self_name)
        if called is not None and called not in calls:
            if isinstance(inspect.getattr_static(cls, called, None), (staticmethod, classmethod)) or inspect.isfunction(
                inspect.getattr_static(cls, called, None)
            ):
                sig = _signature(cls, called, depth + 1)
                if sig is None:
                    return None
                calls[called] = sig
        via_super = _is_super_attr(node)
        if via_super is not None:
            parent = _owner(cls, via_super, after=owner)
            supers[via_super] = id(parent.__dict__[via_super]) if parent is not None else None
    sig = (
        ast.dump(tree, annotate_fields=False, include_attributes=False),
        tuple(sorted(globals_.items())),
        tuple(sorted(calls.items())),
        tuple(sorted(supers.items())),
    )
    _SIGS[key] = sig
    return sig


def _anchor_module(mod: str):
    """The anchor's module, if its library is in use already (normlib never imports transformers or timm).

    A model of one family (say Qwen2) imports its own modeling file only, so
    the anchor's file (Llama's) is imported here, once its library is.
    """
    if mod in sys.modules:
        return sys.modules[mod]
    if mod.partition(".")[0] not in sys.modules:
        return None
    try:
        return importlib.import_module(mod)
    except Exception:  # another version of the library, without that file
        return None


def _anchor_classes(kind: NormKind):
    for mod, name in kind.anchors:
        module = _anchor_module(mod)
        cls = getattr(module, name, None) if module is not None else None
        if isinstance(cls, type):
            yield cls


def _same_computation(cls: type, anchor: type) -> bool:
    if cls is anchor:
        return True
    sig = _signature(cls, "forward")
    return sig is not None and sig == _signature(anchor, "forward")


def recognise(module: nn.Module) -> tuple[Optional[NormKind], str]:
    """``(kind, why)`` for a module; ``kind`` is ``None`` when normlib does not know what it computes.

    Example:
        >>> recognise(torch.nn.LayerNorm(4))[0].name
        'layer_norm'
    """
    cls = type(module)
    if cls.__module__.startswith("normlib."):
        return None, "already a normlib module"
    overridden = None
    for kind in KINDS.values():
        for tc in kind.torch_classes:
            if isinstance(module, tc):
                if cls.forward is tc.forward:
                    return kind, f"{tc.__module__}.{tc.__qualname__}" + ("" if cls is tc else " subclass")
                overridden = tc
    for kind in KINDS.values():
        for anchor in _anchor_classes(kind):
            if not _same_computation(cls, anchor):
                continue
            missing = [a for a in kind.attributes if not hasattr(module, a)]
            if missing:
                return None, f"forward of {anchor.__qualname__}, but no attribute {', '.join(missing)}"
            name, why_not = kind.select(module) if kind.select is not None else (kind.name, "")
            if name is None:
                return None, why_not
            return KINDS[name], f"forward identical to {anchor.__module__}.{anchor.__qualname__}"
    if overridden is not None:
        return None, f"subclass of {overridden.__qualname__} with its own forward"
    if isinstance(module, _NO_KERNEL):
        return None, "normlib has no fused kernel for this norm (it runs unchanged)"
    return None, _UNKNOWN
