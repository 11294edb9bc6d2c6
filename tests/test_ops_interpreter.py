"""The Triton kernels, run on CPU through TRITON_INTERPRET=1 (set in conftest.py).

Every output and gradient is compared with a float64 reference computed from
the same, already rounded, inputs (``_fused_check.check``); the kernel's error
may be no worse than twice torch's own error in the same dtype plus a small atol.
"""

import os

import pytest
import torch

import normlib as nl
import normlib.functional as F
from normlib import ops
from normlib.testing.tolerance import KAPPA_GRADIENT, close
from _fused_check import check, leaves

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not ops.HAS_TRITON, reason="Triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 before triton is imported"),
]

# Rows M and widths N from the issue, covered without the full product:
# every N at M=3, every M at N=123, and a few heavier combinations.
WIDTHS = [1, 8, 100, 123, 128, 1000, 1024, 3000, 4096]
ROWS = [0, 1, 3, 64, 199]
SHAPES = sorted({(3, n) for n in WIDTHS} | {(m, 123) for m in ROWS} | {(64, 1000), (199, 8)})
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _kernels_on_cpu():
    """The route takes the interpreter only where it is forced to (a CPU tensor otherwise runs natively)."""
    with ops.force_path("fused"):
        yield


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_norm_forward_backward(shape, dtype, kind):
    torch.manual_seed(shape[0] * 10007 + shape[1])
    x = torch.randn(shape).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    b = torch.randn(shape[-1]).to(dtype) if kind == "layer" else None
    check(kind, x, None, w, b)


# The fused add + norm at every dtype on the small shapes; the wide rows (one block of 1024, several of 3000)
# in float32 and bfloat16 only: float16 takes the kernels' 16-bit path, which bfloat16 already runs at those
# widths (and test_norm_forward_backward runs float16 at every width).
ADD_NORM_CASES = [
    pytest.param(shape, dtype, id=f"{shape[0]}x{shape[1]}-{dtype}")
    for shape in [(3, 8), (64, 123), (3, 1024), (3, 3000), (0, 100)]
    for dtype in DTYPES
    if not (dtype == torch.float16 and shape[1] >= 1024)
]


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("residual_dtype", ["same", "float32"])
@pytest.mark.parametrize("shape, dtype", ADD_NORM_CASES)
def test_add_norm_forward_backward(shape, dtype, residual_dtype, kind):
    torch.manual_seed(shape[1])
    rdt = dtype if residual_dtype == "same" else torch.float32
    x = torch.randn(shape).to(dtype)
    r = (2 * torch.randn(shape)).to(rdt)
    w = torch.randn(shape[-1]).to(dtype)
    b = torch.randn(shape[-1]).to(dtype) if kind == "layer" else None
    check(kind, x, r, w, b)


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_weight_and_bias_optional(affine, dtype, kind):
    if kind == "rms" and affine == "both":
        pytest.skip("RMSNorm has no bias")
    torch.manual_seed(1)
    x = torch.randn(5, 100).to(dtype)
    w = torch.randn(100).to(dtype) if affine != "none" else None
    b = torch.randn(100).to(dtype) if affine == "both" else None
    check(kind, x, None, w, b)
    check(kind, x, torch.randn(5, 100), w, b)


def test_weights_in_float32_with_bfloat16_activations():
    torch.manual_seed(2)
    check("layer", torch.randn(7, 300).bfloat16(), None, torch.randn(300), torch.randn(300))
    check("rms", torch.randn(7, 300).half(), torch.randn(7, 300), torch.randn(300))


@pytest.mark.parametrize("shape", [(2, 3, 40), (2, 3, 4, 24)])
def test_3d_and_4d_inputs(shape):
    torch.manual_seed(3)
    x = torch.randn(shape)
    check("layer", x, None, torch.randn(shape[-1]), torch.randn(shape[-1]))
    check("rms", x, torch.randn(shape), torch.randn(shape[-1]))


