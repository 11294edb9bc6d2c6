"""Each kind's rounding order, against the original class's own forward.

For every kind of ``normlib.interop.KINDS`` and the classes that define it
(``torch.nn``, transformers, diffusers and timm, built directly, random γ/β;
each library's cases skip where it is not installed; timm's run on its own
classes where timm imports, on ``tests/_timm_norm_copy.py`` elsewhere):

* on the CPU reference path (a swapped module runs its class's forward where the
  kernels do not apply) outputs and gradients are bitwise equal to the
  original's, in float32, bfloat16, float16 where the class computes in it, and
  with float32 γ on bfloat16 input (where the rounding orders differ most);
* through the kernels (Triton's interpreter on CPU, standing in for CUDA) the
  output is no further from a float64 evaluation of the original than twice the
  original's own error, and the float32 gradients too.

Shapes are tiny (the interpreter runs one program at a time).
"""

import copy
import importlib
import sys

import pytest
import torch
from torch import nn

import normlib as nl
from normlib import interop

from _helpers import assert_no_worse
from normlib.testing.tolerance import tolerance

N = 24  # features: not a power of two


def _tf(module: str, name: str):
    pytest.importorskip("transformers")
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, name)


def _df(module: str, name: str):
    pytest.importorskip("diffusers")
    return getattr(importlib.import_module(f"diffusers.models.{module}"), name)


def _real_timm():
    try:
        return importlib.import_module("timm.layers.norm")
    except Exception:  # not installed, or timm's torchvision does not load against this torch
        return None


TIMM = _real_timm()


@pytest.fixture(autouse=True)
def timm_norm(monkeypatch):
    """timm's norm module: timm's own where it imports, else tests/_timm_norm_copy.py installed as it."""
    if TIMM is not None:
        return TIMM
    fake = importlib.import_module("_timm_norm_copy")
    monkeypatch.setitem(sys.modules, "timm.layers.norm", fake)
    return fake


def _timm(name: str):
    return getattr(sys.modules["timm.layers.norm"], name)


def _cpmant(n):
    transformers = pytest.importorskip("transformers")
    norm = _tf("cpmant", "CpmAntLayerNorm")(transformers.CpmAntConfig(hidden_size=n, eps=1e-6))
    nn.init.ones_(norm.weight)  # torch.empty until the model's _init_weights runs
    return norm


