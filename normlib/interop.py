"""What other libraries' norm classes compute, one small entry each.

:func:`normlib.swap_norms` uses this table to decide, for each module of a
model, whether normlib can run it through its fused kernels *without changing
its numbers*: a norm's result depends not only on its formula but on where it
rounds. Each entry says how a class is recognised and in which order it
rounds (up-cast to float32, where the result is cast back, whether the weight
multiplies before or after that cast):

==============================  =================================================================
kind                            rounding order
==============================  =================================================================
``layer_norm``                  ``torch.nn.LayerNorm``: statistics and ``x̂ ⊙ γ + β`` in float32,
                                one cast to the input's dtype at the end; under autocast x, γ
                                and β are first cast to the dtype autocast runs it in (float32
                                on CUDA, the autocast dtype on CPU). Also timm's
                                ``LayerNorm`` (which calls ``F.layer_norm``) when its fast-norm
                                mode is off, and transformers' ``ConvNextLayerNorm`` with
                                ``data_format="channels_last"``.
``channels_first_layer_norm``   ConvNeXt-style LayerNorm over the channels of ``(N, C, H, W)``
                                input (transformers' ``ConvNextLayerNorm`` with
                                ``data_format="channels_first"`` and its copies, timm's
                                ``LayerNorm2d``, transformers' ``EomtLayerNorm2d``, diffusers'
                                ``SDCascadeLayerNorm``): the channel
                                dimension is moved last, normalized in ``layer_norm``'s order,
                                and moved back, so the output is a permuted view, as theirs.
                                (Each kind's ``layout`` says where it normalizes; the other
                                ``channels_first_*`` kinds below are timm's 2d variants.)
``rms_norm``                    ``torch.nn.RMSNorm``: like ``layer_norm``, without mean and β.
``llama_rms_norm``              Llama, Mistral, Qwen2/3, Mamba and the other classes whose forward
                                is Llama's, Llama-4's text RMSNorm, CPM-Ant's: ``x̂`` in float32 is
                                cast to the input's dtype *before* multiplying by γ; the output
                                has the promoted dtype of γ and x.
``gemma_rms_norm``              Gemma (and diffusers' ``QwenImage21ZeroCenterRMSNorm``):
                                ``x̂ ⊙ (1 + γ)`` all in float32, cast to the input's dtype at
                                the end.
``t5_layer_norm``               T5: RMS statistics in float32; ``x̂`` is cast to γ's dtype when
                                γ is float16/bfloat16, then multiplied by γ; else the output is
                                float32. Also diffusers' ``RMSNorm`` (SD3's and Flux's q/k
                                norms) without β; without γ it is ``float32_rms_norm``'s.
``float32_rms_norm``            OLMo-2/OLMo-3, gpt-oss, Helium, Moshi, Gemma-3n and the RMSNorms
                                without γ (NanoChat, Llama-4's L2 norm, ...), diffusers'
                                ``MochiRMSNorm``, ``Cosmos3NemotronRMSNorm`` and
                                ``StableAudio3RMSNorm``, timm's ``RmsNormFp32``: ``x̂ ⊙ γ`` in
                                float32 (γ up-cast), one cast to the input's dtype at the end.
                                ``channels_first_float32_rms_norm`` (timm's ``RmsNorm2dFp32``):
                                the same over the channels of ``(N, C, H, W)``, the output in the
                                input's memory format, as an elementwise forward returns it.
``input_dtype_rms_norm``        timm's ``RmsNorm`` (fast-norm mode off): torch's ops in the input's
                                dtype, which for float32 input outside autocast is
                                ``float32_rms_norm``'s order; on 16-bit input (statistics in 16
                                bits) or under autocast it runs unchanged.
                                ``channels_first_input_dtype_rms_norm``: timm's ``RmsNorm2d``,
                                the same over the channels, output in the input's memory format.
``float32_layer_norm``          Cohere's LayerNorm (γ, no β) and OLMo's (neither): statistics
                                and ``x̂ ⊙ γ`` in float32, one cast to the input's dtype at the
                                end, with or without autocast.
``upcast_layer_norm``           diffusers' ``FP32LayerNorm``, timm's ``LayerNormFp32``: x, γ and β
                                up-cast to float32 for ``F.layer_norm``, one cast to the input's
                                dtype at the end; where autocast would run ``F.layer_norm`` in a
                                16-bit dtype (a policy asked of torch) it runs unchanged.
                                ``channels_first_upcast_layer_norm``: timm's ``LayerNorm2dFp32``,
                                the same over the channels, moved back as a view.
``layer_norm_1p``               Nemotron's ``LayerNorm1P``: ``1 + γ`` computed (and rounded) in
                                γ's dtype, then ``layer_norm``'s order; under autocast the input,
                                ``1 + γ`` and β are first cast to the autocast dtype, and the norm
                                runs in that dtype.
``deberta_layer_norm``          DeBERTa's (v1) LayerNorm: ``x̂`` in float32, cast to the input's
                                dtype, *then* ``γ ⊙ x̂ + β`` (output: promoted dtype of γ, x, β).
==============================  =================================================================

Recognition is by what a module computes, never by its name: a class counts
when its ``forward`` is the same code as the forward of one of the *anchor*
classes below: the same syntax tree once annotations, docstrings, comments,
formatting and the names of local variables are set aside, the same objects
behind the global names it uses (``torch``, ``F``, ...), the same code behind
every method it calls on ``self``, and the same method behind every
``super().…`` call; and the module holds every attribute that code reads.
``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` are anchors too, so their
subclasses count when they keep torch's forward. An anchor from another library
(transformers, diffusers, timm) is read from its source file wherever that
library is installed, without importing it, and imported only once a class's
forward has the anchor's syntax tree: so a model that copies, say, Llama's
RMSNorm into its own code is recognised whether or not transformers was
imported, and normlib itself imports none of these libraries. (A copy is not
recognised where the anchor's library is not installed: then there is nothing
to compare it with.)

Some norms are recognised and deliberately left alone (``UNFUSED``), each
with the reason the report gives: gated RMSNorms, timm's ``SimpleNorm``
(x / std(x), no mean subtracted), frozen batch norms, and torch's
BatchNorm/GroupNorm/InstanceNorm/LocalResponseNorm. Anything else is
left alone and reported too, e.g. VitDet's LayerNorm, whose statistics are
computed in the input's own dtype (the kernels accumulate in float32 and cannot
round like it). The tests ``tests/test_swap_scan.py`` classify every norm
class of the installed ``transformers``, ``diffusers`` and ``timm``.

On tensors the kernels do not cover (CPU, other dtypes, wide rows, a weight
on another device), a swapped module runs its class's own ``forward``: the
same numbers, bit for bit. The function ``fused`` decides that, in one place.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import inspect
import os
import re
import sys
import textwrap
import threading
from dataclasses import dataclass
from typing import Callable, Literal, NamedTuple, Optional, Union

import torch
from torch import Tensor, nn

from . import ops
from .ops import rounding as _r
from .ops.routing import FUSED, PATH_OF, kernels_run_on, plan, wants_grad
from .errors import NormTypeError

__all__ = ["Anchor", "NormKind", "Unfused", "KINDS", "UNFUSED", "recognise", "classify"]

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Anchor:
    """A class whose ``forward`` defines a kind, and where that forward finds γ, β and ε.

    ``weight`` and ``bias`` name the attributes holding γ and β (``None``: the
    forward uses none); ``eps`` names the attribute holding ε, or is the
    constant the forward adds.
    """

    module: str
    name: str
    weight: Optional[str] = "weight"
    bias: Optional[str] = None
    eps: Union[str, float] = "variance_epsilon"

    def __str__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class Binding:
    """What a swapped module's forward reads: its kind, and the attributes (or constants) for γ, β and ε."""

    kind: str
    weight: Optional[str]
    bias: Optional[str]
    eps: Union[str, float, None]


