"""Triton kernels for LayerNorm / RMSNorm with an optional fused residual add.

Three tiers, as in the rest of normlib's fused path:

* ``_norm_fwd_kernel`` / ``_norm_bwd_kernel`` — the ``@triton.jit`` kernels;
* ``norm_fwd`` / ``norm_bwd`` — launchers that check layouts and pick block sizes;
* ``normlib.ops._functions`` — the ``torch.autograd.Function`` wrappers.

One program normalizes one row in the forward pass: the row is loaded once,
its statistics are computed in fp32 (fp64 for fp64 input), and ``y`` (and, with
a residual, ``residual_out = x + residual``) are written once. The backward
pass gives each program a contiguous band of rows: it writes ``dx`` row by row
and accumulates ``dweight``/``dbias`` for its band in fp32 registers, storing
one partial sum per program; the launcher adds those partial sums in a fixed
order. No atomics, no locks: gradients are bitwise reproducible.

This module imports Triton; import it only through :mod:`normlib.ops`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest row handled in one pass: 64 KiB of input per row.
MAX_ROW_BYTES = 64 * 1024


@triton.jit
def _norm_fwd_kernel(
    X,  # (M, N) input rows, row stride stride_x
    R,  # (M, N) residual to add to X (unused unless HAS_RES)
    W,  # (N,) weight γ (unused unless HAS_W)
    B,  # (N,) bias β (unused unless HAS_B)
    Y,  # (M, N) output, row stride stride_y
    RES_OUT,  # (M, N) x + residual, in the residual's dtype (unused unless HAS_RES)
    MEAN,  # (M,) fp32/fp64 row mean minus the row's first element (unused when IS_RMS)
    RSTD,  # (M,) fp32/fp64 reciprocal standard deviation (or RMS) of each row
    stride_x,
    stride_r,
    stride_y,
    stride_ro,
    N,  # number of columns
    eps,
    IS_RMS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC_FP64: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    acc_dtype = tl.float64 if ACC_FP64 else tl.float32
    row = tl.program_id(0).to(tl.int64)  # int64 offsets: M * N may exceed 2**31
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(acc_dtype)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        s = (x + r.to(acc_dtype)).to(r.dtype)  # round the sum to the residual's dtype ...
        tl.store(RES_OUT + row * stride_ro + cols, s, mask=mask)
        x = s.to(acc_dtype)  # ... and normalize exactly the value that was stored
    if IS_RMS:
        xc = x
    else:
        # Two passes over registers, shifted by the row's first element x0 so
        # that rows far from zero keep their digits (and constant rows give xc = 0).
        x0 = tl.sum(tl.where(cols == 0, x, 0.0), axis=0)
        d = tl.where(mask, x - x0, 0.0)
        mean_d = tl.sum(d, axis=0) / N
        xc = tl.where(mask, d - mean_d, 0.0)  # masked lanes must not enter the variance
        tl.store(MEAN + row, mean_d)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = 1.0 / tl.sqrt(var + eps)
    tl.store(RSTD + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(acc_dtype)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(acc_dtype)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    X,  # (M, N) the normalized input: x, or residual_out when a residual was added
    W,  # (N,) weight γ (unused unless HAS_W)
    DY,  # (M, N) gradient of y, row stride stride_dy
    DRES,  # (M, N) gradient of residual_out (unused unless HAS_DRES)
    DX,  # (M, N) output: gradient of x (and of the residual)
    DRES_IN,  # (M, N) output: gradient of the residual, in its dtype (if SPLIT_DRES)
    DW,  # (P, N) fp32/fp64 partial sums of dweight, a row per program (if HAS_W)
    DB,  # (P, N) fp32/fp64 partial sums of dbias, a row per program (if HAS_B)
    MEAN,  # (M,) row mean minus the row's first element (unused when IS_RMS)
    RSTD,  # (M,) reciprocal standard deviations
    stride_x,
    stride_dy,
    stride_dres,
    stride_dx,
    stride_dres_in,
    M,
    N,
    rows_per_program,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_DRES: tl.constexpr,
    SPLIT_DRES: tl.constexpr,
    ACC_FP64: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    acc_dtype = tl.float64 if ACC_FP64 else tl.float32
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(acc_dtype)
    dw = tl.zeros((BLOCK_N,), dtype=acc_dtype)
    db = tl.zeros((BLOCK_N,), dtype=acc_dtype)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(acc_dtype)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(acc_dtype)
        rstd = tl.load(RSTD + row)
        if IS_RMS:
            xhat = x * rstd
        else:
            x0 = tl.sum(tl.where(cols == 0, x, 0.0), axis=0)
            xhat = tl.where(mask, ((x - x0) - tl.load(MEAN + row)) * rstd, 0.0)
        if HAS_W:
            wdy = w * dy
            dw += dy * xhat
        else:
            wdy = dy
        if HAS_B:
            db += dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        if IS_RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_DRES:
            dres = tl.load(DRES + row * stride_dres + cols, mask=mask, other=0.0)
            dx += dres.to(acc_dtype)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if SPLIT_DRES:
            dres_in = dx.to(DRES_IN.dtype.element_ty)
            tl.store(DRES_IN + row * stride_dres_in + cols, dres_in, mask=mask)
    if HAS_W:
        tl.store(DW + pid * N + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB + pid * N + cols, db, mask=mask)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _launch_config(N: int) -> tuple[int, int]:
    """BLOCK_N covers the row in one pass; one warp per 256 lanes, at most 32 warps.

    Register pressure follows the number of lanes each thread holds (the
    statistics and gradients are fp32 whatever the input dtype), so the warps
    scale with BLOCK_N, not with bytes: eight lanes per thread up to
    BLOCK_N = 8192. With that, ptxas reports no register spills for either
    kernel on sm_90 up to N = 8192; wider rows spill some (the backward pass
    keeps x, dy, w and two accumulators live — more than the register file holds).
    ``tests/test_kernels_compile.py`` checks this.
    """
    block_n = triton.next_power_of_2(max(N, 1))
    num_warps = min(max(block_n // 256, 1), 32)
    return block_n, num_warps


def _or(t, stand_in):
    """``t``, or a stand-in pointer for an argument the kernel's flags say it never touches."""
    return t if t is not None else stand_in


