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

import functools
import os
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from ..numerics import acc_dtype
from .rounding import TORCH, Rounding
from ..errors import NormValueError


@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


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
    M,  # number of rows
    N,  # number of columns
    eps,
    IS_RMS: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC_FP64: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program: a (ROWS, BLOCK_N) tile
    W_PLUS_ONE: tl.constexpr = False,  # scale by 1 + γ (Gemma) instead of γ
    ROUND_XHAT: tl.constexpr = 0,  # round x̂ before scaling: 0 no, 1 to X's dtype (Llama), 2 to W's (T5)
    ROUND_PRODUCT: tl.constexpr = False,  # round γ · x̂ to X's dtype before + β (DeBERTa, γ in X's 16-bit dtype)
):
    acc_dtype = tl.float64 if ACC_FP64 else tl.float32
    # int64 offsets: M * N may exceed 2**31
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < N)[None, :]  # (ROWS, BLOCK_N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(acc_dtype)
    if HAS_RES:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        s = (x + r.to(acc_dtype)).to(r.dtype)  # round the sum to the residual's dtype ...
        tl.store(RES_OUT + rows[:, None] * stride_ro + cols[None, :], s, mask=mask)
        x = s.to(acc_dtype)  # ... and normalize exactly the value that was stored
    if IS_RMS:
        xc = x
    else:
        # Two passes over registers, shifted by the row's first element x0 so
        # that rows far from zero keep their digits (and constant rows give xc = 0).
        # x0 is loaded on its own (a cached load, not a reduction), and rounded
        # exactly as the stored residual sum was.
        x0 = tl.load(X + rows * stride_x, mask=row_ok, other=0.0).to(acc_dtype)  # (ROWS,)
        if HAS_RES:
            r0 = tl.load(R + rows * stride_r, mask=row_ok, other=0.0)
            x0 = (x0 + r0.to(acc_dtype)).to(r0.dtype).to(acc_dtype)
        d = tl.where(mask, x - x0[:, None], 0.0)
        mean_d = tl.sum(d, axis=1) / N  # (ROWS,)
        xc = tl.where(mask, d - mean_d[:, None], 0.0)  # masked lanes must not enter the variance
        tl.store(MEAN + rows, mean_d, mask=row_ok)
    var = tl.sum(xc * xc, axis=1) / N  # (ROWS,)
    rstd = 1.0 / tl.sqrt(var + eps)
    # A row whose squares overflow (|x| beyond ~1.8e19 in fp32) has var = inf and would
    # normalize to exactly 0, a plausible wrong answer: make it NaN instead (one select per row).
    rstd = tl.where(var == float("inf"), float("nan"), rstd)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    y = xc * rstd[:, None]
    if ROUND_XHAT == 1:
        y = y.to(X.dtype.element_ty).to(acc_dtype)
    if ROUND_XHAT == 2:
        y = y.to(W.dtype.element_ty).to(acc_dtype)
    if HAS_W:
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(acc_dtype)
        if W_PLUS_ONE:
            w = w + 1.0
        y = y * w[None, :]
        if ROUND_PRODUCT:
            y = y.to(X.dtype.element_ty).to(acc_dtype)
    if HAS_B:
        y = y + tl.load(B + cols, mask=cols < N, other=0.0).to(acc_dtype)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    X,  # (M, N) the normalized input: x, or residual_out when a residual was added
    W,  # (N,) weight γ (unused unless HAS_W)
    DY,  # (M, N) gradient of y, row stride stride_dy
    DRES,  # (M, N) gradient of residual_out (unused unless HAS_DRES)
    DX,  # (M, N) output: gradient of x (and of the residual)
    DRES_IN,  # (M, N) output: gradient of the residual, in its dtype (if SPLIT_DRES)
    PARTS,  # (2, P, N) fp32/fp64 partial sums, a row per program: [0] of dweight, [1] of dbias
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
    ROWS: tl.constexpr,  # rows per loop iteration: a (ROWS, BLOCK_N) tile
    NUM_STAGES: tl.constexpr,  # software-pipelining depth of the row loop
    W_PLUS_ONE: tl.constexpr = False,  # the forward scaled by 1 + γ
    ROUND_XHAT: tl.constexpr = 0,  # the forward rounded x̂ (1: to X's input dtype XDT, 2: to W's dtype)
    XDT: tl.constexpr = tl.float32,  # the forward input's dtype, for ROUND_XHAT == 1 (X holds residual_out or x)
):
    acc_dtype = tl.float64 if ACC_FP64 else tl.float32
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    col_ok = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(acc_dtype)[None, :]  # (1, BLOCK_N)
        if W_PLUS_ONE:
            w = w + 1.0
    dw = tl.zeros((ROWS, BLOCK_N), dtype=acc_dtype)
    db = tl.zeros((ROWS, BLOCK_N), dtype=acc_dtype)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row0 in tl.range(row_start, row_end, ROWS, num_stages=NUM_STAGES):
        rows = row0 + tl.arange(0, ROWS)  # (ROWS,)
        row_ok = rows < row_end
        mask = row_ok[:, None] & col_ok[None, :]  # (ROWS, BLOCK_N)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(acc_dtype)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(acc_dtype)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)[:, None]  # (ROWS, 1)
        if IS_RMS:
            xhat = x * rstd
        else:
            x0 = tl.load(X + rows * stride_x, mask=row_ok, other=0.0).to(acc_dtype)[:, None]
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)[:, None]
            xhat = tl.where(mask, ((x - x0) - mean) * rstd, 0.0)
        if HAS_W:
            wdy = w * dy  # ĝ = γ ⊙ dy
            if ROUND_XHAT == 1:
                dw += dy * xhat.to(XDT).to(acc_dtype)  # γ multiplied the rounded x̂
            elif ROUND_XHAT == 2:
                dw += dy * xhat.to(W.dtype.element_ty).to(acc_dtype)
            else:
                dw += dy * xhat
        else:
            wdy = dy
        if HAS_B:
            db += dy
        # the chapter's c₁ = mean(ĝ) and c₂ = mean(ĝ ⊙ x̂): dx = rstd · (ĝ − c₁ − x̂ c₂), RMSNorm without c₁
        if IS_RMS:
            c2 = (tl.sum(xhat * wdy, axis=1) / N)[:, None]  # mean(ĝ ⊙ x̂)
            dx = (wdy - xhat * c2) * rstd
        else:
            # both row sums in one reduction (one exchange between warps, not two)
            s2, s1 = tl.reduce((xhat * wdy, wdy), 1, _add_pair)
            c2 = (s2 / N)[:, None]  # mean(ĝ ⊙ x̂)
            c1 = (s1 / N)[:, None]  # mean(ĝ)
            dx = (wdy - (xhat * c2 + c1)) * rstd
        if HAS_DRES:
            dres = tl.load(DRES + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0)
            dx += dres.to(acc_dtype)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if SPLIT_DRES:
            dres_in = dx.to(DRES_IN.dtype.element_ty)
            tl.store(DRES_IN + rows[:, None] * stride_dres_in + cols[None, :], dres_in, mask=mask)
    if HAS_W:
        tl.store(PARTS + pid * N + cols, tl.sum(dw, axis=0), mask=col_ok)
    if HAS_B:
        tl.store(PARTS + (tl.num_programs(0) + pid) * N + cols, tl.sum(db, axis=0), mask=col_ok)


