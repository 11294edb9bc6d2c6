"""Inputs where naive normalization code loses accuracy or overflows."""

import pytest
import torch
import torch.nn.functional as TF

import normlib.functional as F


def _ref_layer_norm(x, n):
    return TF.layer_norm(x.double(), (n,), eps=1e-5)


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_layer_norm_large_offset_stays_accurate(offset):
    # Values offset + noise of std 1: in float32 the offset costs log2(offset) bits
    # of each input already; E[x^2] - E[x]^2 would lose everything at 1e4.
    n = 1000
    x = (offset + torch.randn(8, n, dtype=torch.float64)).float()
    y = F.layer_norm(x, (n,))
    ref = _ref_layer_norm(x, n)  # exact math on the rounded float32 inputs
    assert torch.isfinite(y).all()
    # conditioning limit: each input's rounding error is ~offset * 2**-24, relative to std 1
    limit = 4 * offset * 2.0**-24
    assert (y.double() - ref).abs().max() <= limit + 1e-5


def test_naive_formula_fails_where_two_pass_does_not():
    # The E[x^2] - E[x]^2 formula returns a variance that is wrong (here: 0 or negative).
    x = (1e4 + torch.randn(4, 1000, dtype=torch.float64)).float()
    naive_var = (x * x).mean(-1) - x.mean(-1) ** 2
    true_var = x.double().var(-1, unbiased=False)
    assert ((naive_var.double() - true_var).abs() > 0.5).any()
    xc, _, var = F.moments(x, (-1,))
    torch.testing.assert_close(var.squeeze(-1).double(), true_var, rtol=1e-5, atol=0)


@pytest.mark.parametrize("value", [0.0, 1.0, 1e6, -3.7e5, 123.456])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_constant_rows_give_exactly_the_bias(value, dtype):
    if dtype == torch.float16 and abs(value) > 6e4:
        pytest.skip("not representable in float16")
    n = 37
    x = torch.full((3, n), value, dtype=dtype)
    w = torch.randn(n, dtype=dtype)
    b = torch.randn(n, dtype=dtype)
    assert torch.equal(F.layer_norm(x, (n,), w, b), b.expand(3, n))
    # group norm: constant group; instance norm: constant channel
    img = torch.full((2, 6, 5, 5), value, dtype=dtype)
    bc = torch.randn(6, dtype=dtype)
    expect = bc.view(1, 6, 1, 1).expand_as(img)
    assert torch.equal(F.group_norm(img, 3, None, bc), expect)
    assert torch.equal(F.instance_norm(img, bias=bc), expect)
    assert torch.equal(F.batch_norm(img, None, None, None, bc, training=True), expect)


def test_constant_batchnorm_channel_where_torch_is_off():
    # A channel holding 1e6 everywhere: the exact output is the bias (0 here).
    x = torch.full((16, 3, 8, 8), 1e6)
    ours = F.batch_norm(x, None, None, training=True)
    assert torch.equal(ours, torch.zeros_like(x))
    # torch's own kernel is not exact here; we only record that ours is.
    theirs = TF.batch_norm(x, None, None, training=True)
    assert (ours - 0).abs().max() <= (theirs - 0).abs().max()


def test_rms_norm_float16_large_values_do_not_overflow():
    x = (300 * torch.randn(4, 512)).clamp(-6e4, 6e4).half()
    assert torch.isinf((x * x)).any()  # squaring in float16 would overflow
    y = F.rms_norm(x, (512,))
    ref = TF.rms_norm(x.double(), (512,), eps=torch.finfo(torch.float32).eps)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), ref, rtol=2e-3, atol=2e-3)


def test_low_precision_inputs_are_computed_in_float32():
    x = (100 + torch.randn(4, 300)).to(torch.bfloat16)
    y = F.layer_norm(x, (300,))
    assert y.dtype == torch.bfloat16
    ref = TF.layer_norm(x.double(), (300,))
    # only the final rounding to bfloat16 (8 bits) remains
    assert (y.double() - ref).abs().max() <= 2**-7 * ref.abs().max()


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_backward_at_a_large_offset_stays_accurate(offset):
    # The written-out backward recomputes x̂ from the saved x and the shifted mean:
    # its gradient must be as accurate as the forward, far from zero too.
    torch.manual_seed(0)
    n = 1000
    x = (offset + torch.randn(8, n, dtype=torch.float64)).float()
    dy = torch.randn(8, n)
    xs = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(F.layer_norm(xs, (n,)), xs, dy)
    xd = x.double().requires_grad_()
    (ref,) = torch.autograd.grad(TF.layer_norm(xd, (n,), eps=1e-5), xd, dy.double())
    assert torch.isfinite(g).all()
    scale = ref.abs().max()
    assert ((g.double() - ref).abs().max() / scale) <= 4 * offset * 2.0**-24 + 1e-5


def test_constant_rows_give_zero_gradient_and_exact_bias_gradient():
    # A constant row: x̂ = 0 exactly, so dγ gets nothing from it and dx = rstd·(ĝ − mean ĝ).
    x = torch.full((3, 16), 1e4, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    dy = torch.randn(3, 16)
    F.layer_norm(x, (16,), w, b).backward(dy)
    assert torch.equal(w.grad, torch.zeros(16))
    assert torch.equal(b.grad, dy.sum(0))
    ghat = w.detach() * dy
    torch.testing.assert_close(x.grad, (ghat - ghat.mean(-1, keepdim=True)) * (1e-5) ** -0.5)