@dataclass(frozen=True)
class NormKind:
    """One kind of norm: how to recognise it (its anchors), its rounding order, and its fused forward."""

    name: str
    rounding: str  # one sentence: where it up-casts and casts back
    anchors: tuple[Anchor, ...]  # classes whose forward defines the kind
    # (x, weight, bias, eps, module) -> output; None where this kind's kernels cannot take the call
    fused: Callable[..., Optional[Tensor]]
    # a recognised module's binding from its settings: (binding, "") or (None, why not)
    select: Optional[Callable[[nn.Module, Binding], tuple[Optional[Binding], str]]] = None
    # where the normalized values lie: "rows" (the last dimension); "channels_first" (dimension 1 of
    # (N, C, H, W), moved last and the result moved back: a permuted view, as the classes' own forwards
    # return); "channels_first_dense" (the same, with the output in the input's memory format, as an
    # elementwise forward over (N, C, H, W) returns it)
    layout: Literal["rows", "channels_first", "channels_first_dense"] = "rows"

    def rows(self, x: Tensor) -> Optional[Tensor]:
        """``x`` as the kernels read it in this layout (a view), or ``None`` where the layout does not fit ``x``."""
        if self.layout == "rows":
            return x
        return x.permute(0, 2, 3, 1) if x.dim() == 4 else None

    def run(self, how: str, x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps, module: nn.Module):
        """This kind's fused forward of ``module(x)`` in its layout, or ``None`` where its kernels cannot take it."""
        rows = self.rows(x)
        y = None if rows is None else self.fused(how, rows, weight, bias, eps, module)
        if y is None or self.layout == "rows":
            return y
        y = y.permute(0, 3, 1, 2)  # (N, C, H, W) again, a view
        return y if self.layout == "channels_first" else torch.empty_like(x, dtype=y.dtype).copy_(y)


@dataclass(frozen=True)
class Unfused:
    """Norms normlib recognises and leaves alone, and the reason the report gives."""

    name: str
    reason: str
    anchors: tuple[Anchor, ...] = ()  # classes whose forward defines them
    torch_classes: tuple[type, ...] = ()  # and every subclass of these, whatever its forward


# ---- kernels or the class's own forward: normlib.ops.route decides ---------------------------------


def fused(b: Binding, module: nn.Module, x) -> Optional[Tensor]:
    """``module(x)`` through the kernels in ``b.kind``'s rounding order, or ``None``: then its own forward runs.

    The kernels take the call where :func:`normlib.ops.routing.route` sends
    the rows the kernels would see to them (CUDA tensors of a dtype they
    cover; not while ``torch.compile`` traces in its default mode, nor under
    ``torch.jit.trace``; CPU tensors only inside ``force_path("fused")``),
    with γ and β tensors of those dtypes on the same device (not offloaded,
    say, by accelerate). Everywhere else the module's own forward runs: on
    CPU a swapped model computes exactly what it computed before.
    """
    if not isinstance(x, Tensor) or x.dtype not in _KERNEL_DTYPES or not kernels_run_on(x):
        return None  # a CPU tensor leaves here: the common case on a laptop, decided in a few attribute reads
    params = []
    for name in (b.weight, b.bias):
        t = getattr(module, name) if name is not None else None
        if t is not None and (not isinstance(t, Tensor) or t.device != x.device or t.dtype not in _KERNEL_DTYPES):
            return None
        params.append(t)
    kind = KINDS[b.kind]
    rows = kind.rows(x)  # what the kernels see
    if rows is None:
        return None
    # γ/β are not handed to the plan: each kind reads them in its own way (1 + γ, a scalar γ, ...) and
    # its fused forward below checks them; the plan is told only whether a gradient is wanted
    how = plan("layer_norm", rows, grad=wants_grad(x, None, params[0], params[1]))
    if PATH_OF[how] != FUSED:
        return None
    eps = getattr(module, b.eps) if isinstance(b.eps, str) else b.eps
    return kind.run(how, x, params[0], params[1], eps, module)


