"""normlib.functional and the modules against torch.nn, forward and every gradient."""

import pytest
import torch
import torch.nn.functional as TF
from torch.autograd import gradcheck

import normlib as nl
import normlib.functional as F
from normlib.testing.tolerance import KAPPA_GRADIENT, close
from _helpers import assert_forward_backward, assert_no_worse

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]

# (input shape, normalized_shape): non-powers of two, 1-element rows, 3-D/4-D, empty batches
LN_CASES = [
    ((7, 13), (13,)),
    ((3, 5, 100), (100,)),
    ((2, 3, 4, 6), (4, 6)),
    ((4, 1), (1,)),
    ((0, 10), (10,)),
    ((2, 0, 10), (10,)),
    ((5, 1000), (1000,)),
]


def _rand(shape, dtype, requires_grad=True):
    return torch.randn(shape, dtype=torch.float64).to(dtype).requires_grad_(requires_grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,ns", LN_CASES)
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_layer_norm_matches_torch(shape, ns, dtype, affine):
    x = _rand(shape, dtype)
    w = _rand(ns, dtype) if affine != "none" else None
    b = _rand(ns, dtype) if affine == "both" else None
    assert_forward_backward(
        lambda x, w, b: F.layer_norm(x, ns, w, b, 1e-5),
        lambda x, w, b: TF.layer_norm(x, ns, w, b, 1e-5),
        [x, w, b],
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,ns", LN_CASES)
@pytest.mark.parametrize("eps", [None, 1e-6])
@pytest.mark.parametrize("affine", [False, True])
def test_rms_norm_matches_torch(shape, ns, dtype, eps, affine):
    x = _rand(shape, dtype)
    w = _rand(ns, dtype) if affine else None
    ref_eps = eps if eps is not None else torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    assert_forward_backward(
        lambda x, w: F.rms_norm(x, ns, w, eps),
        lambda x, w: TF.rms_norm(x, ns, w, eps),
        [x, w],
        dtype,
        reference=lambda x, w: TF.rms_norm(x, ns, w, ref_eps),
    )


GN_CASES = [((4, 6, 5), 3), ((2, 12, 3, 7), 4), ((3, 5, 9), 5), ((2, 4, 3, 3), 1), ((0, 6, 4), 2), ((3, 6), 2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,G", GN_CASES)
@pytest.mark.parametrize("affine", [False, True])
def test_group_norm_matches_torch(shape, G, dtype, affine):
    C = shape[1]
    x = _rand(shape, dtype)
    w = _rand((C,), dtype) if affine else None
    b = _rand((C,), dtype) if affine else None
    assert_forward_backward(
        lambda x, w, b: F.group_norm(x, G, w, b, 1e-5),
        lambda x, w, b: TF.group_norm(x, G, w, b, 1e-5),
        [x, w, b],
        dtype,
    )


BN_SHAPES = [(8, 3), (5, 7, 11), (4, 6, 5, 3), (2, 3, 1, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", BN_SHAPES)
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_matches_torch(shape, dtype, training):
    C = shape[1]
    x = _rand(shape, dtype)
    w, b = _rand((C,), dtype), _rand((C,), dtype)
    # torch's CPU kernel wants the running statistics in the input's dtype
    ours_rm, ours_rv = torch.rand(C).to(dtype), (torch.rand(C) + 0.5).to(dtype)
    ref_rm, ref_rv = ours_rm.clone(), ours_rv.clone()
    r64_rm, r64_rv = ours_rm.double().clone(), ours_rv.double().clone()
    assert_forward_backward(
        lambda x, w, b: F.batch_norm(x, ours_rm, ours_rv, w, b, training, 0.1, 1e-5),
        lambda x, w, b: TF.batch_norm(x, ref_rm, ref_rv, w, b, training, 0.1, 1e-5),
        [x, w, b],
        dtype,
        reference=lambda x, w, b: TF.batch_norm(x, r64_rm, r64_rv, w, b, training, 0.1, 1e-5),
    )
    assert_no_worse(ours_rm, ref_rm, r64_rm, dtype, "running_mean")
    assert_no_worse(ours_rv, ref_rv, r64_rv, dtype, "running_var")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(3, 4, 10), (2, 5, 3, 7)])
@pytest.mark.parametrize("use_input_stats", [True, False])
def test_instance_norm_matches_torch(shape, dtype, use_input_stats):
    C = shape[1]
    x = _rand(shape, dtype)
    w, b = _rand((C,), dtype), _rand((C,), dtype)
    ours_rm, ours_rv = torch.rand(C, dtype=dtype), torch.rand(C, dtype=dtype) + 0.5
    ref_rm, ref_rv = ours_rm.clone(), ours_rv.clone()
    r64_rm, r64_rv = ours_rm.double().clone(), ours_rv.double().clone()
    assert_forward_backward(
        lambda x, w, b: F.instance_norm(x, ours_rm, ours_rv, w, b, use_input_stats, 0.1, 1e-5),
        lambda x, w, b: TF.instance_norm(x, ref_rm, ref_rv, w, b, use_input_stats, 0.1, 1e-5),
        [x, w, b],
        dtype,
        reference=lambda x, w, b: TF.instance_norm(x, r64_rm, r64_rv, w, b, use_input_stats, 0.1, 1e-5),
    )
    assert_no_worse(ours_rm, ref_rm, r64_rm, dtype, "running_mean")
    assert_no_worse(ours_rv, ref_rv, r64_rv, dtype, "running_var")


def test_non_contiguous_and_channels_last():
    x = torch.randn(6, 10, 8).transpose(0, 1)  # (10, 6, 8), non-contiguous
    assert not x.is_contiguous()
    torch.testing.assert_close(F.layer_norm(x, (8,)), TF.layer_norm(x, (8,)))
    torch.testing.assert_close(F.rms_norm(x, (8,)), TF.rms_norm(x, (8,)))
    torch.testing.assert_close(F.group_norm(x, 3), TF.group_norm(x, 3))
    img = torch.randn(4, 6, 5, 3).to(memory_format=torch.channels_last)
    rm, rv = torch.zeros(6), torch.ones(6)
    torch.testing.assert_close(
        F.batch_norm(img, rm.clone(), rv.clone(), training=True), TF.batch_norm(img, rm, rv, training=True)
    )
    torch.testing.assert_close(F.group_norm(img, 2), TF.group_norm(img, 2))
    torch.testing.assert_close(F.instance_norm(img), TF.instance_norm(img))
    torch.testing.assert_close(F.layer_norm(img, (5, 3)), TF.layer_norm(img, (5, 3)))


def _gc(fn, *inputs):
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_float64_every_op():
    d = dict(dtype=torch.float64, requires_grad=True)
    x, w, b = torch.randn(3, 5, 7, **d), torch.randn(7, **d), torch.randn(7, **d)
    _gc(lambda x, w, b: F.layer_norm(x, (7,), w, b), x, w, b)
    _gc(lambda x, w: F.rms_norm(x, (7,), w, 1e-6), x, w)
    xc, wc, bc = torch.randn(4, 6, 3, **d), torch.randn(6, **d), torch.randn(6, **d)
    _gc(lambda x, w, b: F.group_norm(x, 3, w, b), xc, wc, bc)
    _gc(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), xc, wc, bc)
    rm, rv = torch.randn(6, dtype=torch.float64), torch.rand(6, dtype=torch.float64) + 0.5
    _gc(lambda x, w, b: F.batch_norm(x, rm, rv, w, b, training=False), xc, wc, bc)
    _gc(lambda x, w, b: F.instance_norm(x, weight=w, bias=b), xc, wc, bc)


@pytest.mark.parametrize(
    "ours,theirs,shape",
    [
        (lambda: nl.LayerNorm((4, 5)), lambda: torch.nn.LayerNorm((4, 5)), (3, 4, 5)),
        (lambda: nl.LayerNorm(5, bias=False), lambda: torch.nn.LayerNorm(5, bias=False), (3, 5)),
        (lambda: nl.LayerNorm(5, elementwise_affine=False), lambda: torch.nn.LayerNorm(5, elementwise_affine=False), (3, 5)),
        (lambda: nl.RMSNorm(6), lambda: torch.nn.RMSNorm(6), (2, 3, 6)),
        (lambda: nl.RMSNorm(6, eps=1e-6, elementwise_affine=False), lambda: torch.nn.RMSNorm(6, eps=1e-6, elementwise_affine=False), (2, 6)),
        (lambda: nl.GroupNorm(2, 6), lambda: torch.nn.GroupNorm(2, 6), (3, 6, 5)),
        (lambda: nl.GroupNorm(3, 6, affine=False), lambda: torch.nn.GroupNorm(3, 6, affine=False), (3, 6, 2, 2)),
        (lambda: nl.BatchNorm1d(6), lambda: torch.nn.BatchNorm1d(6), (8, 6)),
        (lambda: nl.BatchNorm1d(6, momentum=None), lambda: torch.nn.BatchNorm1d(6, momentum=None), (8, 6, 3)),
        (lambda: nl.BatchNorm1d(6, affine=False, track_running_stats=False), lambda: torch.nn.BatchNorm1d(6, affine=False, track_running_stats=False), (8, 6)),
        (lambda: nl.BatchNorm2d(3), lambda: torch.nn.BatchNorm2d(3), (4, 3, 5, 7)),
        (lambda: nl.InstanceNorm1d(3), lambda: torch.nn.InstanceNorm1d(3), (4, 3, 9)),
        (lambda: nl.InstanceNorm1d(3), lambda: torch.nn.InstanceNorm1d(3), (3, 9)),
        (lambda: nl.InstanceNorm2d(3, affine=True, track_running_stats=True), lambda: torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (4, 3, 5, 5)),
    ],
)
def test_modules_match_torch_over_train_and_eval(ours, theirs, shape):
    torch.manual_seed(1)
    a, b = ours(), theirs()
    # random affine parameters so that weight/bias matter, loaded through the state_dict
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(torch.randn_like(p))
    a.load_state_dict(b.state_dict())
    for mode in ("train", "train", "train", "eval", "train", "eval"):
        a.train(mode == "train")
        b.train(mode == "train")
        x = torch.randn(shape) * 3 + 1
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = a(xa), b(xb)
        torch.testing.assert_close(ya, yb, **close(torch.float32))
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        torch.testing.assert_close(xa.grad, xb.grad, **close(torch.float32, kappa=KAPPA_GRADIENT))
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert na == nb
            torch.testing.assert_close(pa.grad, pb.grad, **close(torch.float32, kappa=KAPPA_GRADIENT))
            pa.grad = pb.grad = None
        for (na, ba), (nb, bb) in zip(a.named_buffers(), b.named_buffers()):
            assert na == nb
            if na == "num_batches_tracked" and "Instance" in type(a).__name__:
                continue  # torch never counts InstanceNorm batches (documented difference)
            torch.testing.assert_close(ba, bb, msg=lambda m: f"buffer {na}: {m}")
