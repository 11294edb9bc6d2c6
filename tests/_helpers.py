"""Shared helpers for the parity tests."""

import torch

from normlib.testing.tolerance import tolerance



def _clone(ts, dtype=None):
    out = []
    for t in ts:
        if t is None:
            out.append(None)
            continue
        c = t.detach().clone()
        if dtype is not None:
            c = c.to(dtype)
        out.append(c.requires_grad_(t.requires_grad))
    return out


def _max_err(a, ref):
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def assert_forward_backward(ours, theirs, inputs, dtype, reference=None):
    """Compare ``ours`` with torch's ``theirs`` on the same ``dtype`` inputs.

    The yardstick is a float64 evaluation of ``reference`` (default:
    ``theirs``) on the same, already rounded, inputs: our error against it may
    be no worse than twice torch's own error in ``dtype``, plus a small atol.
    The output and every input's gradient are checked.
    """
    reference = reference or theirs
    a, b, r = _clone(inputs), _clone(inputs), _clone(inputs, torch.float64)
    ya, yb, yr = ours(*a), theirs(*b), reference(*r)
    assert ya.dtype == yb.dtype == dtype and ya.shape == yb.shape
    g = torch.randn(yb.shape, dtype=torch.float64).to(dtype)
    pairs = [("output", ya, yb, yr)]
    if ya.requires_grad:
        ya.backward(g)
        yb.backward(g)
        yr.backward(g.double())
        for i, (ta, tb, tr) in enumerate(zip(a, b, r)):
            if ta is not None and ta.requires_grad:
                pairs.append((f"grad of input {i}", ta.grad, tb.grad, tr.grad))
    for name, va, vb, vr in pairs:
        assert_no_worse(va, vb, vr, dtype, name)


def assert_no_worse(ours, theirs, ref, dtype, name="value"):
    """``ours`` is no further from ``ref`` than twice ``theirs`` is, plus a scaled atol."""
    assert ours.shape == theirs.shape == ref.shape, name
    assert torch.isfinite(ours).all() or not torch.isfinite(theirs).all(), f"{name}: non-finite values"
    ea, eb = _max_err(ours, ref), _max_err(theirs, ref)
    scale = max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    # the slack, relative to the values' scale, is the one rule of normlib.testing.tolerance
    assert ea <= 2 * eb + tolerance(dtype) * scale, f"{name}: our max error {ea:.3g} vs torch's {eb:.3g} in {dtype}"

