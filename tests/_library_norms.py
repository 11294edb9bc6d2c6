"""Every norm class in the installed ``transformers`` and ``diffusers``, and the ones normlib deliberately leaves alone.

``norm_classes(library)`` imports every modeling module of the library (for
transformers ``transformers.models.*.modeling_*``, for diffusers every module
under ``diffusers.models``) and returns its norm classes, keyed
``"<module path below the models package>.<class name>"`` (transformers:
``"<model directory>.<class name>"``; timm: every module of ``timm.layers``,
``"<module>.<class name>"``). A *norm class* is a module class defined
there that subclasses one of torch's norms, or whose name contains "norm" and
whose forward is a leaf computation: it calls no submodule
(``self.<attribute>(...)`` of an attribute that is not a method, or a local
variable such as an element of a ``ModuleList``) and is not ``nn.Module``'s
missing forward. That leaves out containers named after the norms they hold
(``Wav2Vec2EncoderStableLayerNorm``, ``DFineConvNormLayer``, StableLM's
``StableLmLayerNormPerHead``, ``RobertaPreLayerNormModel``, diffusers'
``AdaLayerNorm``): their norms are classes of their own, scanned on their own.

``LEFT_ALONE[library]`` lists the norm classes normlib recognises as none of
its kinds on purpose, each with the reason. Classes normlib itself knows to
leave alone (``normlib.interop.UNFUSED``: gated RMSNorms, frozen batch norms,
torch's BatchNorm/GroupNorm) give their own reason and need no entry. Keys of
transformers are ``"<model directory>.<class name>"`` in transformers 5.x and
4.x alike; an entry for a class one version does not have is fine (the other
has it). A key ending in ``@4`` (or ``@5``) holds for that major version only:
the class is recognised in the other.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap

from torch import nn

from normlib.interop.kinds import _STATS_IN_INPUT_DTYPE

TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)

TRANSFORMERS_LEFT_ALONE = {
    # statistics in the input's own dtype (no up-cast): the kernels cannot reproduce that rounding
    "vitdet.VitDetLayerNorm": _STATS_IN_INPUT_DTYPE + " (and it normalizes dim 1 of (N, C, H, W))",
    "gradium_phonon_tts.GradiumPhononTTSFlowLayerNorm": _STATS_IN_INPUT_DTYPE,
    "pocket_tts.PocketTTSFlowLayerNorm": _STATS_IN_INPUT_DTYPE,
    "gradium_phonon_tts.GradiumPhononTTSTimestepNorm": _STATS_IN_INPUT_DTYPE + " (RMS, γ·x before the scale)",
    "pocket_tts.PocketTTSTimestepNorm": _STATS_IN_INPUT_DTYPE + " (variance with Bessel's correction)",
    "imagegpt.ImageGPTLayerNorm": _STATS_IN_INPUT_DTYPE + " (an RMSNorm by division)",
    # rounding orders no kind reproduces (yet)
    "deepseek_v4.DeepseekV4UnweightedRMSNorm": "1/RMS rounded to the input's dtype before it multiplies x",
    "glm5_next.Glm5NextTextUnweightedRMSNorm": "1/RMS rounded to the input's dtype before it multiplies x",
    "inkling2.Inkling2UnweightedRMSNorm": "1/RMS rounded to the input's dtype before it multiplies x",
    "hy_v4.HYV4UnweightedRMSNorm": "returns 1/RMS itself, not a normalized x",
    "muse_spark.MuseSparkTextCenteredRMSNorm": "1 + γ rounded to γ's dtype before the float32 product (Gemma adds in float32)",
    "muse_spark.MuseSparkTextInputScaledRMSNorm": "scales x by 1 + γ before the norm, with two roundings",
    "chameleon.ChameleonLayerNorm": "γ and β of shape (heads, head_dim), applied after F.layer_norm (float32 under autocast)",
    "videoprism.VideoPrismLayerNorm": "1 + γ, but float32 under autocast (Nemotron's casts to the autocast dtype)",
    "esm.EsmFoldLayerNorm": "casts γ and β to bfloat16 and switches autocast off for bfloat16 input",
    "esmc.EsmcLayerNorm": "torch's LayerNorm cast back to the input's dtype (float32 under autocast, then cast)",
    "esmfold2.EsmFold2LayerNorm": "F.layer_norm on a float32 copy: raises for half-precision γ, which the kernels would take",
    "squeezebert.SqueezeBertLayerNorm": "channels-first over (N, C, T) input: the channel dimension moved last and back",
    "xlstm.xLSTMMultiHeadLayerNorm": "per-head statistics with its own weight-and-bias method",
    "xlstm.xLSTMRMSNorm": "RMS statistics through its own helper methods, γ and β applied by another",
    "gemma3n.Gemma3nAudioCumulativeGroupNorm": "cumulative statistics over time (a streaming group norm)",
    "pe_audio.PeAudioMaskedGroupNorm": "a group norm with a padding mask",
    "pe_audio_video.PeAudioVideoMaskedGroupNorm": "a group norm with a padding mask",
    "pe_video.PeVideoMaskedGroupNorm": "a group norm with a padding mask",
    "bit.BitGroupNormActivation": "a group norm followed by an activation",
    "emu3.Emu3VQVAEGroupNorm": "a group norm with an unused second input",
    "qwen4_exp.Qwen4ExpTextRMSNorm": "Gemma's order, but with statistics per group of group_size features when set",
    "falcon_mamba.FalconMambaRMSNorm@4": "Llama's order through a module-level helper (rms_forward), which "
    "recognition does not follow (5.x's class has Llama's forward)",
    "zaya.ZayaQKNorm": "L2-normalizes queries and keys together, with a learned temperature",
    "phi4_multimodal.Phi4MultimodalAudioMeanVarianceNormLayer": "fixed (global) mean and 1/std: an affine map",
    "mobilebert.NoNorm": "x·γ + β without statistics: an affine map",
}


_L2 = "an L2 normalization (F.normalize: x / max(‖x‖, 1e-12)) times √C, not x·rsqrt(mean(x²) + ε)"
DIFFUSERS_LEFT_ALONE = {
    "autoencoders.autoencoder_kandinsky6_sr.Kandinsky6VAERMSNorm": _L2,
    "latent_upscaler.latent_upscaler_kandinsky6_sr.Kandinsky6SRLatentUpscalerRMSNorm": _L2,
    "autoencoders.autoencoder_kl_wan.WanRMS_norm": _L2,
    "autoencoders.autoencoder_kl_qwenimage.QwenImageRMS_norm": _L2,
    "autoencoders.autoencoder_kl_qwenimage21.QwenImage21RMS_norm": _L2,
    "autoencoders.autoencoder_kl_hunyuanimage_refiner.HunyuanImageRefinerRMS_norm": _L2,
    "autoencoders.autoencoder_kl_hunyuanvideo15.HunyuanVideo15RMS_norm": _L2,
    "autoencoders.autoencoder_kl_ltx2.PerChannelRMSNorm": _STATS_IN_INPUT_DTYPE + " (x / sqrt(mean(x²) + ε) over dim 1)",
    "autoencoders.autoencoder_kl_ltx2_audio.LTX2AudioPixelNorm": _STATS_IN_INPUT_DTYPE + " (x / sqrt(mean(x²) + ε))",
    "transformers.transformer_krea2.Krea2RMSNorm": "1 + γ rounded to γ's dtype, then F.rms_norm on a float32 copy "
    "(Gemma adds in float32)",
    "normalization.GlobalResponseNorm": "global response normalization (ConvNeXt-V2): spatial L2 norms divided by "
    "their channel mean",
    "unets.unet_stable_cascade.GlobalResponseNorm": "global response normalization (ConvNeXt-V2): spatial L2 norms "
    "divided by their channel mean",
    "normalization.LpNorm": "an Lp normalization (F.normalize), without mean or ε inside a square root",
}

_EVO = "EvoNorm: a norm and an activation in one (x·σ(v·x) over group or batch statistics), which no kind computes"
_WITH_ACT = "a norm followed by dropout and an activation in one forward (the kernels compute the norm alone)"
TIMM_LEFT_ALONE = {
    **{f"evo_norm.EvoNorm2d{v}": _EVO for v in ("B0", "B1", "B2", "S0", "S0a")},
    "filter_response_norm.FilterResponseNormTlu2d": "filter response normalization: x·rsqrt(mean(x²) over H, W "
    "+ ε) per channel, then a learned threshold (TLU), not over the last dimension",
    "grn.GlobalResponseNorm": "global response normalization (ConvNeXt-V2): spatial L2 norms divided by their "
    "channel mean",
    "norm.LayerNormExp2d": "channels-first LayerNorm that, for input not contiguous, computes by hand with "
    "var_mean over dim 1 (another rounding than F.layer_norm's)",
    **{f"norm_act.{name}": _WITH_ACT for name in ("LayerNormAct", "LayerNormAct2d", "LayerNormAct2dFp32",
                                                    "LayerNormActFp32")},
}

LEFT_ALONE = {"transformers": TRANSFORMERS_LEFT_ALONE, "diffusers": DIFFUSERS_LEFT_ALONE, "timm": TIMM_LEFT_ALONE}


def left_alone(key: str, major: int, library: str = "transformers"):
    """The reason ``key`` is deliberately left alone under ``library`` ``major``.x, or ``None``."""
    table = LEFT_ALONE[library]
    return table.get(f"{key}@{major}") or table.get(key)


def _module_names(library: str):
    """``(key prefix, module name)`` for every modeling module of ``library``."""
    if library == "timm":  # its layers: the models build their norms from these
        import timm.layers as layers

        for info in pkgutil.iter_modules(layers.__path__):
            yield info.name, f"timm.layers.{info.name}"
        return
    if library == "diffusers":
        import diffusers.models as models

        for info in pkgutil.walk_packages(models.__path__, "diffusers.models."):
            if not info.ispkg:
                yield info.name.removeprefix("diffusers.models."), info.name
        return
    import transformers.models as models

    for info in pkgutil.iter_modules(models.__path__):
        pkg = f"transformers.models.{info.name}"
        try:
            sub = importlib.import_module(pkg)
        except Exception:  # a model directory whose package needs something not installed
            continue
        for s in pkgutil.iter_modules(getattr(sub, "__path__", [])):
            if s.name.startswith("modeling_"):
                yield info.name, f"{pkg}.{s.name}"


def _method(cls, name):
    owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
    fn = owner.__dict__[name] if owner is not None else None
    return fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn


def calls_a_submodule(cls, name="forward", _depth=0) -> bool:
    """Whether ``cls.<name>`` (or a method it calls on self) calls a submodule: then ``cls`` is a container."""
    fn = _method(cls, name)
    if not inspect.isfunction(fn) or _depth > 3:
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError):
        return False
    self_name = tree.args.args[0].arg if tree.args.args else None
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == self_name:
            attr = inspect.getattr_static(cls, f.attr, None)
            if inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod)):
                if calls_a_submodule(cls, f.attr, _depth + 1):
                    return True
                continue
            return True  # self.<submodule>(...)
        if isinstance(f, ast.Name) and f.id in local and f.id != self_name:
            return True  # a local: e.g. `for norm in self.norms: norm(x)`
    return False


def is_norm_class(cls) -> bool:
    if issubclass(cls, TORCH_NORMS):
        return True
    if "norm" not in cls.__name__.lower():
        return False
    owner = next((c for c in cls.__mro__ if "forward" in c.__dict__), None)
    return owner is not None and owner is not nn.Module and not calls_a_submodule(cls)


def norm_classes(library: str = "transformers") -> dict:
    """``{"<key prefix>.<class name>": class}`` for every norm class of the installed ``library``."""
    found = {}
    for prefix, module_name in _module_names(library):
        try:
            module = importlib.import_module(module_name)
        except Exception:  # an optional dependency missing (e.g. torchaudio)
            continue
        for name, cls in vars(module).items():
            if isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == module_name:
                if is_norm_class(cls):
                    found[f"{prefix}.{name}"] = cls
    return found