# ---- each kind's fused forward (only called where fused() said the kernels apply) -------------------------


def _fits(x: Tensor, *params: Optional[Tensor]) -> bool:
    """γ and β (where given) hold one value per element of the last dimension, as the kernels read them."""
    return x.dim() > 0 and all(t is None or t.shape == x.shape[-1:] for t in params)


_AUTOCAST: dict = {}


def _autocast_dtype(op: str, x: Tensor) -> Optional[torch.dtype]:
    """The dtype autocast (enabled now, on ``x``'s device) casts ``op``'s inputs to, or ``None``: asked of torch once.

    On CUDA ``layer_norm`` runs in float32; on CPU it runs in the autocast
    dtype (bfloat16): two probes tell the policy without a table.
    """
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return None
    key = (op, dev, torch.get_autocast_dtype(dev))
    if key not in _AUTOCAST:
        f = F_layer_norm if op == "layer_norm" else torch.nn.functional.rms_norm
        low = f(torch.ones(1, 2, device=x.device, dtype=key[2]), (2,)).dtype
        high = f(torch.ones(1, 2, device=x.device, dtype=torch.float32), (2,)).dtype
        _AUTOCAST[key] = torch.float32 if low == torch.float32 else key[2] if high == key[2] else None
    return _AUTOCAST[key]


def _autocast(op: str, x: Tensor, *params: Optional[Tensor]) -> tuple:
    """``x`` and γ/β as autocast hands them to ``op``: floating tensors on its device, but float64, cast."""
    dtype = _autocast_dtype(op, x)
    if dtype is None:
        return (x,) + params
    dev = x.device.type
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.device.type == dev
                 and t.dtype != torch.float64 else t for t in (x,) + params)


F_layer_norm = torch.nn.functional.layer_norm


def _layer_norm(how, x, w, b, eps, m):
    if x.shape[-1:] != tuple(m.normalized_shape) or not _fits(x, w, b):
        return None
    x, w, b = _autocast("layer_norm", x, w, b)
    return ops.dispatch.fused(x, None, w, b, eps, rms=False, how=how)[0]


def _rms_norm(how, x, w, b, eps, m):
    if x.shape[-1:] != tuple(m.normalized_shape) or not _fits(x, w):
        return None
    x, w = _autocast("rms_norm", x, w)
    eps = eps if eps is not None else torch.finfo(torch.float32).eps
    return ops.dispatch.fused(x, None, w, None, eps, rms=True, how=how)[0]


def _llama_rms_norm(how, x, w, b, eps, m):
    if w is None or not _fits(x, w):
        return None
    return ops.dispatch.fused(x, None, w, None, eps, rms=True, rounding=_r.LLAMA, how=how)[0]


def _gemma_rms_norm(how, x, w, b, eps, m):
    if w is None or not _fits(x, w):
        return None
    return ops.dispatch.fused(x, None, w, None, eps, rms=True, rounding=_r.GEMMA, how=how)[0]


def _t5_layer_norm(how, x, w, b, eps, m):
    if w is None or not _fits(x, w):
        return None
    rounding = _r.T5_HALF if w.dtype in (torch.float16, torch.bfloat16) else _r.T5
    return ops.dispatch.fused(x, None, w, None, eps, rms=True, rounding=rounding, how=how)[0]


def _float32_rms_norm(how, x, w, b, eps, m):
    if not _over_its_shape(x, m):
        return None
    if w is not None and w.dim() == 0:  # Gemma-3n's with_scale=False in transformers 4.x: a scalar γ of 1
        w = w.expand(x.shape[-1:]).contiguous()
    if not _fits(x, w):
        return None
    return ops.dispatch.fused(x, None, w, None, eps, rms=True, how=how)[0]


def _input_dtype_rms_norm(how, x, w, b, eps, m):
    # timm's RmsNorm: x², its mean, x·rsqrt(·) and ·γ are torch's ops in the input's dtype: float32 for float32
    # input, which is float32_rms_norm's order (γ of another dtype promotes to float32: up-cast); under autocast
    # those ops run in float32 and return float32 for 16-bit input, and in 16-bit input's own dtype otherwise
    if x.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type):
        return None
    return _float32_rms_norm(how, x, w, b, eps, m)


def _over_its_shape(x: Tensor, m: nn.Module) -> bool:
    """``x`` ends in the module's ``normalized_shape``, where it has one."""
    shape = getattr(m, "normalized_shape", None)
    return shape is None or (len(shape) > 0 and x.shape[-len(shape):] == tuple(shape))


def _float32_layer_norm(how, x, w, b, eps, m):
    if not _fits(x, w, b) or (w is None and x.shape[-1:] != tuple(m.normalized_shape)):
        return None
    return ops.dispatch.fused(x, None, w, b, eps, rms=False, how=how)[0]


def _upcast_layer_norm(how, x, w, b, eps, m):
    low = _autocast_dtype("layer_norm", x)
    if low is not None and low != torch.float32:  # F.layer_norm would run in autocast's 16-bit dtype
        return None
    return _float32_layer_norm(how, x, w, b, eps, m)


def _layer_norm_1p(how, x, w, b, eps, m):
    if w is None or x.shape[-1:] != tuple(m.normalized_shape) or not _fits(x, w, b):
        return None
    w = w + 1.0  # in γ's dtype, as its forward computes it
    if torch.is_autocast_enabled():  # its forward's _cast_if_autocast_enabled, then F.layer_norm with autocast off
        dtype = torch.get_autocast_dtype(x.device.type)
        x, w, b = (
            t.to(dtype) if t is not None and t.is_floating_point() and t.device.type == x.device.type
            and t.dtype != torch.float64 else t
            for t in (x, w, b)
        )
    return ops.dispatch.fused(x, None, w, b, eps, rms=False, how=how)[0]


def _deberta_layer_norm(how, x, w, b, eps, m):
    if w is None or b is None or not _fits(x, w, b):
        return None
    return ops.dispatch.fused(x, None, w, b, eps, rms=False, rounding=_r.DEBERTA, how=how)[0]


