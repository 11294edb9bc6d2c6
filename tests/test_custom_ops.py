"""The fused norms as torch.library custom operators: what torch.compile sees of the kernels.

``torch.library.opcheck`` checks the schema, the fake (shape-only)
implementations against the real ones, the autograd registration and AOT
dispatch; here the real implementation runs the kernels through the Triton
interpreter, and the plain-PyTorch branch (devices without the kernels) is
checked against the kernels output by output.
"""

import os

import pytest
import torch

import normlib as nl

from normlib import ops

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not ops.HAS_TRITON, reason="Triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
]


def _args(kind, residual, affine, dtype=torch.float32, shape=(5, 40), rounding="torch"):
    g = torch.Generator().manual_seed(hash((kind, residual, affine)) % 1000)
    N = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    r = torch.randn(shape, generator=g).to(torch.float32 if residual == "float32" else dtype).requires_grad_() if residual != "none" else None
    w = torch.randn(N, generator=g).to(dtype).requires_grad_() if affine != "none" else None
    b = torch.randn(N, generator=g).to(dtype).requires_grad_() if (affine == "both" and kind == "layer") else None
    return (x, r, w, b, 1e-5, kind == "rms", rounding)


@pytest.fixture(autouse=True)
def _kernels_on_cpu():
    """The operators run the kernels on CPU only where the fused path is forced."""
    with ops.force_path("fused"):
        yield


CASES = [(k, r, a) for k in ("layer", "rms") for r in ("none", "same", "float32") for a in ("none", "weight", "both")
         if not (k == "rms" and a == "both")]


@pytest.mark.parametrize("kind,residual,affine", CASES)
def test_opcheck(kind, residual, affine):
    torch.library.opcheck(torch.ops.normlib.fused_norm.default, _args(kind, residual, affine))


@pytest.mark.parametrize("rounding", ["llama", "gemma", "t5_half", "deberta", "float32_out"])
def test_opcheck_every_rounding(rounding):
    kind = "layer" if rounding == "deberta" else "rms"
    args = _args(kind, "none", "both" if kind == "layer" else "weight", dtype=torch.bfloat16, rounding=rounding)
    torch.library.opcheck(torch.ops.normlib.fused_norm.default, args)


@pytest.mark.parametrize("kind,residual,affine", CASES)
def test_plain_pytorch_branch_matches_the_kernels(kind, residual, affine):
    args = _args(kind, residual, affine, dtype=torch.float64, shape=(4, 3, 24))
    results = {}
    for name, path in (("kernels", "fused"), ("plain", "reference")):
        with ops.force_path(path):
            leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
            outs = torch.ops.normlib.fused_norm.default(*leaves)
            g = [torch.randn(o.shape, dtype=o.dtype, generator=torch.Generator().manual_seed(i)) for i, o in enumerate(outs[:2])]
            loss = (outs[0] * g[0]).sum() + ((outs[1] * g[1]).sum() if residual != "none" else 0)
            loss.backward()
        results[name] = list(outs) + [a.grad for a in leaves if isinstance(a, torch.Tensor)]
    # float64 throughout, except that a float32 residual makes the residual sum and its statistics float32
    tol = dict(rtol=1e-12, atol=1e-12) if residual != "float32" else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(results["kernels"], results["plain"]):
        torch.testing.assert_close(a, b, **tol)


@pytest.fixture
def kernels_mode():
    with ops.use_compile_mode("kernels"):
        yield


def test_default_compile_mode_is_reference():
    assert ops.compile_mode() == "reference"
    with pytest.raises(ValueError, match="mode must be one of"):
        ops.set_compile_mode("fast")
    with pytest.raises(ValueError, match="mode must be one of"):
        ops.use_compile_mode("fast")


def test_compiled_fullgraph_keeps_one_operator_per_norm_and_matches_eager(kernels_mode):
    torch.manual_seed(0)
    x, r, w, b = torch.randn(6, 32), torch.randn(6, 32), torch.randn(32), torch.randn(32)
    leaves = [t.requires_grad_() for t in (x, r, w, b)]

    def f(x, r, w, b):
        y, res = ops.add_layer_norm(x, r, w, b)
        return ops.rms_norm(y * 2.0, w) + res

    found = []

    def backend(gm, example_inputs):
        found.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(*leaves)
    assert sum("normlib.fused_norm" in t for t in found) == 2
    torch._dynamo.reset()
    out = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)(*leaves)
    grads = torch.autograd.grad(out.sum(), leaves)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref = f(*ref_leaves)
    torch.testing.assert_close(out, ref)
    for a, b_ in zip(grads, torch.autograd.grad(ref.sum(), ref_leaves)):
        torch.testing.assert_close(a, b_)
    torch._dynamo.reset()


def test_double_backward_through_the_kernels_equals_the_reference():
    """The kernels' gradient has no graph; with create_graph=True a differentiable formula stands in."""
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(ops.layer_norm(x, w).pow(2).sum(), x, create_graph=True)
    got = torch.autograd.grad(gx.sin().sum(), (x, w))
    (rx,) = torch.autograd.grad(nl.functional.layer_norm(x, (8,), w).pow(2).sum(), x, create_graph=True)
    want = torch.autograd.grad(rx.sin().sum(), (x, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_the_operator_can_be_differentiated_twice():
    """create_graph through the custom operator (as through the autograd Function): its backward is a graph of
    PyTorch ops then (it raised "no autograd formula" for normlib::fused_norm_backward)."""
    x, r, w, b, eps, rms, rounding = _args("layer", "same", "both", dtype=torch.float64, shape=(2, 4))

    def f(x, r, w, b):
        y, s, _, _ = torch.ops.normlib.fused_norm.default(x, r, w, b, eps, rms, rounding)
        return y, s

    assert torch.autograd.gradgradcheck(f, (x, r, w, b))
