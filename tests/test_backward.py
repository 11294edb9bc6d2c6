"""The written-out backward passes of normlib.functional (issue #13).

Each op is a ``torch.autograd.Function`` whose backward is the textbook
formula. Checked here: first and second derivatives in float64 against finite
differences, the public ``*_backward`` functions against autograd through
``torch.nn.functional``, what autograd saves (no more than torch's), and the
edge cases a hand-written backward can get wrong (no weight, no bias, gradient
for only some inputs, low precision, empty input, non-contiguous input).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck

import normlib.functional as nf
from normlib.testing.tolerance import KAPPA_GRADIENT, close

torch.manual_seed(0)


def _d(*shape, requires_grad=True):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=requires_grad)


# op name -> (normlib call, torch call, input shape, parameter shape) with (x, w, b) arguments
def _bn_eval(fn):
    rm = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64)
    rv = torch.tensor([0.5, 1.5, 2.0], dtype=torch.float64)
    return lambda x, w, b: fn(x, rm, rv, w, b, False, 0.1, 1e-5)


OPS = {
    "layer_norm": (
        lambda x, w, b: nf.layer_norm(x, (4, 5), w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, (4, 5), w, b, 1e-5),
        (3, 4, 5),
        (4, 5),
    ),
    "rms_norm": (
        lambda x, w, b: nf.rms_norm(x, (5,), w, 1e-5),
        lambda x, w, b: F.rms_norm(x, (5,), w, 1e-5),
        (3, 4, 5),
        (5,),
    ),
    "batch_norm_train": (
        lambda x, w, b: nf.batch_norm(x, None, None, w, b, True, 0.1, 1e-5),
        lambda x, w, b: F.batch_norm(x, None, None, w, b, True, 0.1, 1e-5),
        (4, 3, 5),
        (3,),
    ),
    "batch_norm_eval": (_bn_eval(nf.batch_norm), _bn_eval(F.batch_norm), (4, 3, 5), (3,)),
    "group_norm": (
        lambda x, w, b: nf.group_norm(x, 2, w, b, 1e-5),
        lambda x, w, b: F.group_norm(x, 2, w, b, 1e-5),
        (3, 4, 2, 3),
        (4,),
    ),
    "instance_norm": (
        lambda x, w, b: nf.instance_norm(x, None, None, w, b, True, 0.1, 1e-5),
        lambda x, w, b: F.instance_norm(x, None, None, w, b, True, 0.1, 1e-5),
        (3, 2, 6),
        (2,),
    ),
}


@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_gradcheck_and_gradgradcheck_float64(name, affine):
    ours, _, xs, ps = OPS[name]
    x = _d(*xs)
    w = _d(*ps) if affine in ("both", "weight") else None
    b = _d(*ps) if affine == "both" and name != "rms_norm" else None
    inputs = tuple(t for t in (x, w, b) if t is not None)

    def f(*args):
        it = iter(args)
        return ours(next(it), next(it) if w is not None else None, next(it) if b is not None else None)

    assert gradcheck(f, inputs)
    assert gradgradcheck(f, inputs)


@pytest.mark.parametrize("name", sorted(OPS))
def test_gradients_match_torch_for_any_subset_of_inputs(name):
    ours, theirs, xs, ps = OPS[name]
    torch.manual_seed(1)
    x0 = torch.randn(*xs, dtype=torch.float64) * 3 + 2
    w0, b0 = torch.randn(*ps, dtype=torch.float64), torch.randn(*ps, dtype=torch.float64)
    dy = torch.randn(*xs, dtype=torch.float64)
    for need in [(1, 1, 1), (1, 0, 0), (0, 1, 1), (0, 0, 1)]:
        if name == "rms_norm" and need == (0, 0, 1):
            continue  # RMSNorm has no bias: nothing would need a gradient
        got, want = [], []
        for fn, out in ((ours, got), (theirs, want)):
            x, w, b = (t.clone().requires_grad_(bool(r)) for t, r in zip((x0, w0, b0), need))
            fn(x, w, b).backward(dy)
            out.extend(t.grad for t in (x, w, b))
        for g, h in zip(got, want):
            assert (g is None) == (h is None)
            if g is not None:
                torch.testing.assert_close(g, h)


def test_public_backward_functions_equal_autograd():
    torch.manual_seed(2)
    # LayerNorm over (4, 5)
    x, w, dy = _d(3, 4, 5), _d(4, 5), torch.randn(3, 4, 5, dtype=torch.float64)
    xc = x.detach() - x.detach().mean((-2, -1), keepdim=True)
    rstd = torch.rsqrt(xc.square().mean((-2, -1), keepdim=True) + 1e-5)
    dx, dw, db = nf.layer_norm_backward(dy, xc * rstd, rstd, (4, 5), w.detach())
    want = torch.autograd.grad(F.layer_norm(x, (4, 5), w, None, 1e-5), (x, w), dy)
    torch.testing.assert_close((dx, dw), want)
    torch.testing.assert_close(db, dy.sum(0))

    # RMSNorm
    x, w = _d(3, 5), _d(5)
    dy = torch.randn(3, 5, dtype=torch.float64)
    rrms = torch.rsqrt(x.detach().square().mean(-1, keepdim=True) + 1e-5)
    dx, dw = nf.rms_norm_backward(dy, x.detach(), rrms, 5, w.detach())
    torch.testing.assert_close((dx, dw), torch.autograd.grad(F.rms_norm(x, (5,), w, 1e-5), (x, w), dy))

    # BatchNorm, training and eval
    x, w, b = _d(4, 3, 5), _d(3), _d(3)
    dy = torch.randn(4, 3, 5, dtype=torch.float64)
    xd = x.detach()
    mean, var = xd.mean((0, 2)), xd.var((0, 2), unbiased=False)
    rstd = torch.rsqrt(var + 1e-5)
    xhat = (xd - mean[:, None]) * rstd[:, None]
    got = nf.batch_norm_backward(dy, xhat, rstd, w.detach(), training=True)
    want = torch.autograd.grad(F.batch_norm(x, None, None, w, b, True, 0.1, 1e-5), (x, w, b), dy)
    torch.testing.assert_close(got, want)
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64)
    rstd = torch.rsqrt(rv + 1e-5)
    got = nf.batch_norm_backward(dy, (xd - rm[:, None]) * rstd[:, None], rstd, w.detach(), training=False)
    want = torch.autograd.grad(F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5), (x, w, b), dy)
    torch.testing.assert_close(got, want)

    # GroupNorm, 2 groups of 2 channels
    x, w, b = _d(3, 4, 6), _d(4), _d(4)
    dy = torch.randn(3, 4, 6, dtype=torch.float64)
    xg = x.detach().reshape(3, 2, 12)
    rstd = torch.rsqrt(xg.var(-1, unbiased=False) + 1e-5)
    xhat = ((xg - xg.mean(-1, keepdim=True)) * rstd[..., None]).reshape(3, 4, 6)
    got = nf.group_norm_backward(dy, xhat, rstd, 2, w.detach())
    want = torch.autograd.grad(F.group_norm(x, 2, w, b, 1e-5), (x, w, b), dy)
    torch.testing.assert_close(got, want)


def _saved_bytes(fn, *args) -> int:
    """Bytes of the distinct tensors autograd saves for backward (parameters excluded)."""
    seen = {}
    params = {id(a) for a in args[1:] if isinstance(a, torch.Tensor)}

    def pack(t):
        if id(t) not in params and t.data_ptr() not in seen:
            seen[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(OPS))
def test_saves_no_more_than_torch(name):
    ours, theirs, xs, ps = OPS[name]
    x = torch.randn((64,) + tuple(xs[1:]), requires_grad=True)
    w, b = torch.randn(*ps, requires_grad=True), torch.randn(*ps, requires_grad=True)
    f32 = lambda fn: (lambda x, w, b: fn(x, w, b))  # noqa: E731
    if name == "batch_norm_eval":
        rm, rv = torch.zeros(3), torch.ones(3)
        ours = lambda x, w, b: nf.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5)  # noqa: E731
        theirs = lambda x, w, b: F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5)  # noqa: E731
    got, want = _saved_bytes(f32(ours), x, w, b), _saved_bytes(f32(theirs), x, w, b)
    assert got <= 1.25 * want, (got, want)


@pytest.mark.parametrize("name", sorted(OPS))
def test_low_precision_empty_and_non_contiguous(name):
    ours, theirs, xs, ps = OPS[name]
    if name == "batch_norm_eval":
        rm, rv = torch.zeros(3), torch.ones(3)
        ours = lambda x, w, b: nf.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5)  # noqa: E731
        theirs = lambda x, w, b: F.batch_norm(x, rm, rv, w, b, False, 0.1, 1e-5)  # noqa: E731
    torch.manual_seed(3)
    # bfloat16: gradients come back in the input's and the parameters' dtypes
    x = torch.randn(*xs).to(torch.bfloat16).requires_grad_()
    w, b = torch.randn(*ps, requires_grad=True), torch.randn(*ps, requires_grad=True)
    ours(x, w, b).float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    # non-contiguous input (a transpose of a contiguous tensor)
    base = torch.randn(*reversed(xs))
    x1 = base.permute(*reversed(range(len(xs)))).requires_grad_()
    x2 = base.permute(*reversed(range(len(xs)))).contiguous().requires_grad_()
    assert not x1.is_contiguous()
    dy = torch.randn(*xs)
    g1 = torch.autograd.grad(ours(x1, None, None), x1, dy)[0]
    g2 = torch.autograd.grad(theirs(x2, None, None), x2, dy)[0]
    torch.testing.assert_close(g1, g2, **close(torch.float32, kappa=KAPPA_GRADIENT))
    # empty batch (training BatchNorm has no statistics to take from it: skipped)
    if name != "batch_norm_train":
        x = torch.randn((0,) + tuple(xs[1:]), requires_grad=True)
        y = ours(x, w, b)
        y.sum().backward()
        assert y.shape == x.shape and x.grad.shape == x.shape


def test_backward_is_deterministic():
    x = torch.randn(16, 8, 12, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    dy = torch.randn(16, 8, 12)
    runs = [torch.autograd.grad(nf.group_norm(x, 4, w, None), (x, w), dy) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_vmap_of_grad_and_functional_call():
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(4)
    xs = torch.randn(5, 3, 8)
    w = torch.randn(8)

    def loss(x):
        return nf.layer_norm(x, (8,), w, None).square().sum()

    got = vmap(grad(loss))(xs)
    want = torch.stack([grad(lambda x: F.layer_norm(x, (8,), w, None).square().sum())(x) for x in xs])
    torch.testing.assert_close(got, want, **close(torch.float32, kappa=KAPPA_GRADIENT))

    m = torch.nn.GroupNorm(2, 4)
    params = {"weight": torch.randn(4, requires_grad=True), "bias": torch.randn(4, requires_grad=True)}
    x = torch.randn(3, 4, 5)

    class G(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = m.weight, m.bias

        def forward(self, x):
            return nf.group_norm(x, 2, self.weight, self.bias)

    out = functional_call(G(), params, (x,))
    g1 = torch.autograd.grad(out.square().sum(), list(params.values()))
    g2 = torch.autograd.grad(F.group_norm(x, 2, *params.values()).square().sum(), list(params.values()))
    torch.testing.assert_close(g1, g2, **close(torch.float32, kappa=KAPPA_GRADIENT))


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "group_norm", "batch_norm_train"])
def test_autocast_bfloat16_on_cpu(name):
    # A Linear under CPU autocast hands the norm bfloat16; forward and backward
    # run (statistics in float32) and the gradients agree with torch's to bf16 precision.
    ours, theirs, xs, ps = OPS[name]
    torch.manual_seed(5)
    lin = torch.nn.Linear(xs[-1], xs[-1])
    x = torch.randn(*xs)
    grads = []
    for fn in (ours, theirs):
        lin.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(lin(x), None, None)
        assert torch.isfinite(y).all()
        (y.float() * torch.linspace(-1, 1, xs[-1])).sum().backward()
        grads.append(lin.weight.grad.clone())
    assert grads[1].norm() > 0.1
    assert (grads[0] - grads[1]).norm() <= 0.03 * grads[1].norm()