# ---- what a recognised module's settings allow ----------------------------------------------------

_FAST_NORM = "timm's fast-norm mode is on (its rounding depends on apex and the autocast dtype); it runs unchanged"


def _over_one_dim(m: nn.Module) -> str:
    n = len(m.normalized_shape)  # type: ignore[arg-type]  # a tuple attribute; nn.Module.__getattr__ types it Tensor | Module
    if n == 1:
        return ""
    return f"it normalizes over its last {n} dimensions and the kernels over one; it runs unchanged"


def _select_layer_norm(m, b):
    if getattr(m, "_fast_norm", False):
        return None, _FAST_NORM
    why = _over_one_dim(m)
    return (None, why) if why else (b, "")


def _select_channels_first(m, b):
    if getattr(m, "_fast_norm", False):
        return None, _FAST_NORM
    fmt = getattr(m, "data_format", "channels_first")
    if fmt == "channels_last":  # ConvNextLayerNorm: then it is a plain LayerNorm
        return _select_layer_norm(m, Binding("layer_norm", b.weight, b.bias, b.eps))
    if fmt != "channels_first":
        return None, f"data_format={fmt!r}, neither channels_first nor channels_last; it runs unchanged"
    why = _over_one_dim(m)
    return (None, why) if why else (b, "")


def _select_timm(m, b):
    if getattr(m, "_fast_norm", False):
        return None, _FAST_NORM
    why = _over_one_dim(m)
    return (None, why) if why else (b, "")


def _select_one_dim(m, b):
    why = _over_one_dim(m)
    return (None, why) if why else (b, "")


_STATS_IN_INPUT_DTYPE = "statistics in the input's own dtype; the kernels accumulate in float32 and cannot round so"


def _select_float32_rms_norm(m, b):
    if isinstance(getattr(m, "normalized_shape", None), tuple):  # timm's RmsNormFp32 may normalize over several
        why = _over_one_dim(m)
        if why:
            return None, why
    reads = _reads(type(m))
    # Gemma-3n's RMSNorm(with_scale=False) has no γ: its forward reads `with_scale` first
    if "with_scale" in reads and not getattr(m, "with_scale", True):
        return Binding(b.kind, None, None, b.eps), ""
    # diffusers' StableAudio3RMSNorm(force_fp32=False) computes in the input's dtype
    if "force_fp32" in reads and not getattr(m, "force_fp32", True):
        return None, f"force_fp32=False: {_STATS_IN_INPUT_DTYPE}; it runs unchanged"
    return b, ""


def _select_t5(m, b):
    # diffusers' RMSNorm: T5's order, then + β where it has one; without γ, x̂ cast back to the input's dtype
    if b.bias is not None and getattr(m, b.bias, None) is not None:
        return None, ("it adds β after T5's order (x̂ rounded to γ's dtype, times γ, then + β: three roundings) "
                      "and the kernels round x̂·γ + β once; it runs unchanged")
    if b.weight is not None and getattr(m, b.weight, None) is None:
        return Binding("float32_rms_norm", None, None, b.eps), ""
    return Binding(b.kind, b.weight, None, b.eps), ""


def _select_upcast_layer_norm(m, b):
    why = _over_one_dim(m)
    return (None, why) if why else _select_float32_layer_norm(m, b)


def _select_float32_layer_norm(m, b):
    w = getattr(m, b.weight, None) if b.weight is not None else None
    if isinstance(w, Tensor) and w.dim() != 1:
        return None, (f"γ has shape {tuple(w.shape)} (one γ per head, as in a q/k norm) and the kernels take one "
                      "γ per column; it runs unchanged")
    return b, ""


_LAYER_NORM = Anchor("torch.nn.modules.normalization", "LayerNorm", "weight", "bias", "eps")
_GATED = "gated RMSNorm"