def _stride0(t) -> int:
    return t.stride(0) if t is not None else 0


def norm_fwd(x, residual, weight, bias, eps, is_rms):
    """Launch the forward kernel on 2-D ``x`` (M, N) with unit column stride.

    Returns ``(y, residual_out, mean, rstd)``; ``residual_out`` is ``None``
    without a residual, ``mean`` is ``None`` for RMSNorm.
    """
    M, N = x.shape
    acc = _acc_dtype(x.dtype)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    rstd = torch.empty((M,), dtype=acc, device=x.device)
    mean = None if is_rms else torch.empty((M,), dtype=acc, device=x.device)
    res_out = None
    if residual is not None:
        res_out = torch.empty((M, N), dtype=residual.dtype, device=x.device)
    if M == 0:
        return y, res_out, mean, rstd
    block_n, num_warps = _launch_config(N)
    _norm_fwd_kernel[(M,)](
        x,
        _or(residual, x),
        _or(weight, x),
        _or(bias, x),
        y,
        _or(res_out, y),
        _or(mean, rstd),
        rstd,
        x.stride(0),
        _stride0(residual),
        y.stride(0),
        _stride0(res_out),
        N,
        eps,
        IS_RMS=is_rms,
        HAS_RES=residual is not None,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        ACC_FP64=acc == torch.float64,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return y, res_out, mean, rstd


def _num_programs(M: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(M, 4 * sms))
    return max(1, min(M, 4))  # the interpreter runs programs one at a time


def norm_bwd(dy, dres, x, weight, bias_dtype, mean, rstd, is_rms, x_dtype, residual_dtype):
    """Launch the backward kernel.

    ``x`` is the normalized input (``residual_out`` when a residual was added);
    ``dres`` the gradient of ``residual_out`` or ``None``. Returns
    ``(dx, dresidual, dweight, dbias)``; ``dresidual`` is ``None`` without a
    residual. It holds the same values as ``dx`` but is always its own tensor,
    written by the same kernel: handing autograd one tensor as the gradient of
    two inputs lets their ``.grad`` fields alias, and a later accumulation into
    one would silently change the other.
    """
    M, N = x.shape
    acc = _acc_dtype(x.dtype)
    dx = torch.empty((M, N), dtype=x_dtype, device=x.device)
    split = residual_dtype is not None
    dres_in = torch.empty((M, N), dtype=residual_dtype, device=x.device) if split else None
    P = _num_programs(M, x.device)
    dw_part = torch.empty((P, N), dtype=acc, device=x.device) if weight is not None else None
    has_bias = bias_dtype is not None
    db_part = torch.empty((P, N), dtype=acc, device=x.device) if has_bias else None
    if M > 0:
        block_n, num_warps = _launch_config(N)
        rows_per_program = triton.cdiv(M, P)
        _norm_bwd_kernel[(P,)](
            x,
            _or(weight, x),
            dy,
            _or(dres, dy),
            dx,
            _or(dres_in, dx),
            _or(dw_part, rstd),
            _or(db_part, rstd),
            _or(mean, rstd),
            rstd,
            x.stride(0),
            dy.stride(0),
            _stride0(dres),
            dx.stride(0),
            _stride0(dres_in),
            M,
            N,
            rows_per_program,
            IS_RMS=is_rms,
            HAS_W=weight is not None,
            HAS_B=has_bias,
            HAS_DRES=dres is not None,
            SPLIT_DRES=split,
            ACC_FP64=acc == torch.float64,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    elif dw_part is not None or db_part is not None:
        for part in (dw_part, db_part):
            if part is not None:
                part.zero_()
    # Partial sums reduced in a fixed order: deterministic, no atomics.
    dweight = dw_part.sum(0).to(weight.dtype) if weight is not None else None
    dbias = db_part.sum(0).to(bias_dtype) if has_bias else None
    return dx, dres_in, dweight, dbias