# (id, kind, constructor of the norm for N features, input rank)
CASES = [
    ("nn.LayerNorm", "layer_norm", lambda n: nn.LayerNorm(n), 3),
    ("nn.LayerNorm-no-bias", "layer_norm", lambda n: nn.LayerNorm(n, bias=False), 3),
    ("ConvNextLayerNorm-last", "layer_norm",
     lambda n: _tf("convnext", "ConvNextLayerNorm")(n, data_format="channels_last"), 3),
    ("ConvNextLayerNorm-first", "channels_first_layer_norm",
     lambda n: _tf("convnext", "ConvNextLayerNorm")(n, data_format="channels_first"), 4),
    ("EomtLayerNorm2d", "channels_first_layer_norm", lambda n: _tf("eomt", "EomtLayerNorm2d")(n), 4),
    ("nn.RMSNorm", "rms_norm", lambda n: nn.RMSNorm(n, eps=1e-6), 3),
    ("nn.RMSNorm-eps-None", "rms_norm", lambda n: nn.RMSNorm(n), 3),
    ("LlamaRMSNorm", "llama_rms_norm", lambda n: _tf("llama", "LlamaRMSNorm")(n), 3),
    ("MambaRMSNorm", "llama_rms_norm", lambda n: _tf("mamba", "MambaRMSNorm")(n), 3),
    ("Llama4TextRMSNorm", "llama_rms_norm", lambda n: _tf("llama4", "Llama4TextRMSNorm")(n), 3),
    ("CpmAntLayerNorm", "llama_rms_norm", _cpmant, 3),
    ("GemmaRMSNorm", "gemma_rms_norm", lambda n: _tf("gemma", "GemmaRMSNorm")(n), 3),
    ("T5LayerNorm", "t5_layer_norm", lambda n: _tf("t5", "T5LayerNorm")(n), 3),
    ("Olmo2RMSNorm", "float32_rms_norm", lambda n: _tf("olmo2", "Olmo2RMSNorm")(n), 3),
    ("GptOssRMSNorm", "float32_rms_norm", lambda n: _tf("gpt_oss", "GptOssRMSNorm")(n), 3),
    ("HeliumRMSNorm", "float32_rms_norm", lambda n: _tf("helium", "HeliumRMSNorm")(n), 3),
    ("MoshiRMSNorm", "float32_rms_norm", lambda n: _tf("moshi", "MoshiRMSNorm")(n), 3),
    ("Gemma3nRMSNorm", "float32_rms_norm", lambda n: _tf("gemma3n", "Gemma3nRMSNorm")(n), 3),
    ("Gemma3nRMSNorm-no-scale", "float32_rms_norm",
     lambda n: _tf("gemma3n", "Gemma3nRMSNorm")(n, with_scale=False), 3),
    ("Llama4TextL2Norm", "float32_rms_norm", lambda n: _tf("llama4", "Llama4TextL2Norm")(), 3),
    ("CohereLayerNorm", "float32_layer_norm", lambda n: _tf("cohere", "CohereLayerNorm")(n), 3),
    ("OlmoLayerNorm", "float32_layer_norm", lambda n: _tf("olmo", "OlmoLayerNorm")(n), 3),
    ("NemotronLayerNorm1P", "layer_norm_1p", lambda n: _tf("nemotron", "NemotronLayerNorm1P")(n), 3),
    ("DebertaLayerNorm", "deberta_layer_norm", lambda n: _tf("deberta", "DebertaLayerNorm")(n), 3),
    # diffusers' norms (SD3's and Flux's q/k norms are its RMSNorm)
    ("diffusers.RMSNorm", "t5_layer_norm", lambda n: _df("normalization", "RMSNorm")(n, eps=1e-6), 3),
    ("diffusers.RMSNorm-no-weight", "float32_rms_norm",
     lambda n: _df("normalization", "RMSNorm")(n, eps=1e-6, elementwise_affine=False), 3),
    ("diffusers.MochiRMSNorm", "float32_rms_norm", lambda n: _df("normalization", "MochiRMSNorm")(n, eps=1e-6), 3),
    ("diffusers.Cosmos3NemotronRMSNorm", "float32_rms_norm",
     lambda n: _df("transformers.transformer_cosmos3", "Cosmos3NemotronRMSNorm")(n, eps=1e-6), 3),
    ("diffusers.StableAudio3RMSNorm", "float32_rms_norm",
     lambda n: _df("transformers.transformer_stable_audio3", "StableAudio3RMSNorm")(n), 3),
    ("diffusers.QwenImage21ZeroCenterRMSNorm", "gemma_rms_norm",
     lambda n: _df("transformers.transformer_qwenimage21", "QwenImage21ZeroCenterRMSNorm")(n), 3),
    ("diffusers.FP32LayerNorm", "upcast_layer_norm", lambda n: _df("normalization", "FP32LayerNorm")(n), 3),
    ("diffusers.SDCascadeLayerNorm", "channels_first_layer_norm",
     lambda n: _df("unets.unet_stable_cascade", "SDCascadeLayerNorm")(n, eps=1e-6), 4),
    # timm's (a ViT or ConvNeXt built with norm_layer="rmsnorm", "layernorm2d", ...)
    ("timm.LayerNorm", "layer_norm", lambda n: _timm("LayerNorm")(n), 3),
    ("timm.LayerNorm2d", "channels_first_layer_norm", lambda n: _timm("LayerNorm2d")(n), 4),
    ("timm.LayerNormFp32", "upcast_layer_norm", lambda n: _timm("LayerNormFp32")(n), 3),
    ("timm.LayerNorm2dFp32", "channels_first_upcast_layer_norm", lambda n: _timm("LayerNorm2dFp32")(n), 4),
    ("timm.RmsNorm", "input_dtype_rms_norm", lambda n: _timm("RmsNorm")(n), 3),
    ("timm.RmsNorm-no-affine", "input_dtype_rms_norm", lambda n: _timm("RmsNorm")(n, affine=False), 3),
    ("timm.RmsNorm2d", "channels_first_input_dtype_rms_norm", lambda n: _timm("RmsNorm2d")(n), 4),
    ("timm.RmsNormFp32", "float32_rms_norm", lambda n: _timm("RmsNormFp32")(n), 3),
    ("timm.RmsNorm2dFp32", "channels_first_float32_rms_norm", lambda n: _timm("RmsNorm2dFp32")(n), 4),
]
IDS = [c[0] for c in CASES]
# kinds whose classes compute in the input's dtype: the kernels take float32 input only
IN_INPUT_DTYPE = ("input_dtype_rms_norm", "channels_first_input_dtype_rms_norm")
# (input dtype, γ/β dtype)
DTYPES = {
    "float32": (torch.float32, torch.float32),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float16": (torch.float16, torch.float16),
    "bfloat16-input-float32-weights": (torch.bfloat16, torch.float32),
}