KINDS: dict[str, NormKind] = {
    k.name: k
    for k in (
        NormKind(
            "layer_norm",
            "statistics and x̂·γ + β in float32, cast to the input's dtype at the end (autocast's dtype under autocast)",
            (_LAYER_NORM, Anchor("timm.layers.norm", "LayerNorm", "weight", "bias", "eps")),
            _layer_norm,
            _select_layer_norm,
        ),
        NormKind(
            "channels_first_layer_norm",
            "channels moved last, then layer_norm's order (float32, one cast at the end), moved back as a view",
            (
                Anchor("transformers.models.convnext.modeling_convnext", "ConvNextLayerNorm", "weight", "bias", "eps"),
                Anchor("timm.layers.norm", "LayerNorm2d", "weight", "bias", "eps"),
                Anchor("transformers.models.eomt.modeling_eomt", "EomtLayerNorm2d", "weight", "bias", "eps"),
                Anchor("diffusers.models.unets.unet_stable_cascade", "SDCascadeLayerNorm", "weight", "bias", "eps"),
            ),
            _layer_norm,
            _select_channels_first,
            layout="channels_first",
        ),
        NormKind(
            "rms_norm",
            "statistics and x̂·γ in float32, cast to the input's dtype at the end",
            (Anchor("torch.nn.modules.normalization", "RMSNorm", "weight", None, "eps"),),
            _rms_norm,
            _select_one_dim,
        ),
        NormKind(
            "llama_rms_norm",
            "x̂ in float32, cast to the input's dtype, then multiplied by γ (output: promoted dtype of γ and x)",
            (
                Anchor("transformers.models.llama.modeling_llama", "LlamaRMSNorm"),
                Anchor("transformers.models.llama4.modeling_llama4", "Llama4TextRMSNorm", eps="eps"),
                Anchor("transformers.models.cpmant.modeling_cpmant", "CpmAntLayerNorm", eps="eps"),
            ),
            _llama_rms_norm,
        ),
        NormKind(
            "gemma_rms_norm",
            "x̂·(1 + γ) all in float32, cast to the input's dtype at the end",
            (
                Anchor("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", eps="eps"),
                Anchor("diffusers.models.transformers.transformer_qwenimage21", "QwenImage21ZeroCenterRMSNorm",
                       eps="eps"),
            ),
            _gemma_rms_norm,
        ),
        NormKind(
            "t5_layer_norm",
            "RMS statistics in float32; x̂ cast to γ's dtype if γ is half precision, then multiplied by γ",
            (
                Anchor("transformers.models.t5.modeling_t5", "T5LayerNorm"),
                Anchor("diffusers.models.normalization", "RMSNorm", "weight", "bias", "eps"),
            ),
            _t5_layer_norm,
            _select_t5,
        ),
        NormKind(
            "float32_rms_norm",
            "x̂·γ in float32 (γ up-cast; no γ for the unweighted ones), one cast to the input's dtype at the end",
            (
                Anchor("transformers.models.olmo2.modeling_olmo2", "Olmo2RMSNorm"),
                Anchor("transformers.models.helium.modeling_helium", "HeliumRMSNorm"),
                Anchor("transformers.models.moshi.modeling_moshi", "MoshiRMSNorm", eps="eps"),
                Anchor("transformers.models.gemma3n.modeling_gemma3n", "Gemma3nRMSNorm", eps="eps"),
                Anchor("transformers.models.llama4.modeling_llama4", "Llama4TextL2Norm", weight=None, eps="eps"),
                Anchor("diffusers.models.normalization", "MochiRMSNorm", eps="eps"),
                Anchor("diffusers.models.transformers.transformer_cosmos3", "Cosmos3NemotronRMSNorm", eps="eps"),
                Anchor("diffusers.models.transformers.transformer_stable_audio3", "StableAudio3RMSNorm", "gamma",
                       eps="eps"),
                Anchor("timm.layers.norm", "RmsNormFp32", eps="eps"),
            ),
            _float32_rms_norm,
            _select_float32_rms_norm,
        ),
        NormKind(
            "channels_first_float32_rms_norm",
            "float32_rms_norm's order over the channels of (N, C, H, W), the output in the input's memory format",
            (Anchor("timm.layers.norm", "RmsNorm2dFp32", eps="eps"),),
            _float32_rms_norm,
            _select_timm,
            layout="channels_first_dense",
        ),
        NormKind(
            "input_dtype_rms_norm",
            "torch's ops in the input's dtype: for float32 input (outside autocast) float32_rms_norm's order; "
            "16-bit input runs unchanged",
            (Anchor("timm.layers.norm", "RmsNorm", eps="eps"),),
            _input_dtype_rms_norm,
            _select_timm,
        ),
        NormKind(
            "channels_first_input_dtype_rms_norm",
            "input_dtype_rms_norm's order over the channels of (N, C, H, W), the output in the input's memory format",
            (Anchor("timm.layers.norm", "RmsNorm2d", eps="eps"),),
            _input_dtype_rms_norm,
            _select_timm,
            layout="channels_first_dense",
        ),
        NormKind(
            "float32_layer_norm",
            "statistics and x̂·γ in float32 (γ up-cast), one cast to the input's dtype at the end",
            (
                Anchor("transformers.models.cohere.modeling_cohere", "CohereLayerNorm"),
                Anchor("transformers.models.olmo.modeling_olmo", "OlmoLayerNorm", weight=None, eps=1e-5),
            ),
            _float32_layer_norm,
            _select_float32_layer_norm,
        ),
        NormKind(
            "upcast_layer_norm",
            "x, γ and β up-cast to float32 for F.layer_norm, one cast to the input's dtype at the end (where "
            "autocast would run F.layer_norm in a 16-bit dtype, it runs unchanged)",
            (
                Anchor("diffusers.models.normalization", "FP32LayerNorm", "weight", "bias", "eps"),
                Anchor("timm.layers.norm", "LayerNormFp32", "weight", "bias", "eps"),
            ),
            _upcast_layer_norm,
            _select_upcast_layer_norm,
        ),
        NormKind(
            "channels_first_upcast_layer_norm",
            "upcast_layer_norm's order over the channels of (N, C, H, W), moved back as a view",
            (Anchor("timm.layers.norm", "LayerNorm2dFp32", "weight", "bias", "eps"),),
            _upcast_layer_norm,
            _select_upcast_layer_norm,
            layout="channels_first",
        ),
        NormKind(
            "layer_norm_1p",
            "1 + γ rounded to γ's dtype, then layer_norm's order (all in the autocast dtype under autocast)",
            (Anchor("transformers.models.nemotron.modeling_nemotron", "NemotronLayerNorm1P", "weight", "bias", "eps"),),
            _layer_norm_1p,
            _select_one_dim,
        ),
        NormKind(
            "deberta_layer_norm",
            "x̂ in float32, cast to the input's dtype, then γ·x̂ + β (output: promoted dtype of γ, x and β)",
            (Anchor("transformers.models.deberta.modeling_deberta", "DebertaLayerNorm", "weight", "bias"),),
            _deberta_layer_norm,
        ),
    )
}

