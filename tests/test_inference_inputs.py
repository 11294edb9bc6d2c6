"""A batch made under ``torch.inference_mode`` trains trainable γ/β, on every path.

Autograd refuses to save an inference tensor for backward ("Inference tensors
cannot be saved for backward"). torch.nn.RMSNorm trains on one anyway (it
saves only values computed from it); torch's LayerNorm, GroupNorm, BatchNorm
and InstanceNorm raise (torch 2.13, CPU). Every normlib module trains on one,
on every path the route can take and in every dtype, with the gradients
torch's module gives in float64 for the same values in a normal tensor.
"""

import pytest
import torch
from torch import nn

import normlib as nl

from normlib.testing.tolerance import close, tolerance

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# name: (normlib module, torch module, input shape)
MODULES = {
    "LayerNorm": (lambda dt: nl.LayerNorm(8, dtype=dt), lambda dt: nn.LayerNorm(8, dtype=dt), (4, 8)),
    "RMSNorm": (lambda dt: nl.RMSNorm(8, eps=1e-6, dtype=dt), lambda dt: nn.RMSNorm(8, eps=1e-6, dtype=dt), (4, 8)),
    "GroupNorm": (lambda dt: nl.GroupNorm(2, 4, dtype=dt), lambda dt: nn.GroupNorm(2, 4, dtype=dt), (3, 4, 5)),
    "BatchNorm1d": (lambda dt: nl.BatchNorm1d(4, dtype=dt), lambda dt: nn.BatchNorm1d(4, dtype=dt), (6, 4)),
    "BatchNorm2d": (lambda dt: nl.BatchNorm2d(4, dtype=dt), lambda dt: nn.BatchNorm2d(4, dtype=dt), (3, 4, 2, 2)),
    "InstanceNorm1d": (lambda dt: nl.InstanceNorm1d(4, affine=True, dtype=dt),
                       lambda dt: nn.InstanceNorm1d(4, affine=True, dtype=dt), (3, 4, 5)),
    "InstanceNorm2d": (lambda dt: nl.InstanceNorm2d(4, affine=True, dtype=dt),
                       lambda dt: nn.InstanceNorm2d(4, affine=True, dtype=dt), (3, 4, 3, 3)),
}


def _inference_input(shape, dtype):
    with torch.inference_mode():
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2 + 1).to(dtype)
    assert x.is_inference()
    return x


def _upstream(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _train_one_step(module, x):
    """γ's and β's gradients for the loss sum(y · r), r a fixed random upstream gradient."""
    for p in module.parameters():
        p.grad = None
    y = module(x)
    (y * _upstream(x.shape).to(y.dtype)).sum().backward()
    return [p.grad for p in module.parameters()]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", ["native", "reference"])
@pytest.mark.parametrize("name", list(MODULES))
def test_an_inference_batch_trains_the_parameters(name, path, dtype):
    ours, theirs, shape = MODULES[name]
    x = _inference_input(shape, dtype)
    want = _train_one_step(theirs(torch.float64), x.double().clone())  # the same values, in a normal tensor
    module = ours(dtype)
    with nl.ops.force_path(path):
        got = _train_one_step(module, x)
    assert len(got) == len(want) > 0
    # γ's and β's gradients are sums over the batch of r·x̂ and r, each rounded (up to 8 times, as the
    # checkers allow): relative to the sum of their sizes, |x̂| <= 4 here
    t = tolerance(dtype, n=x.numel(), roundings=8)
    scale = 4 * _upstream(x.shape).abs().sum().item()
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=0, atol=t * scale)


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["LayerNorm", "RMSNorm"])
def test_an_inference_batch_trains_through_the_kernels(kernels_on_cpu, name):
    ours, theirs, shape = MODULES[name]
    x = _inference_input(shape, torch.float32)
    want = _train_one_step(theirs(torch.float32), x.clone())
    kernels_on_cpu()
    got = _train_one_step(ours(torch.float32), x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **close(torch.float32))


def test_the_functions_train_on_an_inference_batch():
    x = _inference_input((2, 4, 6), torch.float32)
    w, b = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
    with nl.ops.force_path("reference"):
        nl.functional.layer_norm(x, (6,), w.new_ones(6).requires_grad_(), None).sum().backward()
        nl.functional.rms_norm(x, (6,), w.new_ones(6).requires_grad_()).sum().backward()
        nl.functional.group_norm(x, 2, w, b).sum().backward()
        nl.functional.batch_norm(x, None, None, w, b, training=True).sum().backward()
    assert w.grad is not None and b.grad is not None
