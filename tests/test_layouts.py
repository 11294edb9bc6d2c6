"""Every layout of input and parameters, on every path the route can take, computes what torch computes.

Generated, not picked: each input layout (contiguous, transposed, strided slice, expanded along the batch,
elements that overlap in memory, channels_last and channels_last_3d, a view at an offset) and each parameter
layout (contiguous, a strided view, one value expanded to every channel, a view at an offset) is run through
every module's functional and the residual-add entries on the default route and with each path forced, in
float32 and float64 (forward and backward) and in bfloat16 and float16 (forward), and compared with
torch.nn.functional on contiguous copies of the same values.
"""

import itertools

import pytest
import torch
import torch.nn.functional as TF

from normlib import ops
from normlib.ops import dispatch
from normlib.testing.tolerance import close


def _input_layouts(shape):
    """name -> a function of a contiguous tensor of ``shape`` that returns the same values in that layout
    (differentiable: gradients reach the tensor it was given)."""
    dense = torch.empty(shape).stride()
    overlap = tuple(max(1, st // 2) if st > 1 else st for st in dense)  # neighbours share half their elements
    layouts = {
        "contiguous": lambda t: t,
        "transposed": lambda t: t.transpose(0, -1).contiguous().transpose(0, -1),
        "strided": lambda t: torch.cat([t, torch.zeros_like(t)], dim=1)[:, :shape[1]],
        "expanded": lambda t: t[:1].expand(shape),
        "overlapping": lambda t: t.reshape(-1).as_strided(shape, overlap),
        "offset": lambda t: torch.cat([t.new_zeros(3), t.reshape(-1)])[3:].view(shape),
    }
    if len(shape) == 4:
        layouts["channels_last"] = lambda t: t.contiguous(memory_format=torch.channels_last)
    if len(shape) == 5:
        layouts["channels_last_3d"] = lambda t: t.contiguous(memory_format=torch.channels_last_3d)
    return layouts


PARAM_LAYOUTS = {
    "contiguous": lambda t: t,
    "strided": lambda t: torch.stack([torch.zeros_like(t), t, torch.zeros_like(t)], dim=1)[:, 1],
    "expanded": lambda t: t[:1].expand(t.shape),
    "offset": lambda t: torch.cat([t.new_zeros(2), t])[2:],
}


def _values(shape, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(shape, generator=g), 1 + 0.5 * torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def _residual(shape, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(dtype)


PATHS = [None, "native", "reference", "fused"]  # "fused": the kernels through Triton's interpreter where they cover the call


def _cases():
    # name, input shape, ours(x, w, b), theirs(x, w, b), parameter length from the shape
    yield "layer_norm", (4, 3, 6), lambda x, w, b: dispatch.layer_norm(x, (6,), w, b, 1e-5), \
        lambda x, w, b: TF.layer_norm(x, (6,), w, b, 1e-5), 6
    yield "rms_norm", (4, 3, 6), lambda x, w, b: dispatch.rms_norm(x, (6,), w, 1e-5), \
        lambda x, w, b: TF.rms_norm(x, (6,), w, 1e-5), 6
    yield "group_norm", (4, 6, 3, 2), lambda x, w, b: dispatch.group_norm(x, 3, w, b, 1e-5), \
        lambda x, w, b: TF.group_norm(x, 3, w, b, 1e-5), 6
    yield "instance_norm", (4, 6, 3, 2), lambda x, w, b: dispatch.instance_norm(x, None, None, w, b, True, 0.1, 1e-5), \
        lambda x, w, b: TF.instance_norm(x, None, None, w, b, True, 0.1, 1e-5), 6
    yield "batch_norm", (4, 6, 3, 2), lambda x, w, b: dispatch.batch_norm(x, None, None, w, b, True, 0.1, 1e-5), \
        lambda x, w, b: TF.batch_norm(x, None, None, w, b, True, 0.1, 1e-5), 6
    yield "group_norm_5d", (2, 4, 3, 2, 2), lambda x, w, b: dispatch.group_norm(x, 2, w, b, 1e-5), \
        lambda x, w, b: TF.group_norm(x, 2, w, b, 1e-5), 4
    yield "batch_norm_5d", (2, 4, 3, 2, 2), lambda x, w, b: dispatch.batch_norm(x, None, None, w, b, True, 0.1, 1e-5), \
        lambda x, w, b: TF.batch_norm(x, None, None, w, b, True, 0.1, 1e-5), 4
    # the residual entries: x in the layout, the residual contiguous; y compared (residual_out is x + r)
    yield "add_layer_norm", (4, 3, 6), \
        lambda x, w, b: dispatch.add_norm(x, _residual(x.shape, x.dtype), w, b, 1e-5, rms=False)[0], \
        lambda x, w, b: TF.layer_norm(x + _residual(x.shape, x.dtype), (6,), w, b, 1e-5), 6
    yield "add_rms_norm", (4, 3, 6), \
        lambda x, w, b: dispatch.add_norm(x, _residual(x.shape, x.dtype), w, None, 1e-5, rms=True)[0], \
        lambda x, w, b: TF.rms_norm(x + _residual(x.shape, x.dtype), (6,), w, 1e-5), 6
    stats = (torch.linspace(-1, 1, 6), torch.linspace(0.5, 2, 6))
    yield "batch_norm_eval", (4, 6, 3, 2), \
        lambda x, w, b: dispatch.batch_norm(x, *(t.to(x.dtype) for t in stats), w, b, False, 0.1, 1e-5), \
        lambda x, w, b: TF.batch_norm(x, *(t.to(x.dtype) for t in stats), w, b, False, 0.1, 1e-5), 6


CASES = {name: rest for name, *rest in _cases()}


NO_BIAS = ("rms_norm", "add_rms_norm")


# float32 on every torch release of the matrix; float64 and 16 bits with the pin (the layouts' handling is
# normlib's own and the same whatever the dtype; what a release changes, float32 shows)
DTYPES = [torch.float32, pytest.param(torch.float64, marks=pytest.mark.pin)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p or "route")
@pytest.mark.parametrize("op", list(CASES))
def test_every_layout_computes_what_torch_computes(op, path, dtype):
    shape, ours, theirs, n = CASES[op]
    x0, w0, b0 = _values(shape, n, dtype)
    failures = []
    for (xname, fx), (wname, fw), (bname, fb) in itertools.product(
            _input_layouts(shape).items(), PARAM_LAYOUTS.items(), PARAM_LAYOUTS.items()):
        if op in NO_BIAS and bname != "contiguous":
            continue  # no bias
        x, w, b = fx(x0), fw(w0), fb(b0)
        want = theirs(x.contiguous(), w.contiguous(), b.contiguous())
        with ops.force_path(path) if path else _nothing():
            got = ours(x, w, b)
        if got.shape != want.shape or got.dtype != dtype or not torch.allclose(got, want, **close(dtype)):
            err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
            failures.append(f"input {xname}, weight {wname}, bias {bname}: off by {err} ({got.dtype})")
    assert not failures, f"{op} on path {path or 'route'} in {dtype}:\n" + "\n".join(failures)


@pytest.mark.pin
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p or "route")
@pytest.mark.parametrize("op", list(CASES))
def test_every_input_layout_in_16_bits(op, path, dtype):
    """16-bit input in every layout (γ and β contiguous and strided): within two roundings of float64 on the
    same stored values, as torch's own result is (torch's CPU BatchNorm keeps 16-bit statistics, so the
    yardstick is float64, not torch in 16 bits)."""
    shape, ours, theirs, n = CASES[op]
    x0, w0, b0 = _values(shape, n, dtype)
    failures = []
    for (xname, fx), (wname, fw) in itertools.product(_input_layouts(shape).items(),
                                                      [(k, PARAM_LAYOUTS[k]) for k in ("contiguous", "strided")]):
        x, w, b = fx(x0), fw(w0), fw(b0)
        want = theirs(x.contiguous().double(), w.double(), b.double())
        with ops.force_path(path) if path else _nothing():
            got = ours(x, w, b)
        tol = close(dtype, roundings=2, n=x.numel())
        if got.shape != want.shape or got.dtype != dtype or not torch.allclose(got.double(), want, **tol):
            err = (got.double() - want).abs().max().item() if got.shape == want.shape else "shape"
            failures.append(f"input {xname}, weight and bias {wname}: off by {err} ({got.dtype})")
    assert not failures, f"{op} on path {path or 'route'} in {dtype}:\n" + "\n".join(failures)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p or "route")
@pytest.mark.parametrize("op", [op for op in CASES if op != "batch_norm_eval"])
def test_every_layout_has_torchs_gradients(op, path, dtype):
    shape, ours, theirs, n = CASES[op]
    values = _values(shape, n, dtype)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    failures = []
    for (xname, fx), (wname, fw) in itertools.product(_input_layouts(shape).items(), PARAM_LAYOUTS.items()):
        grads = []
        for fn, prep, ctx in ((ours, lambda t: t, ops.force_path(path) if path else _nothing()),
                              (theirs, lambda t: t.contiguous(), _nothing())):
            x0, w0, b0 = (v.clone().requires_grad_() for v in values)
            with ctx:
                y = fn(prep(fx(x0)), prep(fw(w0)), prep(PARAM_LAYOUTS["strided"](b0)))
            y.backward(dy)
            grads.append((x0.grad, w0.grad, b0.grad))
        for name, a, e in zip(("input", "weight", "bias"), *grads):
            if e is None and a is None:
                continue
            if a is None or e is None or not torch.allclose(a, e, **close(dtype, kappa=4)):
                err = "missing" if a is None or e is None else (a - e).abs().max().item()
                failures.append(f"input {xname}, weight {wname}: d{name} off by {err}")
    assert not failures, f"{op} on path {path or 'route'} in {dtype}:\n" + "\n".join(failures)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
