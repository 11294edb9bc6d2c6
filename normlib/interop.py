"""What other libraries' norm classes compute, one small entry each.

:func:`normlib.swap_norms` uses this table to decide, for each module of a
model, whether normlib can run it through its fused kernels *without changing
its numbers*: a norm's result depends not only on its formula but on where it
rounds. Each entry says how a class is recognised and in which order it
rounds (up-cast to float32, where the result is cast back, whether the weight
multiplies before or after that cast):

============================  ==================================================================
kind                          rounding order
============================  ==================================================================
``layer_norm``                ``torch.nn.LayerNorm``: statistics and ``x̂ ⊙ γ + β`` in float32,
                              one cast to the input's dtype at the end; under autocast the
                              input is first cast to float32 (so is the output).
``rms_norm``                  ``torch.nn.RMSNorm``: like ``layer_norm``, without mean and β.
``llama_rms_norm``            Llama, Mistral, Qwen2/3 and the other classes whose forward is
                              Llama's: ``x̂`` in float32 is cast to the input's dtype *before*
                              multiplying by γ; the output has the promoted dtype of γ and x.
``gemma_rms_norm``            Gemma: ``x̂ ⊙ (1 + γ)`` all in float32, cast to the input's dtype
                              at the end.
``t5_layer_norm``             T5: RMS statistics in float32; ``x̂`` is cast to γ's dtype when
                              γ is float16/bfloat16, then multiplied by γ; else the output is
                              float32.
============================  ==================================================================

Recognition is by what a module computes, never by its name alone: a
``torch.nn`` class counts when its subclass does not override ``forward``;
another library's class counts when its ``forward`` has the same syntax tree
(comments and formatting aside) as the forward of one of the *anchor* classes
below, and it holds the attributes that forward reads. An anchor is only
consulted when its library is already imported, so this module imports
neither transformers nor timm. Anything else is left alone and reported.

On tensors the kernels do not cover (CPU, other dtypes, wide rows), a
swapped module runs its class's own ``forward``: the same numbers, bit for bit.
"""

from __future__ import annotations

import ast
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


@dataclass(frozen=True)
class NormKind:
    """One kind of norm: how to recognise it, and its fused forward."""

    name: str
    rounding: str  # one sentence: where it up-casts and casts back
    attributes: tuple[str, ...]  # what its forward reads from the module
    anchors: tuple[tuple[str, str], ...]  # (module, class) whose forward defines the kind
    torch_classes: tuple[type, ...]  # torch.nn classes (and subclasses keeping their forward)
    fused: Callable[[nn.Module, Tensor], Optional[Tensor]]  # None where the kernels do not apply


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


def _forward_tree(cls: type) -> Optional[str]:
    """The syntax tree of ``cls.forward`` without docstrings, as text; ``None`` if its source is unavailable."""
    fn = cls.__dict__.get("forward")
    if fn is None:
        return None
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    tree = ast.parse(src).body[0]
    tree.decorator_list = []
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(getattr(tree.body[0], "value", None), ast.Constant):
        tree.body = tree.body[1:] or [ast.Pass()]
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


_TREES: dict[type, Optional[str]] = {}


def _tree(cls: type) -> Optional[str]:
    if cls not in _TREES:
        _TREES[cls] = _forward_tree(cls)
    return _TREES[cls]


def _anchor_classes(kind: NormKind):
    for mod, name in kind.anchors:
        module = sys.modules.get(mod)  # consulted only if the library is in use already
        cls = getattr(module, name, None) if module is not None else None
        if isinstance(cls, type):
            yield cls


def recognise(module: nn.Module) -> tuple[Optional[NormKind], str]:
    """``(kind, why)`` for a module; ``kind`` is ``None`` when normlib does not know what it computes.

    Example:
        >>> recognise(torch.nn.LayerNorm(4))[0].name
        'layer_norm'
    """
    cls = type(module)
    if cls.__module__.startswith("normlib."):
        return None, "already a normlib module"
    for kind in KINDS.values():
        for tc in kind.torch_classes:
            if isinstance(module, tc):
                if cls.forward is tc.forward:
                    return kind, f"{tc.__module__}.{tc.__qualname__}" + ("" if cls is tc else " subclass")
                return None, f"subclass of {tc.__qualname__} with its own forward"
    tree = _tree(cls)
    if tree is None:
        return None, _UNKNOWN
    for kind in KINDS.values():
        for anchor in _anchor_classes(kind):
            if cls is anchor or _tree(anchor) == tree:
                missing = [a for a in kind.attributes if not hasattr(module, a)]
                if missing:
                    return None, f"forward of {anchor.__qualname__}, but no attribute {', '.join(missing)}"
                return kind, f"forward identical to {anchor.__module__}.{anchor.__qualname__}"
    return None, _UNKNOWN