@triton.jit
def _col_sum_kernel(
    PARTS,  # (2, P, N) fp32/fp64 partial sums: [0] of dweight, [1] of dbias
    DW,  # (N,) dweight, in the weight's dtype (unused unless HAS_W)
    DB,  # (N,) dbias, in the bias's dtype (unused unless HAS_B)
    P,
    N,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC_FP64: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Add the backward pass's per-program partial sums column by column, always in the same order."""
    acc_dtype = tl.float64 if ACC_FP64 else tl.float32
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # (BLOCK_C,)
    col_ok = cols < N
    dw = tl.zeros((BLOCK_C,), dtype=acc_dtype)
    db = tl.zeros((BLOCK_C,), dtype=acc_dtype)
    for p0 in range(0, P, BLOCK_P):
        progs = p0 + tl.arange(0, BLOCK_P)  # (BLOCK_P,)
        mask = (progs < P)[:, None] & col_ok[None, :]  # (BLOCK_P, BLOCK_C)
        offs = progs[:, None] * N + cols[None, :]  # (BLOCK_P, BLOCK_C)
        if HAS_W:
            dw += tl.sum(tl.load(PARTS + offs, mask=mask, other=0.0), axis=0)
        if HAS_B:
            db += tl.sum(tl.load(PARTS + P * N + offs, mask=mask, other=0.0), axis=0)
    if HAS_W:
        tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=col_ok)
    if HAS_B:
        tl.store(DB + cols, db.to(DB.dtype.element_ty), mask=col_ok)