def test_row_strided_views():
    torch.manual_seed(4)
    big = torch.randn(20, 160)
    x = big[:, 7:107]  # rows 160 apart, columns contiguous
    assert x.stride() == (160, 1)
    check("layer", x, None, torch.randn(100), torch.randn(100))
    check("rms", x, big[:, 30:130], torch.randn(100))
    xt = torch.randn(100, 6).t()  # column stride 6: the launcher must copy
    check("layer", xt, None, torch.randn(100), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_offset_low_variance_rows(dtype):
    # Padding lanes loaded as 0 would add (0 - 1000)^2 per masked lane to the
    # variance if they were not excluded: N=3000 pads to 4096 lanes.
    torch.manual_seed(5)
    spread = 0.1 if dtype == torch.float32 else 16.0  # bfloat16 values near 1000 are 4 apart
    x = (1e3 + spread * torch.randn(4, 3000)).to(dtype)
    check("layer", x, None, torch.randn(3000), torch.randn(3000))
    y = ops.layer_norm(x)
    assert (y.float().std(-1) - 1).abs().max() < 0.05


def test_gradcheck_float64():
    """gradcheck's fast mode (a random projection vᵀJu of the Jacobian against finite differences, the mode
    torch recommends for expensive functions): each interpreted launch costs a fraction of a second, and the
    full Jacobian took ~100 launches per op; test_norm_forward_backward compares every gradient element."""
    torch.manual_seed(6)
    d = dict(dtype=torch.float64, requires_grad=True)
    x, r, w, b = torch.randn(3, 7, **d), torch.randn(3, 7, **d), torch.randn(7, **d), torch.randn(7, **d)
    fast = dict(fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, w, b: ops.layer_norm(x, w, b), (x, w, b), **fast)
    assert torch.autograd.gradcheck(lambda x, w: ops.rms_norm(x, w, 1e-6), (x, w), **fast)
    assert torch.autograd.gradcheck(lambda x, r, w, b: ops.add_layer_norm(x, r, w, b), (x, r, w, b), **fast)
    assert torch.autograd.gradcheck(lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6), (x, r, w), **fast)


def test_gradients_are_bitwise_deterministic():
    torch.manual_seed(7)
    x, r = torch.randn(64, 123), torch.randn(64, 123)
    w, b = torch.randn(123), torch.randn(123)
    dy = torch.randn(64, 123)

    def grads():
        ins = leaves([x, r, w, b])
        y, res = ops.add_layer_norm(*ins)
        (y * dy).sum().add((res * dy).sum()).backward()
        return [t.grad for t in ins]

    for a, b_ in zip(grads(), grads()):
        assert torch.equal(a, b_)


def test_results_match_the_reference_path_exactly_in_float64():
    torch.manual_seed(8)
    x, w, b = torch.randn(6, 50, dtype=torch.float64), torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    torch.testing.assert_close(ops.layer_norm(x, w, b), F.layer_norm(x, (50,), w, b), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, (50,), w, 1e-6), rtol=1e-13, atol=1e-13)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Record each kernel call's ``rms``."""
    calls = []
    real = ops.dispatch.fused

    def spy(*args, **kwargs):
        calls.append(kwargs["rms"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops.dispatch, "fused", spy)
    return calls


def test_modules_and_block_through_the_kernels(kernel_calls):
    """With the fused path forced, the modules and the Pre-Norm block route through the kernels."""
    torch.manual_seed(9)
    calls = kernel_calls
    for norm in ("layer", "rms"):
        block = nl.TransformerBlock(32, 4, norm_first=True, norm=norm)
        x = torch.randn(2, 5, 32, requires_grad=True)
        y = block(x)
        with ops.force_path("reference"):
            x2 = x.detach().clone().requires_grad_()
            y2 = block(x2)
        torch.testing.assert_close(y, y2, **close(torch.float32))
        y.sum().backward()
        y2.sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, **close(torch.float32, kappa=KAPPA_GRADIENT))
    assert calls.count(False) >= 2 and calls.count(True) >= 2  # layer and rms kernels both ran


