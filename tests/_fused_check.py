"""The fused ops checked against a float64 reference: shared by the interpreter and CUDA tests.

Every output and gradient is compared with a float64 reference computed from
the same, already rounded, inputs; the kernel's error may be no worse than
twice torch's own error in the same dtype plus a small atol.
"""

import torch
import torch.nn.functional as TF

from normlib import ops
from _helpers import assert_no_worse

ULP_RTOL = {torch.float32: 2**-22, torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float64: 2**-51}


def _torch_same_dtype(kind, x, residual, weight, bias, eps):
    """What plain PyTorch computes in the inputs' own dtypes (the error yardstick)."""
    N = x.shape[-1]
    if residual is not None:
        res_out = (x.to(residual.dtype) + residual) if residual.dtype != x.dtype else x + residual
        inp = res_out.to(x.dtype)
    else:
        res_out, inp = None, x
    w = weight.to(x.dtype) if weight is not None else None
    b = bias.to(x.dtype) if bias is not None else None
    y = TF.layer_norm(inp, (N,), w, b, eps) if kind == "layer" else TF.rms_norm(inp, (N,), w, eps)
    return y, res_out


def _ours(kind, x, residual, weight, bias, eps):
    if residual is None:
        y = ops.layer_norm(x, weight, bias, eps) if kind == "layer" else ops.rms_norm(x, weight, eps)
        return y, None
    if kind == "layer":
        return ops.add_layer_norm(x, residual, weight, bias, eps)
    return ops.add_rms_norm(x, residual, weight, eps)


def leaves(ts):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in ts]


def check(kind, x, residual=None, weight=None, bias=None, eps=1e-5, path="triton-interpreter"):
    """Forward and every gradient of the fused op against the float64 reference."""
    assert ops.path_for(x, residual) == path
    dtype = x.dtype
    ours_in = leaves([x, residual, weight, bias])
    torch_in = leaves([x, residual, weight, bias])
    ref_in = leaves([t.double() if t is not None else None for t in (x, residual, weight, bias)])

    y, res_out = _ours(kind, *ours_in, eps)
    y_t, res_t = _torch_same_dtype(kind, *torch_in, eps)
    # reference: the residual sum rounded to the residual's dtype, as the kernel defines it
    if residual is not None:
        res_exact = (ref_in[0] + ref_in[1]).to(residual.dtype).double()
        res_ref_leaf = ref_in[0] + ref_in[1]
        res_ref = res_ref_leaf + (res_exact - res_ref_leaf).detach()  # value rounded, gradient of the sum
    else:
        res_ref = ref_in[0]
    N = x.shape[-1]
    y_ref = TF.layer_norm(res_ref, (N,), ref_in[2], ref_in[3], eps) if kind == "layer" else TF.rms_norm(res_ref, (N,), ref_in[2], eps)

    assert y.dtype == dtype and y.shape == x.shape
    assert_no_worse(y, y_t, y_ref, dtype, "y")
    if residual is not None:
        assert res_out.dtype == residual.dtype and res_out.shape == x.shape
        torch.testing.assert_close(res_out.double(), res_exact, rtol=ULP_RTOL[residual.dtype], atol=1e-30)

    gy = torch.randn(y.shape, dtype=torch.float64, device=x.device)
    outs = [(y, y_t, y_ref, gy)]
    if residual is not None:
        gr = torch.randn(x.shape, dtype=torch.float64, device=x.device)
        outs.append((res_out, res_t, res_ref, gr))
    for a, b, r, g in outs:
        a.backward(g.to(a.dtype), retain_graph=True)
        b.backward(g.to(b.dtype), retain_graph=True)
        r.backward(g, retain_graph=True)
    names = ["x", "residual", "weight", "bias"]
    for name, a, b, r in zip(names, ours_in, torch_in, ref_in):
        if a is None:
            continue
        assert a.grad is not None and a.grad.dtype == a.dtype, name
        assert_no_worse(a.grad, b.grad, r.grad, dtype if name != "residual" else residual.dtype, f"grad of {name}")