def _block_n(N: int) -> int:
    return 1 << max(N - 1, 0).bit_length()  # the next power of two


@functools.lru_cache(maxsize=None)
def _fwd_default(N: int, element_size: int) -> tuple[int, int, int]:
    block_n = _block_n(N)
    # One warp per KiB of row, 4 to 16 warps (32 for 64 KiB rows, which spill anyway).
    num_warps = min(16, max(4, block_n * element_size // 1024)) if block_n < 32768 else 32
    rows = 4 if block_n <= 1024 else 1  # short rows: four per program
    return block_n, num_warps, rows


@functools.lru_cache(maxsize=None)
def _bwd_default(N: int, element_size: int, is_rms: bool) -> tuple[int, int, int, int, int]:
    block_n = _block_n(N)
    # Register pressure follows the fp32 lanes each thread holds (x, dy, w and
    # two accumulators), so the warps scale with BLOCK_N: eight lanes per thread.
    # At 16384 lanes 16 warps ran faster than 32 on an H100 (1.43 vs 1.17 TB/s) although
    # they spill more; 32768 lanes were not measured, and 16 warps would spill 14.5 KB
    # per thread there against 3.6 KB with 32, so they keep 32.
    num_warps = min(max(block_n // 256, 1), 16 if block_n == 16384 else 32)
    # Programs per SM (each walks a band of rows) and rows per loop iteration.
    programs_per_sm, rows = {1: (4, 2), 2: (4, 1), 4: (2, 1), 8: (1, 1)}.get(min(block_n // 1024, 8) or 1, (2, 1))
    if block_n > 8192:
        programs_per_sm = 2
    # RMSNorm's loop has one reduction per row: pipelining its loads paid at 4096 and 8192
    # half-precision lanes (measured). The stages live in shared memory: 3 stages of 16384
    # lanes, or of 8192 float32 lanes, exceed an H100's 227 KiB (ptxas refuses to launch).
    num_stages = 3 if is_rms and block_n in (4096, 8192) and element_size <= 2 else 1
    return block_n, num_warps, rows, programs_per_sm, num_stages


def fwd_config(N: int, element_size: int, *, num_warps: Optional[int] = None, rows: Optional[int] = None) -> dict:
    """The forward launch for rows of ``N`` elements of ``element_size`` bytes.

    Returns ``block_n`` (the row padded to a power of two, held in registers),
    ``num_warps`` and ``rows`` (rows per program). The defaults come from
    timing the variants on an H100 (``python -m normlib.benchmark.tune``, CUDA-graph
    replays): one warp per KiB of row, between 4 and 16 (32 warps at 16384
    bf16 lanes ran at 0.6x of copy bandwidth where 16 ran at 0.94x), and four
    rows per program for rows of up to 1024 lanes. Keyword arguments override them.
    """
    block_n, warps, r = _fwd_default(N, element_size)
    return dict(block_n=block_n, num_warps=num_warps or warps, rows=rows or r)


def bwd_config(
    N: int,
    element_size: int,
    is_rms: bool = False,
    *,
    num_warps: Optional[int] = None,
    rows: Optional[int] = None,
    programs_per_sm: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> dict:
    """The backward launch: ``block_n``, ``num_warps``, ``rows`` per loop iteration, programs per SM, pipelining.

    Each program walks a band of rows, so the number of programs sets how many
    rows are in flight. Measured best on an H100 (``python -m normlib.benchmark.tune``):
    4 programs per SM with two rows per iteration up to 1024 lanes, 4 at 2048,
    2 at 4096, 1 at 8192, 2 beyond; three pipeline stages for RMSNorm from
    4096 lanes on. With eight lanes per thread ptxas reports no register
    spills up to N = 8192 (``tests/test_kernels_compile.py``); wider rows
    spill. Keyword arguments override.
    """
    block_n, warps, r, pps, stages = _bwd_default(N, element_size, is_rms)
    return dict(
        block_n=block_n,
        num_warps=num_warps or warps,
        rows=rows or r,
        programs_per_sm=programs_per_sm or pps,
        num_stages=num_stages or stages,
    )


def row_stride(t: torch.Tensor, N: int) -> Optional[int]:
    """Distance in elements between consecutive rows of ``t`` seen as ``(numel // N, N)``.

    ``None`` when the rows are not evenly spaced with unit column stride (the
    caller then makes a contiguous copy). No view is created: the kernels
    take the tensor's data pointer and this stride.
    """
    if t.is_contiguous():
        return N
    if t.stride(-1) != 1 and t.shape[-1] != 1:
        return None
    shape, strides = t.shape, t.stride()
    rs = expect = None
    for d in range(t.dim() - 2, -1, -1):
        if shape[d] == 1:
            continue
        if rs is None:
            rs = strides[d]
        elif strides[d] != expect:
            return None
        expect = strides[d] * shape[d]
    return N if rs is None else rs


def _tl_dtype(dtype: torch.dtype):
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
            torch.float64: tl.float64}[dtype]


@functools.lru_cache(maxsize=1024)
def _fwd_spec(N: int, x_dtype: torch.dtype, w_dtype: Optional[torch.dtype], b_dtype: Optional[torch.dtype],
              rounding: Rounding) -> tuple[torch.dtype, torch.dtype, dict, bool]:
    """``(accumulation dtype, output dtype, launch config, round γ·x̂ apart)`` of a forward: what a call's
    dtypes and row size decide, worked out once per combination (a cached hit costs no Python frame)."""
    element_size = x_dtype.itemsize
    w = None if w_dtype is None else torch.empty((0,), dtype=w_dtype)
    b = None if b_dtype is None else torch.empty((0,), dtype=b_dtype)
    acc = acc_dtype(x_dtype)
    product = rounding.product_dtype(x_dtype, w)
    # the kernel rounds γ · x̂ to X's dtype: the product's dtype is either that or the accumulation dtype
    if product is not None and product not in (x_dtype, acc):
        raise NormValueError(f"the kernels cannot round γ · x̂ to {product} (input {x_dtype}, γ {w_dtype})")
    return acc, rounding.out_dtype(x_dtype, w, b), fwd_config(N, element_size), product is not None and product != acc


def norm_fwd(x, residual, weight, bias, eps, is_rms, *, config: Optional[dict] = None, strides=None,
             rounding: Rounding = TORCH):
    """Launch the forward kernel on ``x`` normalized over its last dimension (size ``N``).

    ``x`` and ``residual`` may have any number of dimensions as long as their
    rows are evenly spaced (``strides``: their row strides, from
    :func:`row_stride`; computed here when not given). Returns
    ``(y, residual_out, mean, rstd)`` with ``y`` and ``residual_out`` contiguous
    in ``x``'s shape, ``mean``/``rstd`` of shape ``(M,)``; ``residual_out`` is
    ``None`` without a residual, ``mean`` is ``None`` for RMSNorm. ``config``
    overrides the launch heuristic (keys ``num_warps``, ``rows``), for tuning.
    ``rounding`` reproduces another library's rounding order (see
    :mod:`normlib.ops.rounding`); it also decides ``y``'s dtype.
    """
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    if strides is None:
        strides = (row_stride(x, N), row_stride(residual, N) if residual is not None else 0)
    sx, sr = strides
    acc, out_dtype, cfg, round_product = _fwd_spec(N, x.dtype, None if weight is None else weight.dtype,
                                                   None if bias is None else bias.dtype, rounding)
    if config:
        cfg = fwd_config(N, x.element_size(), **config)
    device = x.device
    y = torch.empty(x.shape, dtype=out_dtype, device=device)
    rstd = torch.empty((M,), dtype=acc, device=device)
    mean = None if is_rms else torch.empty((M,), dtype=acc, device=device)
    res_out = None
    if residual is not None:
        res_out = torch.empty(x.shape, dtype=residual.dtype, device=device)
    if M == 0:
        return y, res_out, mean, rstd
    # An argument the kernel's flags say it never touches gets a stand-in pointer.
    _norm_fwd_kernel[(-(-M // cfg["rows"]),)](  # cdiv, without a Python frame
        x,
        residual if residual is not None else x,
        weight if weight is not None else x,
        bias if bias is not None else x,
        y,
        res_out if res_out is not None else y,
        mean if mean is not None else rstd,
        rstd,
        sx,
        sr,
        N,
        N,
        M,
        N,
        eps,
        IS_RMS=is_rms,
        HAS_RES=residual is not None,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        ACC_FP64=acc == torch.float64,
        BLOCK_N=cfg["block_n"],
        ROWS=cfg["rows"],
        W_PLUS_ONE=rounding.weight_plus_one,
        ROUND_XHAT=rounding.xhat_code,
        ROUND_PRODUCT=round_product,
        num_warps=cfg["num_warps"],
    )
    return y, res_out, mean, rstd


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one at a time


@functools.lru_cache(maxsize=1024)
def _bwd_spec(N: int, dtype: torch.dtype, x_dtype: torch.dtype, is_rms: bool, rounding: Rounding,
              device: torch.device) -> tuple:
    """``(accumulation dtype, the kernel's XDT, launch config, SM count)`` of a backward, worked out once per
    combination (a cached hit costs no Python frame)."""
    element_size = dtype.itemsize
    xdt = _tl_dtype(x_dtype) if rounding.xhat == "input" else tl.float32
    return acc_dtype(dtype), xdt, bwd_config(N, element_size, is_rms), _sm_count(device)


def norm_bwd(dy, dres, x, weight, bias_dtype, mean, rstd, is_rms, x_dtype, residual_dtype, *,
             config: Optional[dict] = None, strides=None, rounding: Rounding = TORCH):
    """Launch the backward kernel.

    ``x`` is the normalized input (``residual_out`` when a residual was added);
    ``dres`` the gradient of ``residual_out`` or ``None``; ``strides`` the row
    strides of ``x``, ``dy`` and ``dres`` (computed when not given). Returns
    ``(dx, dresidual, dweight, dbias)``, the first two contiguous in ``x``'s
    shape; ``dresidual`` is ``None`` without a residual. It holds the same
    values as ``dx`` but is always its own tensor, written by the same kernel:
    handing autograd one tensor as the gradient of two inputs lets their
    ``.grad`` fields alias, and a later accumulation into one would silently
    change the other. ``rounding`` is the forward's (see :func:`norm_fwd`).
    ``config`` overrides the launch heuristic (keys
    ``num_warps``, ``rows``, ``programs_per_sm``, ``num_stages``).
    """
    N = x.shape[-1]
    M = x.numel() // N if N else 0
    if strides is None:
        strides = (row_stride(x, N), row_stride(dy, N), row_stride(dres, N) if dres is not None else 0)
    sx, sdy, sdres = strides
    acc, xdt, cfg, sm_count = _bwd_spec(N, x.dtype, x_dtype, is_rms, rounding, x.device)
    if config:
        cfg = bwd_config(N, x.element_size(), is_rms, **config)
    dx = torch.empty(x.shape, dtype=x_dtype, device=x.device)
    split = residual_dtype is not None
    dres_in = torch.empty(x.shape, dtype=residual_dtype, device=x.device) if split else None
    P = max(1, min(-(-M // cfg["rows"]), cfg["programs_per_sm"] * sm_count))
    has_bias = bias_dtype is not None
    # one buffer for both partial sums: (2, P, N), dweight's in [0], dbias's in [1]
    parts = torch.empty((2, P, N), dtype=acc, device=x.device) if (weight is not None or has_bias) else None
    if M > 0:
        rows_per_program = -(-M // P)
        _norm_bwd_kernel[(P,)](
            x,
            weight if weight is not None else x,
            dy,
            dres if dres is not None else dy,
            dx,
            dres_in if dres_in is not None else dx,
            parts if parts is not None else rstd,
            mean if mean is not None else rstd,
            rstd,
            sx,
            sdy,
            sdres,
            N,
            N,
            M,
            N,
            rows_per_program,
            IS_RMS=is_rms,
            HAS_W=weight is not None,
            HAS_B=has_bias,
            HAS_DRES=dres is not None,
            SPLIT_DRES=split,
            ACC_FP64=acc == torch.float64,
            BLOCK_N=cfg["block_n"],
            ROWS=cfg["rows"],
            NUM_STAGES=cfg["num_stages"],
            W_PLUS_ONE=rounding.weight_plus_one,
            ROUND_XHAT=rounding.xhat_code,
            XDT=xdt,
            num_warps=cfg["num_warps"],
        )
    dweight = torch.empty((N,), dtype=weight.dtype, device=x.device) if weight is not None else None
    dbias = torch.empty((N,), dtype=bias_dtype, device=x.device) if has_bias else None
    if parts is not None:
        if M == 0:
            for g in (dweight, dbias):
                if g is not None:
                    g.zero_()
        else:
            # Partial sums reduced in a fixed order: deterministic, no atomics.
            _col_sum_kernel[(-(-N // _COL_BLOCK),)](
                parts,
                dweight if dweight is not None else rstd,
                dbias if dbias is not None else rstd,
                P,
                N,
                HAS_W=dweight is not None,
                HAS_B=dbias is not None,
                ACC_FP64=acc == torch.float64,
                BLOCK_P=32,
                BLOCK_C=_COL_BLOCK,
                num_warps=4,
            )
    return dx, dres_in, dweight, dbias


# Columns per program of the partial-sum reduction: small, so that even
# N = 1024 gives 32 programs (with 256 it gave 4, and the reduction of many
# partial sums took longer than the backward kernel itself).
_COL_BLOCK = 32


class _Serialised:
    """A kernel whose launches hold one lock: Triton's interpreter (``TRITON_INTERPRET=1``, which runs the
    kernels on CPU tensors) keeps global state and is not thread-safe, so two threads launching at once
    crash each other. Compiled kernels are left as they are (no lock, no extra call on a GPU)."""

    _lock = threading.Lock()

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def locked(*args, **kwargs):
            with self._lock:
                return launch(*args, **kwargs)

        return locked


if os.environ.get("TRITON_INTERPRET") == "1":  # read when Triton is imported, as Triton itself reads it
    _norm_fwd_kernel = _Serialised(_norm_fwd_kernel)
    _norm_bwd_kernel = _Serialised(_norm_bwd_kernel)
    _col_sum_kernel = _Serialised(_col_sum_kernel)
