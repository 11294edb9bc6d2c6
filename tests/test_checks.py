"""The quick acceptance in front of each norm's argument checks accepts only what the full checks accept.

normlib's ``check_*_args`` first try the call a module makes (a few
attribute reads) and fall back to checking each argument with its own
message. The quick test is a shortcut, never a second rule: over every
combination below of good and bad inputs, parameters, shapes and eps, the
result with it (a return value, or an error and its message) equals the
result of the full checks alone.
"""

import itertools

import pytest
import torch

from normlib import _checks

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except (TypeError, ValueError) as e:
        return (type(e).__name__, str(e))


def _agree(monkeypatch, fn, *args):
    quick = _outcome(fn, *args)
    with monkeypatch.context() as m:
        m.setattr(_checks, "_QUICK", False)
        full = _outcome(fn, *args)
    assert quick == full, f"{fn.__name__}{args!r}: quick {quick} full {full}"
    return quick[0] == "ok"


def _inputs(shape):
    yield torch.randn(shape)
    yield torch.randn(shape, dtype=F16)
    yield torch.randn(shape, dtype=BF16)
    yield torch.randn(shape, dtype=F64)
    yield torch.ones(shape, dtype=torch.int64)
    yield torch.randn(shape, device="meta")
    yield torch.randn(shape).to_sparse()
    yield torch.nested.nested_tensor([torch.randn(shape), torch.randn(shape)])
    yield torch.randn(shape).t() if len(shape) == 2 else torch.randn(shape)
    yield 3.0


def _params(shape):
    yield None
    yield torch.randn(shape)
    yield torch.randn(shape, dtype=F16)
    yield torch.randn(shape, dtype=F64)
    yield torch.nn.Parameter(torch.randn(shape))
    yield torch.randn(shape[0] + 1)
    yield torch.randn(shape, device="meta")
    yield torch.ones(shape, dtype=torch.int32)
    yield torch.randn(shape).to_sparse()


EPS = [1e-5, 0.0, -1.0, float("inf"), float("nan"), 1, True, None, "1e-5"]


def test_layer_norm_and_rms_norm(monkeypatch):
    accepted = 0
    shapes = [(4,), (4.0,), (-1,), (), (3, 4), [4], 4, (5,)]
    biases = [None, torch.randn(4), torch.randn(5), torch.randn(4, dtype=F64), torch.randn(4, device="meta"),
              torch.randn(4, dtype=F16)]
    for x, ns, w, eps in itertools.product(list(_inputs((3, 4))), shapes, list(_params((4,))), EPS):
        accepted += _agree(monkeypatch, _checks.check_rms_norm_args, x, ns, w, eps)
        for b in biases:
            accepted += _agree(monkeypatch, _checks.check_layer_norm_args, x, ns, w, b, eps)
    assert accepted > 100  # the good calls are among them


def test_group_norm(monkeypatch):
    accepted = 0
    for x, G, w, b, eps in itertools.product(list(_inputs((2, 4, 3))), [2, 3, 0, -2, 2.0, True],
                                             list(_params((4,))), [None, torch.randn(4), torch.randn(5)], EPS):
        accepted += _agree(monkeypatch, _checks.check_group_norm_args, x, G, w, b, eps)
    assert accepted > 20


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm(monkeypatch, training):
    accepted = 0
    stats = [None, torch.zeros(4), torch.zeros(4, dtype=F64), torch.zeros(5)]
    for x, w, (rm, rv), momentum, eps in itertools.product(
            list(_inputs((2, 4, 3))) + [torch.randn(1, 4)], list(_params((4,))),
            [(None, None), (stats[1], stats[1]), (stats[1], None), (stats[2], stats[2]), (stats[3], stats[3])],
            [0.1, 0.0, 1.5, None, 1], [1e-5, -1.0, None]):
        accepted += _agree(monkeypatch, _checks.check_batch_norm_args, x, rm, rv, w, w, training, momentum, eps)
    assert accepted > 10
