"""Compiled gradients equal eager ones: every module and functional, every dtype, both shape modes.

torch 2.11's ``torch.compile`` gave normlib's reference math exactly zero
gradients in float32 (the output of an autograd Function aliased a tensor made
in its forward; see ``normlib.functional._fresh``). This test compiles one
model that holds every normlib module and calls every functional, and compares
the gradient of every input and every parameter with eager mode, by name, so
that any torch release on which a compiled gradient differs fails here and
says which op it was.

Each step compares the outputs (values and dtypes) and the gradients; with dynamic
shapes a second batch size follows the first under ``fail_on_recompile``, so a
graph that specialised on the batch size fails here. Running statistics are
compared at the end.

Configurations: float32, bfloat16 and float16, static and dynamic shapes (the
other releases of the torch matrix run float32 both ways and bfloat16 static,
the pinned torch every pair; see ``_configs``);
normlib's two compile modes (``"reference"``: the compiler traces the
reference math; ``"kernels"``: the fused kernels stay in the graph as custom
operators, run through Triton's interpreter on CPU). The compiler is
``aot_eager`` (dynamo's tracing and AOT autograd, where the zero gradients
came from, without generating C++); one float32 configuration also goes
through inductor.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normlib as nl
from normlib import functional as Fn
from normlib import ops

# The configurations (dtype, dynamic shapes). float16 compiles through the same 16-bit handling as
# bfloat16, and dynamic shapes change how shapes are traced, not how a dtype is handled: every release of
# the torch matrix runs float32 static and dynamic and bfloat16 static, the pin (make test) every pair
# (`pin`: .ci/torch_matrix.py; the dynamic bfloat16 pairs were a quarter of a release's test time) but
# the blocks' dynamic bfloat16, whose tracing is float32's and whose dtype handling is static bfloat16's
# (it was the pin's longest compile test).


def _configs(dtypes, dynamic_16_bit: bool = True) -> list:
    return [
        pytest.param(dtype, dynamic, id=f"{'dynamic' if dynamic else 'static'}-{str(dtype).removeprefix('torch.')}",
                     marks=[pytest.mark.pin] if dtype == torch.float16 or (dtype == torch.bfloat16 and dynamic) else [])
        for dtype in dtypes for dynamic in (False, True)
        if dynamic_16_bit or not (dynamic and dtype != torch.float32)
    ]


# Compiled and eager may round differently (fused arithmetic): a gradient must agree to
# a few units in the last place of its dtype, relative to its own size or to 1 (inputs
# and parameters are O(1), so a gradient that is zero in exact arithmetic, such as that
# of attention's key bias, is compared on that absolute scale).
TOL = {torch.float32: 2e-4, torch.bfloat16: 5e-2, torch.float16: 5e-3}
D = 16  # feature width of every case


MODULES = {
    "LayerNorm": lambda: nl.LayerNorm(D),
    "LayerNorm-no-bias": lambda: nl.LayerNorm(D, bias=False),
    "LayerNorm-2d-shape": lambda: nl.LayerNorm((3, D)),  # normalized over the last two dimensions
    "RMSNorm": lambda: nl.RMSNorm(D),
    "RMSNorm-eps": lambda: nl.RMSNorm(D, eps=1e-6),  # a float eps, where dynamo may make it symbolic
    "GroupNorm": lambda: nl.GroupNorm(4, D),
    "BatchNorm1d": lambda: nl.BatchNorm1d(D),
    "BatchNorm2d": lambda: nl.BatchNorm2d(D),
    "BatchNorm2d-eval": lambda: nl.BatchNorm2d(D).eval(),
    "BatchNorm2d-untracked": lambda: nl.BatchNorm2d(D, track_running_stats=False),
    "InstanceNorm1d": lambda: nl.InstanceNorm1d(D, affine=True, track_running_stats=True),
    "InstanceNorm1d-eval": lambda: nl.InstanceNorm1d(D, affine=True, track_running_stats=True).eval(),
    "InstanceNorm2d": lambda: nl.InstanceNorm2d(D, affine=True),
    "SyncBatchNorm": lambda: nl.SyncBatchNorm(D),  # no process group: plain BatchNorm
    "TransformerBlock-pre": lambda: nl.TransformerBlock(D, 2, norm_first=True),
    "TransformerBlock-post-rms": lambda: nl.TransformerBlock(D, 2, norm_first=False, norm="rms"),
    "MultiHeadAttention": lambda: nl.MultiHeadAttention(D, 2),
}
FUNCTIONALS = ("F.layer_norm", "F.rms_norm", "F.group_norm", "F.batch_norm", "F.batch_norm-eval",
               "F.instance_norm", "ops.layer_norm", "ops.rms_norm", "ops.add_layer_norm", "ops.add_rms_norm")
BLOCKS = ("TransformerBlock-pre", "TransformerBlock-post-rms", "MultiHeadAttention")
# Every norm module and functional, with the module variants whose tracing differs (a 2-D normalized shape,
# a given eps, untracked and eval-mode statistics) (tracing cost grows with the number of ops, so the
# blocks, which hold many, run in fewer configurations: test_blocks_*).
NORMS = tuple(n for n in MODULES if n not in BLOCKS) + FUNCTIONALS
# What normlib's "kernels" compile mode changes: the calls the fused kernels cover.
KERNEL_ROUTED = ("LayerNorm", "LayerNorm-no-bias", "RMSNorm", "ops.layer_norm", "ops.rms_norm",
                 "ops.add_layer_norm", "ops.add_rms_norm")


class Zoo(nn.Module):
    """The named normlib modules and functionals, each on an input of its own."""

    def __init__(self, names):
        super().__init__()
        self.names = tuple(names)
        self.mods = nn.ModuleDict({n: MODULES[n]() for n in self.names if n in MODULES})
        self.w = nn.Parameter(torch.rand(D) + 0.5)
        self.b = nn.Parameter(torch.randn(D) * 0.1)
        with torch.no_grad():
            for p in self.mods.parameters():
                p.add_(0.1 * torch.randn_like(p))
        self.register_buffer("rm", torch.randn(D) * 0.1)
        self.register_buffer("rv", torch.rand(D) + 0.5)

    def forward(self, xs: dict) -> dict:
        m, w, b, out = self.mods, self.w, self.b, {}
        r, ncl, nchw = xs["rows"], xs["ncl"], xs["nchw"]
        for name in self.names:
            if name in ("TransformerBlock-post-rms", "MultiHeadAttention"):
                q = r[name]
                out[name] = m[name](q, causal=True) if name.startswith("T") else m[name](q, q, q, causal=True)
            elif name in m and name in r:
                out[name] = m[name](r[name])
            elif name in m and name in ncl:
                out[name] = m[name](ncl[name])
            elif name in m:
                out[name] = m[name](nchw[name])
            elif name == "F.layer_norm":
                out[name] = Fn.layer_norm(r[name], (D,), w, b, 1e-5)
            elif name == "F.rms_norm":
                out[name] = Fn.rms_norm(r[name], (D,), w, 1e-6)
            elif name == "F.group_norm":
                out[name] = Fn.group_norm(ncl[name], 2, w, b)
            elif name == "F.batch_norm":
                out[name] = Fn.batch_norm(ncl[name], None, None, w, b, training=True)
            elif name == "F.batch_norm-eval":
                out[name] = Fn.batch_norm(ncl[name], self.rm, self.rv, w, b)
            elif name == "F.instance_norm":
                out[name] = Fn.instance_norm(ncl[name], weight=w, bias=b)
            elif name == "ops.layer_norm":
                out[name] = ops.layer_norm(r[name], w, b)
            elif name == "ops.rms_norm":
                out[name] = ops.rms_norm(r[name], w)
            elif name == "ops.add_layer_norm":
                out[name], out[name + ".residual"] = ops.add_layer_norm(r[name], r[name + ".residual"], w, b)
            elif name == "ops.add_rms_norm":
                out[name], out[name + ".residual"] = ops.add_rms_norm(r[name], r[name + ".residual"], w)
        return out


ROWS = {"LayerNorm", "LayerNorm-no-bias", "LayerNorm-2d-shape", "RMSNorm", "RMSNorm-eps", "F.layer_norm", "F.rms_norm", "ops.layer_norm",
        "ops.rms_norm", "ops.add_layer_norm", "ops.add_rms_norm"} | set(BLOCKS)
NCHW = {"BatchNorm2d", "BatchNorm2d-eval", "BatchNorm2d-untracked", "InstanceNorm2d", "SyncBatchNorm"}


def _inputs(names, batch: int, dtype: torch.dtype, device: str) -> dict:
    g = torch.Generator().manual_seed(batch)

    def t(*shape):
        x = torch.randn(shape, generator=g) * 2 + 0.5
        return x.to(device=device, dtype=dtype).requires_grad_()

    xs = {"rows": {}, "ncl": {}, "nchw": {}}
    for n in names:
        if n in ROWS:
            xs["rows"][n] = t(batch, 3, D)
            if n.startswith("ops.add_"):
                xs["rows"][n + ".residual"] = t(batch, 3, D)
        elif n in NCHW:
            xs["nchw"][n] = t(batch, D, 3, 2)
        else:
            xs["ncl"][n] = t(batch, D, 5)
    return xs


def _leaves(xs: dict) -> dict:
    return {f"{group}/{k}": v for group, d in xs.items() for k, v in d.items()}


def _run(model, xs, seed):
    out = model(xs)
    g = torch.Generator().manual_seed(seed)
    loss = sum((y.float() * torch.randn(y.shape, generator=g).to(y.device)).sum() for y in out.values())
    loss.backward()
    return out


def _assert_grads_equal(eager_model, compiled_model, xe, xc, dtype, where):
    tol = TOL[dtype]
    named = [(f"input {k}", a.grad, b.grad) for (k, a), b in zip(_leaves(xe).items(), _leaves(xc).values())]
    named += [
        (f"parameter {n}", a.grad, b.grad)
        for (n, a), b in zip(eager_model.named_parameters(), compiled_model.parameters())
    ]
    bad = []
    for name, ge, gc in named:
        if ge is None and gc is None:
            continue
        if (ge is None) != (gc is None):
            bad.append(f"{name}: gradient {'missing' if gc is None else 'unexpected'} when compiled")
            continue
        scale = ge.double().abs().max().item()
        err = (gc.double() - ge.double()).abs().max().item()
        if not err <= tol * max(scale, 1.0):
            zero = " (compiled gradient is all zeros)" if not gc.any() else ""
            bad.append(f"{name}: max |compiled - eager| = {err:.3g} vs |eager| up to {scale:.3g}{zero}")
    assert not bad, f"{where}: compiled gradients differ from eager:\n  " + "\n  ".join(bad)


def _devices():
    yield "cpu"
    if torch.cuda.is_available():
        yield "cuda"


@pytest.fixture
def compile_mode(request):
    with ops.use_compile_mode(request.param):
        yield request.param


def _check(names, device, dtype, dynamic, mode, backend="aot_eager"):
    if device == "cpu" and mode == "kernels" and ops.path_for(torch.zeros(1, 8)) == "reference":
        pytest.skip("kernels mode on CPU needs Triton's interpreter (TRITON_INTERPRET=1)")
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = Zoo(names).to(device=device, dtype=dtype)  # as a user's model.to(torch.bfloat16)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    where = f"{device}, {dtype}, dynamic={dynamic}, compile mode {mode!r}, {backend}"
    for step, batch in enumerate((4, 6) if dynamic else (4,)):
        xe = _inputs(names, batch, dtype, device)
        xc = {g: {k: v.detach().clone().requires_grad_() for k, v in d.items()} for g, d in xe.items()}
        for p in list(eager.parameters()) + list(model.parameters()):
            p.grad = None
        ye = _run(eager, xe, step)
        # dynamic shapes: the second batch size runs the graphs of the first, and a recompilation fails
        torch.compiler.set_stance("fail_on_recompile" if step else "default")
        try:
            yc = _run(compiled, xc, step)
        finally:
            torch.compiler.set_stance("default")
        for k in ye:
            assert yc[k].dtype == ye[k].dtype, f"{where}: {k} output dtype {yc[k].dtype} vs eager {ye[k].dtype}"
            err = (yc[k].double() - ye[k].double()).abs().max().item()
            scale = max(ye[k].double().abs().max().item(), 1.0)
            assert err <= TOL[dtype] * scale, f"{where}, batch {batch}: output {k} differs from eager by {err:.3g}"
        _assert_grads_equal(eager, model, xe, xc, dtype, f"{where}, batch {batch}")
    for (n, a), b in zip(eager.named_buffers(), model.buffers()):
        torch.testing.assert_close(b, a, msg=f"{where}: buffer {n}")


@pytest.mark.parametrize("device", list(_devices()))
@pytest.mark.parametrize("dtype, dynamic", _configs([torch.float32, torch.bfloat16, torch.float16]))
@pytest.mark.parametrize("compile_mode", ["reference", "kernels"], indirect=True)
def test_norms(device, dtype, dynamic, compile_mode):
    """Every norm module and functional (in "kernels" mode, those the kernels cover)."""
    _check(NORMS if compile_mode == "reference" else KERNEL_ROUTED, device, dtype, dynamic, compile_mode)


@pytest.mark.parametrize("device", list(_devices()))
@pytest.mark.parametrize("dtype, dynamic", _configs([torch.float32, torch.bfloat16], dynamic_16_bit=False))
@pytest.mark.parametrize("compile_mode", ["reference", "kernels"], indirect=True)
def test_blocks(device, dtype, dynamic, compile_mode):
    """TransformerBlock (Pre-Norm: the fused add + norm; Post-Norm with RMSNorm) and MultiHeadAttention."""
    if compile_mode == "kernels" and (dtype != torch.float32 or dynamic):
        pytest.skip("the kernels mode of the blocks is covered by one configuration")
    _check(BLOCKS, device, dtype, dynamic, compile_mode)


@pytest.mark.parametrize("compile_mode", ["reference"], indirect=True)
def test_through_inductor(compile_mode):
    """A few norms through inductor's generated code (float32, static shapes)."""
    _check(("LayerNorm", "RMSNorm", "BatchNorm2d", "F.group_norm"), "cpu", torch.float32, False, compile_mode,
           backend="inductor")
