"""normlib under the ways PyTorch users transform code: autocast, forward-mode AD, vmap, double backward.

Every module and functional is checked against torch's own namesake (or, where
torch has none or refuses, against the plain math written out here): under
``torch.autocast`` (same output dtype and values as torch's policy),
``torch.func.jvp`` / ``jacfwd`` / ``hessian`` and ``torch.autograd.forward_ad``,
``vmap`` over the parameters of an ensemble (``stack_module_state`` +
``functional_call``), and second derivatives of the fused path (Triton's
interpreter on CPU).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as TF
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jvp, stack_module_state, vmap

import normlib as nl
from normlib import _autocast
from normlib import functional as Fn
from normlib import ops

from _helpers import assert_no_worse

F64 = torch.float64


# ----------------------------------------------------------------------------
# Autocast
# ----------------------------------------------------------------------------


def test_the_policy_is_read_from_torchs_dispatcher():
    """On every torch release: layer_norm and group_norm run in float32 under CUDA autocast, batch_norm
    and instance_norm do not, and on CPU no norm has an autocast rule."""
    table = _autocast._FLOAT32_OPS
    assert ("layer_norm", "cuda") in table and ("group_norm", "cuda") in table
    assert ("batch_norm", "cuda") not in table and ("instance_norm", "cuda") not in table
    assert not any(dev == "cpu" for _, dev in table)
    # rms_norm joined the float32 list in torch 2.13; normlib follows whatever this torch says.
    has = torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")
    assert (("rms_norm", "cuda") in table) == has


MODULE_PAIRS = [
    ("LayerNorm", lambda: nl.LayerNorm(8), lambda: nn.LayerNorm(8), (4, 3, 8)),
    ("RMSNorm", lambda: nl.RMSNorm(8), lambda: nn.RMSNorm(8), (4, 3, 8)),
    ("GroupNorm", lambda: nl.GroupNorm(2, 8), lambda: nn.GroupNorm(2, 8), (4, 8, 5)),
    ("BatchNorm1d", lambda: nl.BatchNorm1d(8), lambda: nn.BatchNorm1d(8), (4, 8, 5)),
    ("BatchNorm2d-eval", lambda: nl.BatchNorm2d(8).eval(), lambda: nn.BatchNorm2d(8).eval(), (4, 8, 3, 3)),
    ("InstanceNorm1d", lambda: nl.InstanceNorm1d(8, affine=True), lambda: nn.InstanceNorm1d(8, affine=True), (4, 8, 5)),
    ("InstanceNorm2d", lambda: nl.InstanceNorm2d(8), lambda: nn.InstanceNorm2d(8), (4, 8, 3, 3)),
]

FUNCTIONAL_PAIRS = [
    ("layer_norm", lambda x, w, b: Fn.layer_norm(x, (8,), w, b), lambda x, w, b: TF.layer_norm(x, (8,), w, b), (4, 3, 8)),
    ("rms_norm", lambda x, w, b: Fn.rms_norm(x, (8,), w, 1e-6), lambda x, w, b: TF.rms_norm(x, (8,), w, 1e-6), (4, 3, 8)),
    ("group_norm", lambda x, w, b: Fn.group_norm(x, 2, w, b), lambda x, w, b: TF.group_norm(x, 2, w, b), (4, 8, 5)),
    ("batch_norm", lambda x, w, b: Fn.batch_norm(x, None, None, w, b, True),
     lambda x, w, b: TF.batch_norm(x, None, None, w, b, True), (4, 8, 5)),
    ("instance_norm", lambda x, w, b: Fn.instance_norm(x, weight=w, bias=b),
     lambda x, w, b: TF.instance_norm(x, weight=w, bias=b), (4, 8, 5)),
]


def _devices():
    yield "cpu"
    if torch.cuda.is_available():
        yield "cuda"


def _close(a, b, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", list(_devices()))
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["x32", "xbf16", "x16"])
@pytest.mark.parametrize("case", MODULE_PAIRS, ids=[c[0] for c in MODULE_PAIRS])
def test_modules_follow_torchs_autocast_policy(device, autocast_dtype, x_dtype, case):
    _, ours_make, theirs_make, shape = case
    torch.manual_seed(0)
    theirs = theirs_make().to(device)
    ours = ours_make().to(device)
    ours.load_state_dict(theirs.state_dict())
    x = (torch.randn(shape) * 2 + 1).to(device=device, dtype=x_dtype)
    with torch.autocast(device, dtype=autocast_dtype):
        yt, yo = theirs(x), ours(x)
    assert yo.dtype == yt.dtype, f"output dtype {yo.dtype}, torch's {yt.dtype}"
    _close(yo, yt, yt.dtype if yt.dtype != torch.float32 else x_dtype)


@pytest.mark.parametrize("device", list(_devices()))
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x32", "xbf16"])
@pytest.mark.parametrize("case", FUNCTIONAL_PAIRS, ids=[c[0] for c in FUNCTIONAL_PAIRS])
def test_functionals_follow_torchs_autocast_policy(device, x_dtype, case):
    _, ours, theirs, shape = case
    torch.manual_seed(0)
    x = (torch.randn(shape) * 2 + 1).to(device=device, dtype=x_dtype)
    w, b = torch.rand(8, device=device) + 0.5, torch.randn(8, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        yt, yo = theirs(x, w, b), ours(x, w, b)
    assert yo.dtype == yt.dtype
    _close(yo, yt, x_dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_autocast_returns_float32_from_layer_norm_like_torch():
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    ln, ref = nl.LayerNorm(4096).cuda(), nn.LayerNorm(4096).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert ln(x).dtype == ref(x).dtype == torch.float32
        y, res = ops.add_layer_norm(x, x, ln.weight, ln.bias)
        assert y.dtype == torch.float32 and res.dtype == torch.bfloat16


def test_autocast_lets_the_input_dtype_differ_from_attentions_weights():
    attn = nl.MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8, dtype=F64)
    with pytest.raises(TypeError, match="q has dtype torch.float64 but the module's weights have dtype torch.float32"):
        attn(x, x, x)
    xb = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attn(xb, xb, xb).dtype == torch.bfloat16


# ----------------------------------------------------------------------------
# Forward-mode AD
# ----------------------------------------------------------------------------


def _bn_eval_math(x, m, v, w, b, eps=1e-5):
    """torch refuses tangents of the running statistics; the formula written out accepts them."""
    view = lambda t: t.reshape(1, -1, *([1] * (x.dim() - 2)))  # noqa: E731
    return (x - view(m)) / torch.sqrt(view(v) + eps) * view(w) + view(b)


def _fwd_cases():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(4, 6, generator=g, dtype=F64) * 2 + 1
    ncl = torch.randn(3, 6, 5, generator=g, dtype=F64) * 2 + 1
    w, b = torch.rand(6, generator=g, dtype=F64) + 0.5, torch.randn(6, generator=g, dtype=F64)
    rm, rv = torch.randn(6, generator=g, dtype=F64), torch.rand(6, generator=g, dtype=F64) + 0.5
    return {
        "layer_norm": (lambda x, w, b: Fn.layer_norm(x, (6,), w, b), lambda x, w, b: TF.layer_norm(x, (6,), w, b),
                       (rows, w, b)),
        "rms_norm": (lambda x, w: Fn.rms_norm(x, (6,), w, 1e-6), lambda x, w: TF.rms_norm(x, (6,), w, 1e-6), (rows, w)),
        "group_norm": (lambda x, w, b: Fn.group_norm(x, 3, w, b), lambda x, w, b: TF.group_norm(x, 3, w, b),
                       (ncl, w, b)),
        "batch_norm": (lambda x, w, b: Fn.batch_norm(x, None, None, w, b, True),
                       lambda x, w, b: TF.batch_norm(x, None, None, w, b, True), (ncl, w, b)),
        "batch_norm-eval": (lambda x, m, v, w, b: Fn.batch_norm(x, m, v, w, b), _bn_eval_math, (ncl, rm, rv, w, b)),
        "instance_norm": (lambda x, w, b: Fn.instance_norm(x, weight=w, bias=b),
                          lambda x, w, b: TF.instance_norm(x, weight=w, bias=b), (ncl, w, b)),
    }


FWD = _fwd_cases()


@pytest.mark.parametrize("name", list(FWD))
def test_forward_mode_ad_equals_torchs(name):
    ours, theirs, args = FWD[name]
    tangents = tuple(torch.randn_like(a) for a in args)
    (yo, to), (yt, tt) = jvp(ours, args, tangents), jvp(theirs, args, tangents)
    torch.testing.assert_close(yo, yt)
    torch.testing.assert_close(to, tt)
    argnums = tuple(range(len(args)))
    for a, b in zip(jacfwd(ours, argnums=argnums)(*args), jacfwd(theirs, argnums=argnums)(*args)):
        torch.testing.assert_close(a, b)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(a, t) for a, t in zip(args, tangents)]
        torch.testing.assert_close(fwAD.unpack_dual(ours(*duals)).tangent, tt)
    # A Hessian: forward mode over the reverse-mode gradient.
    scalar = lambda f: (lambda *a: f(*a).sin().sum())  # noqa: E731
    torch.testing.assert_close(hessian(scalar(ours))(*args), hessian(scalar(theirs))(*args))


@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d-eval", "InstanceNorm1d"])
def test_forward_mode_through_modules(name):
    make = {
        "LayerNorm": (lambda: nl.LayerNorm(6), lambda: nn.LayerNorm(6), (4, 6)),
        "RMSNorm": (lambda: nl.RMSNorm(6), lambda: nn.RMSNorm(6), (4, 6)),
        "GroupNorm": (lambda: nl.GroupNorm(3, 6), lambda: nn.GroupNorm(3, 6), (4, 6, 5)),
        "BatchNorm1d-eval": (lambda: nl.BatchNorm1d(6).eval(), lambda: nn.BatchNorm1d(6).eval(), (4, 6, 5)),
        "InstanceNorm1d": (lambda: nl.InstanceNorm1d(6, affine=True), lambda: nn.InstanceNorm1d(6, affine=True), (4, 6, 5)),
    }[name]
    ours, theirs = make[0]().double(), make[1]().double()
    ours.load_state_dict(theirs.state_dict())
    x, t = torch.randn(make[2], dtype=F64), torch.randn(make[2], dtype=F64)
    torch.testing.assert_close(jvp(ours, (x,), (t,))[1], jvp(theirs, (x,), (t,))[1])


# ----------------------------------------------------------------------------
# vmap over parameters: model ensembles
# ----------------------------------------------------------------------------

ENSEMBLES = {
    "LayerNorm": (lambda: nl.LayerNorm(8), (4, 8)),
    "LayerNorm-no-bias": (lambda: nl.LayerNorm(8, bias=False), (4, 8)),
    "RMSNorm": (lambda: nl.RMSNorm(8), (4, 8)),
    "GroupNorm": (lambda: nl.GroupNorm(2, 8), (4, 8, 3)),
    "BatchNorm1d-eval": (lambda: nl.BatchNorm1d(8).eval(), (4, 8, 3)),
    "InstanceNorm1d": (lambda: nl.InstanceNorm1d(8, affine=True), (4, 8, 3)),
    "TransformerBlock": (lambda: nl.TransformerBlock(8, 2), (2, 3, 8)),
}


@pytest.mark.parametrize("name", list(ENSEMBLES))
def test_vmap_over_an_ensembles_parameters(name):
    make, shape = ENSEMBLES[name]
    torch.manual_seed(0)
    models = [make() for _ in range(3)]
    for m in models:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.3)
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(shape)

    def run(p, b, x):
        return functional_call(base, (p, b), (x,))

    y = vmap(run, in_dims=(0, 0, None))(params, buffers, x)
    torch.testing.assert_close(y, torch.stack([m(x) for m in models]))
    # and the per-model gradients of the parameters, by vmap over grad
    loss = lambda p, b, x: run(p, b, x).square().sum()  # noqa: E731
    g = vmap(grad(loss), in_dims=(0, 0, None))(params, buffers, x)
    # vmap batches the block's matrix products, which then round differently from eager's (and
    # differently again with the CPU's vector width and the thread count): both are float32
    # evaluations of one gradient, so each is held to a float64 evaluation of it, vmap's error
    # no worse than twice eager's own (plus a few units of float32's roundoff).
    for i, m in enumerate(models):
        m.zero_grad()
        m(x).square().sum().backward()
        m64 = copy.deepcopy(m).double()
        m64.zero_grad()
        m64(x.double()).square().sum().backward()
        for (n, p), p64 in zip(m.named_parameters(), m64.parameters()):
            assert_no_worse(g[n][i], p.grad, p64.grad, torch.float32, n)


# ----------------------------------------------------------------------------
# The fused path under transforms and second derivatives (Triton's interpreter)
# ----------------------------------------------------------------------------

needs_interpreter = pytest.mark.skipif(
    not ops.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton with TRITON_INTERPRET=1"
)


@needs_interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_fused_path_second_derivatives(op):
    torch.manual_seed(0)
    x = torch.randn(2, 3, dtype=F64, requires_grad=True)
    r = torch.randn(2, 3, dtype=F64, requires_grad=True)
    w = torch.rand(3, dtype=F64, requires_grad=True)
    b = torch.randn(3, dtype=F64, requires_grad=True)
    fused = ops.force_path("fused")
    fused.__enter__()
    assert ops.path_for(x) == "triton-interpreter"
    f, args = {
        "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b), (x, w, b)),
        "rms_norm": (lambda x, w: ops.rms_norm(x, w), (x, w)),
        "add_layer_norm": (lambda x, r, w, b: ops.add_layer_norm(x, r, w, b), (x, r, w, b)),
        "add_rms_norm": (lambda x, r, w: ops.add_rms_norm(x, r, w), (x, r, w)),
    }[op]
    try:
        assert torch.autograd.gradgradcheck(f, args)
    finally:
        fused.__exit__(None, None, None)


@needs_interpreter
@pytest.mark.interpreter
def test_fused_path_under_func_transforms_equals_the_reference():
    with ops.force_path("fused"):
        _fused_path_under_func_transforms()


def _fused_path_under_func_transforms():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5), torch.rand(5) + 0.5, torch.randn(5)
    assert ops.path_for(x) == "triton-interpreter"
    f = lambda x: ops.layer_norm(x, w, b).sin().sum()  # noqa: E731
    ref = lambda x: Fn.layer_norm(x, (5,), w, b).sin().sum()  # noqa: E731
    torch.testing.assert_close(grad(f)(x), grad(ref)(x))
    torch.testing.assert_close(vmap(lambda r: ops.rms_norm(r, w))(x), Fn.rms_norm(x, (5,), w))
    t = torch.randn_like(x)
    torch.testing.assert_close(jvp(lambda x: ops.layer_norm(x, w, b), (x,), (t,))[1],
                               jvp(lambda x: Fn.layer_norm(x, (5,), w, b), (x,), (t,))[1])
    # a double backward through a module on the fused path: no gradient silently None
    ln = nl.LayerNorm(5)
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(ops.layer_norm(xr, ln.weight, ln.bias).sin().sum(), xr, create_graph=True)
    gw = torch.autograd.grad(gx.square().sum(), ln.weight, allow_unused=True)[0]
    assert gw is not None and gw.abs().sum() > 0