def _norm(make, param_dtype, seed=0):
    torch.manual_seed(seed)
    m = make(N)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))  # γ away from 1 (Gemma's from 0), β away from 0
    return m.to(param_dtype)


def _input(rank, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 5, N) if rank == 3 else (2, N, 3, 2)  # (B, T, C) or (N, C, H, W)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)


def _pair(make, param_dtype):
    original = _norm(make, param_dtype)
    swapped = copy.deepcopy(original)
    report = nl.swap_norms(swapped, warn=False)
    return original, swapped, report


def test_every_kind_is_tested():
    assert {c[1] for c in CASES} == set(interop.KINDS)


@pytest.mark.parametrize("dtypes", list(DTYPES), ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_path_is_bitwise_the_original(case, dtypes):
    """On CPU the swapped module runs the class's forward: output, dtype and gradients bit for bit."""
    name, kind, make, rank = case
    x_dtype, p_dtype = DTYPES[dtypes]
    original, swapped, report = _pair(make, p_dtype)
    assert swapped._normlib_kind == kind and report.count == 1, str(report)
    x = _input(rank, x_dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    try:
        ya = original(xa)
    except RuntimeError as e:  # e.g. an op without a float16 CPU kernel: nothing to compare
        if x_dtype == torch.float16:
            pytest.skip(f"{name} does not run in float16 on CPU: {e}")
        raise
    yb = swapped(xb)
    assert yb.dtype == ya.dtype and yb.shape == ya.shape and yb.stride() == ya.stride()
    assert torch.equal(ya, yb)
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(2)).to(ya.dtype)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(xa.grad, xb.grad)
    for (n, p), q in zip(original.named_parameters(), swapped.parameters()):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.interpreter
@pytest.mark.parametrize("dtypes", ["float32", "bfloat16", "bfloat16-input-float32-weights"], ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_path_agrees_to_rounding(kernels_on_cpu, case, dtypes):
    """Through the kernels: as close to float64 as the original is (and the same dtype and layout)."""
    name, kind, make, rank = case
    x_dtype, p_dtype = DTYPES[dtypes]
    original, swapped, _ = _pair(make, p_dtype)
    exact = copy.deepcopy(original).double()
    kernels_on_cpu()
    x = _input(rank, x_dtype)
    taken = interop.fused(type(swapped)._normlib_binding, swapped, x) is not None
    if kind in IN_INPUT_DTYPE and x_dtype != torch.float32:  # statistics in 16 bits: the class's forward runs
        assert not taken
        assert torch.equal(original(x), swapped(x))
        return
    assert taken  # the kernels do take it
    xa, xb, xr = (x.clone().requires_grad_() for _ in range(3))
    ya, yb = original(xa), swapped(xb)
    yr = exact(xr.double())
    assert yb.dtype == ya.dtype and yb.shape == ya.shape and yb.stride() == ya.stride()
    assert_no_worse(yb.detach(), ya.detach(), yr.detach(), x_dtype, "output")
    if x_dtype != torch.float32:  # the interpreter truncates bfloat16 stores (see test_swap.py)
        return
    g = torch.randn(ya.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ya.backward(g.to(ya.dtype))
    yb.backward(g.to(yb.dtype))
    yr.backward(g)
    assert_no_worse(xb.grad, xa.grad, xr.grad, x_dtype, "grad of x")
    for (n, p), q, r in zip(swapped.named_parameters(), original.parameters(), exact.parameters()):
        assert_no_worse(p.grad, q.grad, r.grad, x_dtype, f"grad of {n}")


@pytest.mark.interpreter
@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("nn.LayerNorm", "nn.RMSNorm", "ConvNextLayerNorm-first")],
                         ids=lambda c: c[0])
def test_torch_norms_under_autocast_take_autocasts_dtype(kernels_on_cpu, case):
    """Under autocast torch casts LayerNorm's/RMSNorm's inputs (γ and β too) first: the swapped module does the same.

    On CPU autocast runs layer_norm in bfloat16 (on CUDA in float32): with float32 γ the original computes with γ
    rounded to bfloat16, and so must the kernels.
    """
    name, kind, make, rank = case
    original, swapped, _ = _pair(make, torch.float32)
    exact = copy.deepcopy(original).double()
    kernels_on_cpu()
    x = _input(rank, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = original(x), swapped(x)
        dtype = interop.kinds._autocast_dtype("layer_norm" if kind != "rms_norm" else "rms_norm", x)
    assert yb.dtype == ya.dtype
    rounded = copy.deepcopy(exact)
    if dtype is not None:  # what autocast hands the op: inputs and γ/β rounded to its dtype
        for p in rounded.parameters():
            p.data = p.data.to(dtype).double()
    assert_no_worse(yb.detach(), ya.detach(), rounded(x.to(dtype or x.dtype).double()).detach(), ya.dtype, "output")


def test_settings_that_the_kernels_cannot_take_are_left_alone_with_the_reason():
    cohere = _tf("cohere", "CohereLayerNorm")
    qk = cohere((4, N))  # Cohere's q/k norm: one γ row per head
    report = nl.swap_norms(nn.Sequential(qk, nn.LayerNorm((4, N)), cohere(N)), warn=False)
    assert report.count == 1
    reasons = {name.rsplit(".", 1)[-1]: why for name, (_, why) in report.left.items()}
    assert "one γ per head" in reasons["CohereLayerNorm"]
    assert "last 2 dimensions" in reasons["LayerNorm"]


def test_diffusers_settings_the_kernels_cannot_take_are_left_alone_with_the_reason():
    rms, audio = _df("normalization", "RMSNorm"), _df("transformers.transformer_stable_audio3", "StableAudio3RMSNorm")
    report = nl.swap_norms(nn.Sequential(rms(N, eps=1e-6, bias=True), audio(N, force_fp32=False)), warn=False)
    assert report.count == 0
    reasons = {name.rsplit(".", 1)[-1]: why for name, (_, why) in report.left.items()}
    assert "adds β after T5's order" in reasons["RMSNorm"]
    assert "force_fp32=False" in reasons["StableAudio3RMSNorm"] and "input's own dtype" in reasons["StableAudio3RMSNorm"]


@pytest.mark.interpreter
def test_fp32_layer_norm_under_autocast(kernels_on_cpu, monkeypatch):
    """diffusers' FP32LayerNorm calls F.layer_norm on float32 copies, so its order is float32's unless autocast
    lowers layer_norm to a 16-bit dtype (torch's policy, asked of torch by a probe): then the swapped module runs
    the class's forward, bit for bit; else the kernels, as close to float64 as the original."""
    original, swapped, report = _pair(lambda n: _df("normalization", "FP32LayerNorm")(n), torch.float32)
    assert report.count == 1
    exact = copy.deepcopy(original).double()
    kernels_on_cpu()
    x = _input(3, torch.bfloat16)
    binding = type(swapped)._normlib_binding
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        lowered = interop.kinds._autocast_dtype("layer_norm", x) not in (None, torch.float32)
        assert (interop.fused(binding, swapped, x) is None) == lowered
        ya, yb = original(x), swapped(x)
    assert yb.dtype == ya.dtype == torch.bfloat16
    if lowered:
        assert torch.equal(ya, yb)
    else:
        assert_no_worse(yb, ya, exact(x.double()), torch.bfloat16, "output")
    # and a torch whose CPU autocast lowers layer_norm (the probe's answer, forced): the class's own forward
    monkeypatch.setattr(interop.kinds, "_autocast_dtype", lambda op, t: torch.bfloat16)
    assert interop.fused(binding, swapped, x) is None


def test_gemma3n_with_and_without_scale_bind_to_their_gamma():
    g3n = _tf("gemma3n", "Gemma3nRMSNorm")
    with_scale, without = g3n(N), g3n(N, with_scale=False)
    nl.swap_norms(nn.Sequential(with_scale, without))
    assert type(with_scale)._normlib_binding.weight == "weight"
    if hasattr(without, "weight"):  # transformers 4.x: a scalar buffer of 1, which its forward multiplies by
        assert type(without)._normlib_binding.weight == "weight" and without.weight.dim() == 0
        return
    assert type(without)._normlib_binding.weight is None  # 5.x: none, and its forward skips it
    assert type(with_scale) is not type(without)  # one swapped class per class and binding


# ---- the rounding order in 16 bits ---------------------------------------------------------------------
#
# Two correct computations of one order differ only where their float32 statistics, a few units of rounding
# apart, straddle a rounding boundary of the 16-bit output: a small fraction of the elements, by one unit in
# the last place. Another order differs on a large fraction (a quarter to a third of them: chapter 05d) and by
# up to two units. So: at most MISMATCH of the elements may differ, each by at most one unit.
MISMATCH = 0.02
HALF_DTYPES = {
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "float16-input-float32-weights": (torch.float16, torch.float32),
    "bfloat16-input-float32-weights": (torch.bfloat16, torch.float32),
}


def _input_16(rank, dtype):
    g = torch.Generator().manual_seed(3)
    shape = (6, 8, N) if rank == 3 else (4, N, 4, 3)  # more elements than _input: a fraction means something
    return (torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1).to(dtype)


def _same_rounding(got, want, what, x_dtype):
    """``got`` rounds as ``want``: in a 16-bit output, at most MISMATCH of the elements differ, by one unit in
    the last place. A float32 output (γ in float32, for the kinds that return γ's dtype) was rounded to 16 bits
    only inside (x̂, say): there an element counts as differing where it is further apart than two float32
    results may be, and no element may be off by more than a few units of the input's 16-bit dtype."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    g, w = got.detach().double(), want.detach().double()
    off = (g - w).abs()
    if want.dtype in (torch.float16, torch.bfloat16):
        ulp = (torch.nextafter(want.abs(), torch.full_like(want, float("inf"))) - want.abs()).double()
        assert bool((off <= ulp).all()), f"{what}: off by more than one unit in the last place"
        differs = off > 0
    else:
        assert bool((off <= 4 * torch.finfo(x_dtype).eps * (w.abs() + 1)).all()), f"{what}: off by more than rounding"
        differs = off > tolerance(want.dtype) * (w.abs() + 1)
    share = differs.double().mean().item()
    assert share <= MISMATCH, f"{what}: {share:.1%} of the elements rounded differently"


def _original_16(make, p_dtype, rank, x_dtype):
    original = _norm(make, p_dtype)
    x = _input_16(rank, x_dtype)
    try:
        with torch.no_grad():
            return original, x, original(x)
    except RuntimeError as e:
        pytest.skip(f"{make} does not run in {x_dtype} on CPU: {e}")


@pytest.mark.parametrize("dtypes", list(HALF_DTYPES), ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_rounding_order_is_the_originals_in_16_bits(monkeypatch, case, dtypes):
    """The order each kind hands the kernels, computed in PyTorch ops (the kernels' twin, which rounds to
    nearest as the GPU does), rounds as the original class does, in float16 and bfloat16."""
    from normlib.ops import _twin, dispatch
    from normlib.ops.rounding import TORCH

    name, kind, make, rank = case
    x_dtype, p_dtype = HALF_DTYPES[dtypes]
    original, x, want = _original_16(make, p_dtype, rank, x_dtype)
    swapped = copy.deepcopy(original)
    nl.swap_norms(swapped, warn=False)
    seen = []

    def twin(x, residual, weight, bias, eps, *, rms, rounding=TORCH, how="fused"):
        seen.append(rounding)
        return _twin.forward(x, residual, weight, bias, eps, rms, rounding)[:2]

    monkeypatch.setattr(dispatch, "fused", twin)
    with torch.no_grad(), nl.ops.force_path("fused"):
        got = interop.KINDS[kind].run("fused", x, *_params(swapped, kind), _eps(swapped), swapped)
    if got is None:
        pytest.skip(f"{name}: the kernels do not take {dtypes}")
    assert seen, "the kind's fused forward did not reach the kernels"
    _same_rounding(got, want, f"{name} in {dtypes} ({seen[0].name} order)", x_dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtypes", ["float16", "float16-input-float32-weights"], ids=str)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernels_round_as_the_original_in_float16(kernels_on_cpu, case, dtypes):
    """Through the kernels themselves (Triton's interpreter rounds float16 to nearest, as the GPU does;
    its bfloat16 stores truncate, so bfloat16 is the twin's test above)."""
    name, kind, make, rank = case
    x_dtype, p_dtype = HALF_DTYPES[dtypes]
    original, x, want = _original_16(make, p_dtype, rank, x_dtype)
    swapped = copy.deepcopy(original)
    nl.swap_norms(swapped, warn=False)
    kernels_on_cpu()
    taken = interop.fused(type(swapped)._normlib_binding, swapped, x) is not None
    assert taken != (kind in IN_INPUT_DTYPE)  # the kernels take it, but where the class computes in 16 bits
    with torch.no_grad():
        got = swapped(x)
    if not taken:
        assert torch.equal(got, want)
        return
    _same_rounding(got, want, f"{name} in {dtypes} through the kernels", x_dtype)


def _params(module, kind):
    b = type(module)._normlib_binding
    return tuple(getattr(module, n) if n is not None else None for n in (b.weight, b.bias))


def _eps(module):
    b = type(module)._normlib_binding
    return getattr(module, b.eps) if isinstance(b.eps, str) else b.eps

