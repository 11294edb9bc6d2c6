"""Every module under torch.export with a dynamic batch size, and a symbolic eps under dynamo.

torch.compile(fullgraph=True, dynamic=True) of every module, in training and
eval mode, with a second batch size that must not recompile, is
tests/test_compile_gradients.py's zoo (outputs, gradients and running
statistics against eager, in both of normlib's compile modes).
"""

import copy

import pytest
import torch
from torch.export import Dim, export

import normlib as nl

CASES = {
    "LayerNorm": (lambda: nl.LayerNorm(32), (4, 6, 32)),
    "LayerNorm2d-shape": (lambda: nl.LayerNorm((3, 8), bias=False), (4, 3, 8)),
    "RMSNorm": (lambda: nl.RMSNorm(32), (4, 6, 32)),
    "RMSNorm-eps": (lambda: nl.RMSNorm(32, eps=1e-6), (4, 32)),
    "GroupNorm": (lambda: nl.GroupNorm(4, 32), (4, 32, 5)),
    "BatchNorm1d": (lambda: nl.BatchNorm1d(8), (4, 8, 5)),
    "BatchNorm2d": (lambda: nl.BatchNorm2d(8), (4, 8, 3, 3)),
    "BatchNorm2d-untracked": (lambda: nl.BatchNorm2d(8, track_running_stats=False), (4, 8, 3, 3)),
    "InstanceNorm1d": (lambda: nl.InstanceNorm1d(8, affine=True), (4, 8, 5)),
    "InstanceNorm2d": (lambda: nl.InstanceNorm2d(8, affine=True, track_running_stats=True), (4, 8, 3, 3)),
}


def _perturbed(make):
    m = make()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_export_with_a_dynamic_batch(name, train):
    make, shape = CASES[name]
    m = _perturbed(make).train(train)
    reference = copy.deepcopy(m)
    ep = export(m, (torch.randn(shape),), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
    x = torch.randn((shape[0] + 5,) + shape[1:])
    torch.testing.assert_close(ep.module()(x), reference(x))


def test_symbolic_eps_passes_the_checks():
    """The failure in issue 12: math.isfinite on a symbolic eps while dynamo traces."""
    torch._dynamo.reset()
    f = torch.compile(lambda x, eps: nl.functional.layer_norm(x, (8,), None, None, eps), fullgraph=True, dynamic=True,
                      backend="eager")
    x = torch.randn(3, 8)
    for eps in (1e-5, 1e-3):
        torch.testing.assert_close(f(x, eps), torch.nn.functional.layer_norm(x, (8,), eps=eps))