UNFUSED: dict[str, Unfused] = {
    u.name: u
    for u in (
        Unfused(
            "gated_rms_norm",
            f"{_GATED} (it normalizes x·act(z), or multiplies the norm by act(z), for a second input z); normlib's "
            "kernels take no gate, so it runs unchanged",
            tuple(
                Anchor(f"transformers.models.{mod}.modeling_{mod}", name)
                for mod, name in (
                    ("mamba2", "MambaRMSNormGated"),
                    ("zamba2", "Zamba2RMSNormGated"),
                    ("bamba", "BambaRMSNormGated"),
                    ("qwen3_next", "Qwen3NextRMSNormGated"),
                    ("kimi_linear", "KimiLinearRMSNormGated"),
                    ("falcon_h1", "FalconH1RMSNormGated"),
                )
            ),
        ),
        Unfused(
            "simple_norm",
            "x·rsqrt(var(x) + ε) with Bessel's correction and no mean subtracted (timm's SimpleNorm); normlib's "
            "kernels compute LayerNorm or RMSNorm, not this, so it runs unchanged",
            tuple(Anchor("timm.layers.norm", name, eps="eps")
                  for name in ("SimpleNorm", "SimpleNormFp32", "SimpleNorm2d", "SimpleNorm2dFp32")),
        ),
        Unfused(
            "frozen_batch_norm",
            "a batch norm with frozen statistics, i.e. a per-channel affine map; normlib has no kernel for it, "
            "so it runs unchanged",
            (Anchor("transformers.models.detr.modeling_detr", "DetrFrozenBatchNorm2d"),),
        ),
        Unfused(
            "torch_norm_without_kernel",
            "normlib has no fused kernel for BatchNorm, GroupNorm, InstanceNorm or LocalResponseNorm, so it runs "
            "unchanged",
            torch_classes=(nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm),
        ),
    )
}


# ---- what a method computes: its normalised code, the globals it reads, the methods it calls -------


def _locals(fn_tree: ast.AST) -> set:
    """Names local to a function: its arguments and every name it binds (not those declared global)."""
    names, outer = set(), set()
    for node in ast.walk(fn_tree):
        if isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            outer.update(node.names)
    return names - outer


class _Normalise(ast.NodeTransformer):
    """Drops annotations, decorators and docstrings (any bare string statement), and renames locals in order."""

    def __init__(self, local_names: set):
        self.local_names: set = local_names
        self.renamed: dict[str, str] = {}

    def _rename(self, name: str) -> str:
        if name not in self.local_names:
            return name
        return self.renamed.setdefault(name, f"_v{len(self.renamed)}")

    def visit_FunctionDef(self, node):
        node.decorator_list, node.returns, node.type_comment = [], None, None
        node.name = "f"
        self.generic_visit(node)
        node.body = node.body or [ast.Pass()]
        return node

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_arg(self, node):
        node.annotation, node.type_comment = None, None
        node.arg = self._rename(node.arg)
        return node

    def visit_Name(self, node):
        node.id = self._rename(node.id)
        return node

    def visit_AnnAssign(self, node):
        if node.value is None:  # a bare annotation computes nothing
            return None
        return self.visit(ast.Assign(targets=[node.target], value=node.value, lineno=0))

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return None  # a docstring, or any string statement: no effect
        return self.generic_visit(node)


_FunctionNode = Union[ast.FunctionDef, ast.AsyncFunctionDef]


def _parse(src: str) -> Optional[_FunctionNode]:
    try:
        tree = ast.parse(textwrap.dedent(src)).body[0]
    except (SyntaxError, IndexError):
        return None
    return tree if isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _normalised(tree: _FunctionNode) -> tuple[_FunctionNode, set, Optional[str]]:
    """``(normalised tree, its global names, the renamed name of its first argument)``."""
    local_names = _locals(tree)
    globals_ = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local_names
    first = tree.args.args[0].arg if tree.args.args else None
    norm = _Normalise(local_names)
    tree = norm.visit(tree)
    return tree, globals_, norm.renamed.get(first) if first is not None else None


def _dump(tree: ast.AST) -> str:
    return ast.dump(tree, annotate_fields=False, include_attributes=False)


def _owner(cls: type, name: str, after: Optional[type] = None) -> Optional[type]:
    """The class in ``cls.__mro__`` (after ``after``, if given) whose ``__dict__`` defines ``name``."""
    mro = cls.__mro__
    if after is not None:
        mro = mro[mro.index(after) + 1:] if after in mro else ()
    return next((c for c in mro if name in c.__dict__), None)


def _is_self_call(node: ast.AST, self_name: Optional[str]) -> Optional[str]:
    """``name`` for a call ``self.name(...)``."""
    if self_name is not None and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        v = node.func.value
        if isinstance(v, ast.Name) and v.id == self_name:
            return node.func.attr
    return None


def _self_attribute(node: ast.AST, self_name: Optional[str]) -> Optional[str]:
    """``name`` for a read of ``self.name``."""
    if self_name is not None and isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        if isinstance(node.value, ast.Name) and node.value.id == self_name:
            return node.attr
    return None


def _is_super_attr(node: ast.AST) -> Optional[str]:
    """``name`` for ``super().name``."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
        f = node.value.func
        if isinstance(f, ast.Name) and f.id == "super" and not node.value.args:
            return node.attr
    return None


def _is_method(cls: type, name: str) -> bool:
    attr = inspect.getattr_static(cls, name, None)
    return inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod))


_MISSING = object()
# Classifying a class fills several caches and marks a method being read (None in _SIGS) while it recurses:
# one thread at a time (reentrant, for the recursion), so that no thread reads another's half-made answer.
_LOCK = threading.RLock()
_SIGS: dict = {}  # (cls, method name) -> signature, or None where it cannot be told
_READS: dict = {}  # (cls, method name) -> the attributes of self it reads (through the methods it calls, too)


def _signature(cls: type, name: str, depth: int = 0):
    """A value equal for two classes exactly when their method ``name`` computes the same thing.

    Built from the method's normalised syntax tree, the identity of every global
    it reads, the signatures of the methods it calls on ``self`` and the
    identity of what its ``super().…`` calls resolve to. ``None`` when it cannot
    be told (no source, too deep).
    """
    key = (cls, name)
    with _LOCK:  # never read outside it: while one thread recurses, its entry is a placeholder None
        if key in _SIGS:
            return _SIGS[key]
        return _read_signature(cls, name, depth, key)


def _read_signature(cls: type, name: str, depth: int, key: tuple):
    """:func:`_signature`'s work, under ``_LOCK``."""
    _SIGS[key] = None  # guards against recursion
    owner = _owner(cls, name)
    fn = owner.__dict__.get(name) if owner is not None else None
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    if not inspect.isfunction(fn) or depth > 3:
        return None
    if set(fn.__code__.co_freevars) - {"__class__"}:  # a closure: only the very same function is the same
        _SIGS[key], _READS[key] = ("function", id(fn)), set()
        return _SIGS[key]
    try:
        tree = _parse(inspect.getsource(fn))
    except (OSError, TypeError):
        tree = None
    if tree is None:
        return None
    tree, global_names, self_name = _normalised(tree)
    globals_ = {n: id(fn.__globals__.get(n, getattr(builtins, n, _MISSING))) for n in global_names}
    calls, supers, reads = {}, {}, set()
    for node in ast.walk(tree):
        called = _is_self_call(node, self_name)
        if called is not None and called not in calls and _is_method(cls, called):
            sig = _signature(cls, called, depth + 1)
            if sig is None:
                return None
            calls[called] = sig
            reads |= _READS.get((cls, called), set())
        attr = _self_attribute(node, self_name)
        if attr is not None and not _is_method(cls, attr):
            reads.add(attr)
        via_super = _is_super_attr(node)
        if via_super is not None:
            parent = _owner(cls, via_super, after=owner)
            supers[via_super] = id(parent.__dict__[via_super]) if parent is not None else None
    sig = (_dump(tree), tuple(sorted(globals_.items())), tuple(sorted(calls.items())), tuple(sorted(supers.items())))
    _SIGS[key], _READS[key] = sig, reads
    return sig