@pytest.mark.parametrize("mode", ["kernels", "reference"])
def test_torch_compile_keeps_the_kernels_or_traces_the_reference(kernel_calls, mode):
    """Under torch.compile the kernels are one opaque operator each ("kernels"), or the reference math is traced."""
    torch.manual_seed(10)
    with ops.use_compile_mode(mode):
        try:
            block = nl.TransformerBlock(16, 4, norm_first=True, norm="rms")
            x = torch.randn(2, 5, 16, requires_grad=True)
            eager = block(x)
            targets = []

            def inspect(gm, example_inputs):
                targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
                return gm

            torch._dynamo.reset()
            out = torch.compile(block, backend=inspect, fullgraph=True)(x)
            fused = [t for t in targets if "normlib.fused_norm" in t]
            assert len(fused) == (2 if mode == "kernels" else 0)  # norm1, and add + norm2
            torch._dynamo.reset()
            x2 = x.detach().clone().requires_grad_()
            out = torch.compile(block, backend="aot_eager", fullgraph=True)(x2)
            torch.testing.assert_close(out, eager, **close(torch.float32))
            eager.sum().backward()
            out.sum().backward()
            torch.testing.assert_close(x2.grad, x.grad, **close(torch.float32, kappa=KAPPA_GRADIENT))
        finally:
            torch._dynamo.reset()


def test_threads_may_launch_the_kernels_at_once(kernels_on_cpu):
    """Triton's interpreter is not thread-safe: launches from several threads are serialised (threads with
    grids of different sizes crashed each other before: "Did you forget to add @triton.jit?",
    "x >= grid_dim[0]"), and every thread gets the right result."""
    import threading

    import torch.nn.functional as TF

    kernels_on_cpu()
    errors, wrong = [], []

    def work(seed, rows):
        g = torch.Generator().manual_seed(seed)
        for _ in range(40):
            x = torch.randn(rows, 8, generator=g)
            try:
                y = ops.layer_norm(x)
            except Exception as e:  # noqa: BLE001 - any error is the failure being tested for
                errors.append(repr(e)[:120])
                continue
            if not torch.allclose(y, TF.layer_norm(x, (8,)), **close(torch.float32)):
                wrong.append(rows)

    threads = [threading.Thread(target=work, args=(i, rows)) for i, rows in enumerate((1, 3, 17, 64))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == [] and wrong == [], (errors[:3], wrong[:3])


@pytest.mark.parametrize("x_dtype, r_dtype", [(a, b) for a in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
                                              for b in (torch.float16, torch.bfloat16, torch.float32, torch.float64)],
                         ids=str)
def test_every_input_and_residual_dtype_pair_on_the_forced_fused_path(kernels_on_cpu, x_dtype, r_dtype):
    """add_rms_norm forced onto the kernels agrees with the reference, forward and backward, for every pair of
    dtypes. Triton 3.7.1's interpreter converts float64 to bfloat16 wrongly (x.grad all zeros or NaN): on CPU the
    route sends that pair to the reference (a GPU converts it right)."""
    g = torch.Generator().manual_seed(0)
    x0, r0 = torch.randn(4, 16, generator=g, dtype=torch.float64), torch.randn(4, 16, generator=g, dtype=torch.float64)
    results = {}
    for path in ("fused", "reference"):
        x, r = x0.to(x_dtype).requires_grad_(), r0.to(r_dtype).requires_grad_()
        with ops.force_path(path):
            y, s = ops.add_rms_norm(x, r, None, 1e-6)
            (y.double().sum() + (s.double() * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum()).backward()
        results[path] = [t.double() for t in (y, s, x.grad, r.grad)]
    coarsest = min((x_dtype, r_dtype), key=lambda d: torch.finfo(d).bits if d != torch.bfloat16 else 0)
    for got, want in zip(results["fused"], results["reference"]):
        torch.testing.assert_close(got, want, **close(coarsest, roundings=4))
    if {x_dtype, r_dtype} == {torch.float64, torch.bfloat16}:
        assert ops.route("add_rms_norm", x0.to(x_dtype), r0.to(r_dtype)) != "fused"
