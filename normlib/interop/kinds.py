"""The kinds: what each norm class normlib fuses computes, as data, and each kind's forward through the kernels.

One entry per kind (:class:`NormKind`): the classes whose forward defines it
(:class:`Anchor`), its rounding order, its layout, the forward that hands the
kernels that order, and what a module's settings allow; and the norms
recognised and left alone on purpose (:class:`Unfused`), with the reason the
report gives. :func:`fused` decides, in one place, whether a swapped module's
call goes to the kernels or to its class's own forward. Adding a library's
norms means adding entries here; :mod:`normlib.interop.recognition` finds
which entry a class is, and reads nothing else from this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional, Union

import torch
from torch import Tensor, nn

from .. import ops
from ..ops import rounding as _r
from ..ops.routing import FUSED, PATH_OF, kernels_run_on, plan, wants_grad

__all__ = ["Anchor", "Binding", "NormKind", "Unfused", "KINDS", "UNFUSED", "fused"]

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
    # a recognised module's binding from its settings and the attributes its forward reads (recognition
    # tells them): (binding, "") or (None, why not)
    select: Optional[Callable[[nn.Module, Binding, set], tuple[Optional[Binding], str]]] = None
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


def _one_row(x: Tensor, m: nn.Module) -> bool:
    """``x``'s last dimension is the module's ``normalized_shape`` (one dimension, as the kernels normalize),
    where the module names one."""
    shape = getattr(m, "normalized_shape", None)
    return shape is None or x.shape[-1:] == tuple(shape)


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
    if not _one_row(x, m) or not _fits(x, w, b):
        return None
    x, w, b = _autocast("layer_norm", x, w, b)
    return ops.dispatch.fused(x, None, w, b, eps, rms=False, how=how)[0]


def _rms_norm(how, x, w, b, eps, m):
    if not _one_row(x, m) or not _fits(x, w):
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
    if not _one_row(x, m):
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


def _float32_layer_norm(how, x, w, b, eps, m):
    if not _fits(x, w, b) or (w is None and not _one_row(x, m)):
        return None
    return ops.dispatch.fused(x, None, w, b, eps, rms=False, how=how)[0]


def _upcast_layer_norm(how, x, w, b, eps, m):
    low = _autocast_dtype("layer_norm", x)
    if low is not None and low != torch.float32:  # F.layer_norm would run in autocast's 16-bit dtype
        return None
    return _float32_layer_norm(how, x, w, b, eps, m)


def _layer_norm_1p(how, x, w, b, eps, m):
    if w is None or not _one_row(x, m) or not _fits(x, w, b):
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


def _select_one_dim(m, b, reads):
    why = _over_one_dim(m)
    return (None, why) if why else (b, "")


def _select_unless_fast_norm(m, b, reads):
    """timm's norms (LayerNorm, RmsNorm and their 2d variants) in fast-norm mode run unchanged."""
    if getattr(m, "_fast_norm", False):
        return None, _FAST_NORM
    return _select_one_dim(m, b, reads)


def _select_channels_first(m, b, reads):
    if getattr(m, "_fast_norm", False):
        return None, _FAST_NORM
    fmt = getattr(m, "data_format", "channels_first")
    if fmt == "channels_last":  # ConvNextLayerNorm: then it is a plain LayerNorm
        return _select_one_dim(m, Binding("layer_norm", b.weight, b.bias, b.eps), reads)
    if fmt != "channels_first":
        return None, f"data_format={fmt!r}, neither channels_first nor channels_last; it runs unchanged"
    return _select_one_dim(m, b, reads)


_STATS_IN_INPUT_DTYPE = "statistics in the input's own dtype; the kernels accumulate in float32 and cannot round so"


def _select_float32_rms_norm(m, b, reads):
    if isinstance(getattr(m, "normalized_shape", None), tuple):  # timm's RmsNormFp32 may normalize over several
        why = _over_one_dim(m)
        if why:
            return None, why
    # Gemma-3n's RMSNorm(with_scale=False) has no γ: its forward reads `with_scale` first
    if "with_scale" in reads and not getattr(m, "with_scale", True):
        return Binding(b.kind, None, None, b.eps), ""
    # diffusers' StableAudio3RMSNorm(force_fp32=False) computes in the input's dtype
    if "force_fp32" in reads and not getattr(m, "force_fp32", True):
        return None, f"force_fp32=False: {_STATS_IN_INPUT_DTYPE}; it runs unchanged"
    return b, ""


def _select_t5(m, b, reads):
    # diffusers' RMSNorm: T5's order, then + β where it has one; without γ, x̂ cast back to the input's dtype
    if b.bias is not None and getattr(m, b.bias, None) is not None:
        return None, ("it adds β after T5's order (x̂ rounded to γ's dtype, times γ, then + β: three roundings) "
                      "and the kernels round x̂·γ + β once; it runs unchanged")
    if b.weight is not None and getattr(m, b.weight, None) is None:
        return Binding("float32_rms_norm", None, None, b.eps), ""
    return Binding(b.kind, b.weight, None, b.eps), ""


def _select_upcast_layer_norm(m, b, reads):
    why = _over_one_dim(m)
    return (None, why) if why else _select_float32_layer_norm(m, b, reads)


def _select_float32_layer_norm(m, b, reads):
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
            _select_unless_fast_norm,
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
            _select_unless_fast_norm,
            layout="channels_first_dense",
        ),
        NormKind(
            "input_dtype_rms_norm",
            "torch's ops in the input's dtype: for float32 input (outside autocast) float32_rms_norm's order; "
            "16-bit input runs unchanged",
            (Anchor("timm.layers.norm", "RmsNorm", eps="eps"),),
            _input_dtype_rms_norm,
            _select_unless_fast_norm,
        ),
        NormKind(
            "channels_first_input_dtype_rms_norm",
            "input_dtype_rms_norm's order over the channels of (N, C, H, W), the output in the input's memory format",
            (Anchor("timm.layers.norm", "RmsNorm2d", eps="eps"),),
            _input_dtype_rms_norm,
            _select_unless_fast_norm,
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