def _reads(cls: type) -> set:
    """The attributes of ``self`` that ``cls``'s forward reads (empty where its computation cannot be told)."""
    _signature(cls, "forward")
    return _READS.get((cls, "forward"), set())


def _forward_dump(cls: type) -> Optional[str]:
    """The normalised syntax tree of ``cls``'s forward alone (cheap: no globals, no methods)."""
    sig = _signature(cls, "forward")
    return sig[0] if isinstance(sig, tuple) and sig and sig[0] != "function" else None


# ---- anchors: found in their files first, imported only when a class has their syntax tree ----------

_STATIC: dict = {}  # (module, class) -> the normalised dump of its forward read from the file, or None


def _library_loaded(mod: str) -> bool:
    return mod in sys.modules or mod.partition(".")[0] in sys.modules


def _anchor_file(module: str) -> Optional[str]:
    """The source file of ``module`` (dotted), found from its top-level package's folder: nothing is imported."""
    top, _, rest = module.partition(".")
    pkg = sys.modules.get(top)
    if pkg is not None:
        folders = list(getattr(pkg, "__path__", None) or [])
    else:
        spec = importlib.util.find_spec(top)  # a top-level name: finding it imports nothing
        if spec is None:
            return None
        folders = list(spec.submodule_search_locations or [])
    parts = rest.split(".") if rest else []
    for folder in folders:
        base = os.path.join(folder, *parts)
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def _static_dump(anchor: Anchor) -> Optional[str]:
    """The anchor's forward, parsed from its source file without importing it; ``None`` if not found there."""
    key = (anchor.module, anchor.name)
    if key in _STATIC:
        return _STATIC[key]
    _STATIC[key] = None
    try:
        path = _anchor_file(anchor.module)
        if path is None:  # not installed, or a module without a source file
            return None
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (ImportError, ValueError, AttributeError, TypeError, OSError, UnicodeDecodeError):
        return None
    found = re.search(rf"^class {re.escape(anchor.name)}\b.*?:[ \t]*$", text, re.M)
    if found is None:
        return None
    rest = text[found.end():]
    end = re.search(r"^\S", rest, re.M)  # the next statement at the top level ends the class
    body = rest[: end.start()] if end else rest
    fwd = re.search(r"^([ \t]+)def forward\(", body, re.M)
    if fwd is None:  # inherited: only importing tells
        return None
    lines, out = body[fwd.start():].splitlines(), []
    indent = len(fwd.group(1))
    for i, line in enumerate(lines):
        stripped = line.strip()
        if i and stripped and not stripped.startswith("#") and len(line) - len(line.lstrip()) <= indent:
            break
        out.append(line)
    tree = _parse("\n".join(out))
    if tree is not None:
        _STATIC[key] = _dump(_normalised(tree)[0])
    return _STATIC[key]


def _anchor_class(anchor: Anchor, dump: Optional[str]) -> Optional[type]:
    """The anchor class, if its forward could equal one whose syntax tree is ``dump``; ``None`` if it cannot.

    A model of one family (say Qwen2) imports its own modeling file only, and a
    user's copy of a class imports none: the anchor's file (Llama's) is read
    without importing anything, and imported only once a class with the
    anchor's syntax tree turns up. Where that file does not hold the forward
    (inherited), the anchor is imported only if its library is in use already.
    """
    if anchor.module in sys.modules:
        return getattr(sys.modules[anchor.module], anchor.name, None)
    static = _static_dump(anchor)
    if static is None and not _library_loaded(anchor.module):
        return None
    if static is not None and static != dump:
        return None
    try:
        module = importlib.import_module(anchor.module)
    except Exception:  # another version of the library, without that file, or one that fails to import
        return None
    cls = getattr(module, anchor.name, None)
    return cls if isinstance(cls, type) else None


def _same_computation(cls: type, anchor: type) -> bool:
    if cls is anchor:
        return True
    sig = _signature(cls, "forward")
    return sig is not None and sig == _signature(anchor, "forward")


_TORCH_FUSED = (nn.LayerNorm, nn.RMSNorm)
_TORCH_NORMS = _TORCH_FUSED + UNFUSED["torch_norm_without_kernel"].torch_classes
_UNKNOWN = ("its forward computes none of the norms normlib fuses (normlib.interop.KINDS); it runs unchanged "
            "(if it is a standard norm, please report it)")
_CLASSES: dict = {}  # (class, which anchor libraries were loaded) -> (kind or Unfused or None, anchor or None, why)


def _libraries() -> tuple:
    """Which anchors' libraries are imported: a class's match can only change when these do."""
    return tuple(_library_loaded(a.module) for table in (KINDS, UNFUSED) for e in table.values() for a in e.anchors)


