"""The Triton kernels on a CUDA GPU, at the shapes real models use.

Skipped without a GPU. Run with the interpreter off, e.g.::

    TRITON_INTERPRET=0 python -m pytest tests/test_ops_cuda.py -n 0

Same yardstick as the interpreter tests (``_fused_check.check``): forward and
every gradient no further from a float64 reference than twice torch's own
error in the same dtype. The M*N > 2^31 case needs about 20 GB of GPU memory.
"""

import os

import pytest
import torch

import normlib as nl
from normlib import ops
from _fused_check import check, leaves
from normlib.testing.tolerance import close

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or not ops.HAS_TRITON, reason="needs a CUDA GPU and Triton"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="set TRITON_INTERPRET=0 to run compiled kernels"),
]

WIDTHS = [1024, 2048, 2560, 3000, 4096, 5120, 7168, 8192, 16384]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(M, N, dtype, residual, kind, seed):
    torch.manual_seed(seed)
    dev = "cuda"
    x = torch.randn(M, N, device=dev).to(dtype)
    r = None
    if residual != "none":
        r = (2 * torch.randn(M, N, device=dev)).to(dtype if residual == "same" else torch.float32)
    w = (1 + 0.1 * torch.randn(N, device=dev)).to(dtype)
    b = (0.1 * torch.randn(N, device=dev)).to(dtype) if kind == "layer" else None
    return x, r, w, b


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("residual", ["none", "same", "float32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", WIDTHS)
def test_every_width_at_4096_rows(N, dtype, residual, kind):
    x, r, w, b = _inputs(4096, N, dtype, residual, kind, seed=N)
    check(kind, x, r, w, b, path="triton")


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("residual", ["none", "float32"])
@pytest.mark.parametrize("N", [2560, 4096, 8192])
def test_32768_rows_bfloat16(N, residual, kind):
    x, r, w, b = _inputs(32768, N, torch.bfloat16, residual, kind, seed=N + 1)
    check(kind, x, r, w, b, path="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_offset_rows(dtype):
    torch.manual_seed(0)
    spread = 0.1 if dtype == torch.float32 else 16.0
    x = (1e3 + spread * torch.randn(2048, 3000, device="cuda")).to(dtype)
    check("layer", x, None, torch.randn(3000, device="cuda"), torch.randn(3000, device="cuda"), path="triton")


def test_gradients_are_bitwise_deterministic_at_scale():
    x, r, w, b = _inputs(32768, 4096, torch.bfloat16, "float32", "layer", seed=3)
    dy = torch.randn(32768, 4096, device="cuda", dtype=torch.bfloat16)

    def grads():
        ins = leaves([x, r, w, b])
        y, res = ops.add_layer_norm(*ins)
        torch.autograd.backward([y, res], [dy, dy.float()])
        return [t.grad for t in ins]

    for a, b_ in zip(grads(), grads()):
        assert torch.equal(a, b_)


def test_torch_compile_fullgraph_around_fused_modules():
    torch.manual_seed(4)
    block = nl.TransformerBlock(512, 8, norm_first=True, norm="rms").cuda()
    head = nl.LayerNorm(512).cuda()
    model = torch.nn.Sequential(block, head)
    x = torch.randn(4, 128, 512, device="cuda", requires_grad=True)
    eager = model(x)  # fused kernels
    compiled = torch.compile(model, fullgraph=True)
    x2 = x.detach().clone().requires_grad_()
    out = compiled(x2)  # traced reference math, compiled by inductor
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
    eager.sum().backward()
    out.sum().backward()
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-3, atol=1e-3)


def test_more_than_2_to_the_31_elements():
    """int64 offsets: rows past element 2^31 are normalized, and their gradients computed, correctly."""
    N = 4096
    M = 2**31 // N + 64  # 2^31 + 64 N elements of bfloat16: 4 GiB per tensor
    torch.manual_seed(5)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    xl = x.requires_grad_()
    y = ops.layer_norm(xl, w, b)
    tail = slice(M - 128, M)  # the last rows start beyond 2^31 elements
    ref = torch.nn.functional.layer_norm(x[tail].detach().double(), (N,), w.double(), b.double())
    torch.testing.assert_close(y[tail].double(), ref, rtol=2e-2, atol=2e-2)
    dy = torch.randn_like(y)
    y.backward(dy)
    xt = x[tail].detach().double().requires_grad_()
    torch.nn.functional.layer_norm(xt, (N,), w.double(), b.double()).backward(dy[tail].double())
    torch.testing.assert_close(xl.grad[tail].double(), xt.grad, rtol=2e-2, atol=5e-2)


def test_parameters_on_another_device_are_refused():
    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match="weight is on device cpu but input is on cuda:0"):
        ops.layer_norm(x, torch.ones(64))
    with pytest.raises(ValueError, match="weight is on device .* but input is on"):
        nl.RMSNorm(64)(x)  # a module left on the CPU


@pytest.mark.parametrize("kind,residual", [("layer", None), ("layer", torch.float32), ("rms", torch.bfloat16)])
def test_opcheck_on_cuda(kind, residual):
    torch.manual_seed(6)
    x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(64, 1000, device="cuda", dtype=residual, requires_grad=True) if residual else None
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True) if kind == "layer" else None
    torch.library.opcheck(torch.ops.normlib.fused_norm.default, (x, r, w, b, 1e-5, kind == "rms", None, False, 0))


@pytest.mark.parametrize("mode", ["kernels", "reference"])
def test_inductor_in_both_compile_modes(mode):
    """Inductor compiles a block around the custom operators, or the reference math; both match eager."""
    torch.manual_seed(7)
    with ops.use_compile_mode(mode):
        try:
            torch._dynamo.reset()
            block = nl.TransformerBlock(256, 4, norm_first=True, norm="layer").cuda()
            x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
            eager = block(x)
            x2 = x.detach().clone().requires_grad_()
            out = torch.compile(block, fullgraph=True, dynamic=True)(x2)
            torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)
            eager.sum().backward()
            out.sum().backward()
            torch.testing.assert_close(x2.grad, x.grad, rtol=1e-3, atol=1e-3)
        finally:
            torch._dynamo.reset()


@pytest.mark.parametrize("cls", [nl.LayerNorm, nl.RMSNorm])
def test_a_cuda_crossover_entry_sends_small_calls_to_torchs_op(cls, monkeypatch):
    """With a ``cuda`` entry that names torch's op below 64 rows of 4096, a decoding-sized forward takes it
    (checked: torch.nn's numbers), a larger one and any call that wants a gradient the kernels."""
    from normlib.ops import routing

    table = {"cuda": {"layer_norm": {"forward": [(0, "native"), (64 * 4096 + 1, "fused")]},
                      "rms_norm": {"forward": [(0, "native"), (64 * 4096 + 1, "fused")]}}}
    monkeypatch.setattr(routing, "_BANDS", routing._bands(table))
    op = "layer_norm" if cls is nl.LayerNorm else "rms_norm"
    m = cls(4096).to("cuda", torch.bfloat16)
    theirs = getattr(torch.nn, cls.__name__)(4096).to("cuda", torch.bfloat16)
    small, large = (torch.randn(r, 4096, device="cuda", dtype=torch.bfloat16) for r in (8, 256))
    with torch.no_grad():
        assert ops.route(op, small, weight=m.weight) == "native"
        assert ops.route(op, large, weight=m.weight) == "fused"
        torch.testing.assert_close(m(small), theirs(small), **close(torch.bfloat16))
    assert ops.route(op, small.requires_grad_(), weight=m.weight) == "fused"  # no backward band: the kernels