# what recognition makes of a class or module: a kind to swap to, a norm left alone with its reason, none of
# the norms normlib knows, or a normlib module already
_Status = Literal["swap", "left", "unknown", "normlib"]


class _Match(NamedTuple):
    """What a class's forward computes: a kind (``entry`` a NormKind), a norm left alone (an Unfused entry, or a
    torch norm's subclass with a forward of its own: ``status`` "left"), none of them ("unknown"), or a normlib
    class ("normlib"); with the anchor it matched and the reason the report gives."""

    entry: Union[NormKind, Unfused, None]
    anchor: Optional[Anchor]
    status: _Status
    why: str


def _match(cls: type) -> _Match:
    """What ``cls``'s forward computes (:class:`_Match`), from its forward alone; cached per class."""
    key = (cls, _libraries())
    if key in _CLASSES:
        return _CLASSES[key]
    with _LOCK:
        if key not in _CLASSES:
            _CLASSES[key] = _classify_class(cls)
    return _CLASSES[key]


def _classify_class(cls: type) -> _Match:
    """:func:`_match`'s work, under ``_LOCK``."""
    if cls.__module__.startswith("normlib."):
        return _Match(None, None, "normlib", "already a normlib module")
    if cls.__module__.startswith("torch.") and not issubclass(cls, _TORCH_NORMS):
        return _Match(None, None, "unknown", _UNKNOWN)  # torch's own Linear, Dropout, ...: known not to be norms
    return _match_forward(cls)


def _match_forward(cls: type) -> _Match:
    dump = _forward_dump(cls)
    for table in (KINDS, UNFUSED):
        for entry in table.values():
            for anchor in entry.anchors:
                anchor_cls = _anchor_class(anchor, dump)
                if isinstance(anchor_cls, type) and _same_computation(cls, anchor_cls):
                    if isinstance(entry, Unfused):
                        return _Match(entry, anchor, "left", entry.reason)
                    return _Match(entry, anchor, "swap", _anchor_why(cls, anchor_cls))
    for entry in UNFUSED.values():
        if entry.torch_classes and issubclass(cls, entry.torch_classes):
            return _Match(entry, None, "left", entry.reason)
    for tc in _TORCH_FUSED:
        if issubclass(cls, tc):
            return _Match(None, None, "left", f"subclass of torch.nn.{tc.__name__} with a forward of its own, which "
                                              "normlib does not know; it runs unchanged")
    return _Match(None, None, "unknown", _UNKNOWN)


def _anchor_why(cls: type, anchor_cls: type) -> str:
    name = f"{anchor_cls.__module__}.{anchor_cls.__qualname__}"
    if anchor_cls.__module__.startswith("torch.") and issubclass(cls, anchor_cls):
        return name + ("" if cls is anchor_cls else " subclass")
    return f"forward identical to {name}"


def classify(cls: type) -> tuple[Optional[str], str]:
    """``(kind, why)`` for a norm class from its forward alone: a name of ``KINDS``, or ``None`` and the reason.

    Instances may still be left alone by their settings (``recognise`` looks
    at those): a ConvNeXt LayerNorm is ``channels_first_layer_norm`` here and
    ``layer_norm`` with ``data_format="channels_last"``. Norms deliberately
    left alone (``UNFUSED``) give their reason.

    Example:
        >>> classify(torch.nn.LayerNorm)
        ('layer_norm', 'torch.nn.modules.normalization.LayerNorm')
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise NormTypeError(f"cls must be a torch.nn.Module subclass (got {cls!r})")
    m = _match(cls)
    return (m.entry.name, m.why) if isinstance(m.entry, NormKind) else (None, m.why)


@dataclass(frozen=True)
class Verdict:
    """What normlib makes of one module: the binding a swapped forward reads, or why it is left alone.

    ``status`` says which: ``"swap"`` (a kind, ``binding`` set), ``"left"``
    (normlib knows what the class computes, or that a setting or the module
    itself keeps it from the kernels: the report lists it with ``reason``),
    ``"unknown"`` (a forward that computes none of the kinds: listed only if it
    looks like a norm) or ``"normlib"`` (a normlib module already).
    """

    status: _Status
    reason: str
    binding: Optional[Binding] = None

    @staticmethod
    def left(reason: str) -> "Verdict":
        return Verdict("left", reason)


def _verdict(module: nn.Module) -> Verdict:
    """What a swap makes of ``module``: see :class:`Verdict`."""
    cls = type(module)
    entry, anchor, status, why = _match(cls)
    if status != "swap":
        return Verdict(status, why)
    assert isinstance(entry, NormKind) and anchor is not None  # what _match returns with "swap"
    missing = {a for a in _reads(cls) if not hasattr(module, a)}
    b = Binding(entry.name, anchor.weight, anchor.bias, anchor.eps)
    if entry.select is not None and not missing - {anchor.weight}:
        selected, why_not = entry.select(module, b)
        if selected is None:
            return Verdict.left(why_not)
        b = selected
    missing -= {t for t in (anchor.weight, anchor.bias) if t is not None and t not in (b.weight, b.bias)}
    if missing:  # a γ the settings switch off (Gemma-3n's with_scale=False) need not exist
        return Verdict.left(f"{why}, but it has no attribute {', '.join(sorted(missing))}; it runs unchanged")
    return Verdict("swap", why, b)


def recognise(module: nn.Module) -> tuple[Optional[NormKind], str]:
    """``(kind, why)`` for a module; ``kind`` is ``None`` when normlib leaves it alone, and ``why`` says why.

    Example:
        >>> recognise(torch.nn.LayerNorm(4))[0].name
        'layer_norm'
    """
    if not isinstance(module, nn.Module):
        raise NormTypeError(f"module must be a torch.nn.Module (got {type(module).__name__})")
    v = _verdict(module)
    return (KINDS[v.binding.kind] if v.binding is not None else None), v.reason
