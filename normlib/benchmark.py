"""GB/s benchmark of the fused norms against torch eager, torch.compile and a plain copy.

Run on a machine with a CUDA GPU::

    python -m normlib.benchmark --out book/data/benchmark.json --plot book/data/benchmark.png

Each op is timed with ``triton.testing.do_bench`` (CUDA events, L2 flushed
between runs) and converted to GB/s from the bytes the op must move at least
(see :func:`bytes_moved`). A device-to-device copy of the same tensor is
timed too: its GB/s is the practical bandwidth ceiling the kernels are judged
against. The JSON records the device, driver, torch and Triton versions and
the date. Without a CUDA device the module says so and exits with status 2:
it never produces numbers it did not measure.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import subprocess
import sys
from typing import Callable, Iterable

import torch

OPS = ("layer_norm", "rms_norm", "add_rms_norm")
MODES = ("fwd", "fwd+bwd")
PROVIDERS = ("normlib", "torch", "torch.compile")
ROWS = (4096, 16384, 32768)
WIDTHS = (1024, 2048, 4096, 8192, 16384)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Tensors of M x N elements each op must read or write at least once.
_TENSOR_PASSES = {
    ("layer_norm", "fwd"): 2,  # read x, write y
    ("rms_norm", "fwd"): 2,
    ("add_rms_norm", "fwd"): 4,  # read x, residual; write y, residual_out
    ("layer_norm", "fwd+bwd"): 5,  # forward 2, backward: read x, dy; write dx
    ("rms_norm", "fwd+bwd"): 5,
    ("add_rms_norm", "fwd+bwd"): 9,  # forward 4, backward: read residual_out, dy, dresidual_out; write dx, dresidual
}


def bytes_moved(op: str, mode: str, M: int, N: int, element_size: int) -> int:
    """Minimum bytes an op moves: whole M x N passes; per-row statistics and the (N,) weights are ignored.

    Example:
        >>> bytes_moved("layer_norm", "fwd", 4096, 1024, 2)
        16777216
    """
    if mode == "copy":
        return 2 * M * N * element_size
    return _TENSOR_PASSES[(op, mode)] * M * N * element_size


def _eager(op: str) -> Callable:
    import torch.nn.functional as F

    if op == "layer_norm":
        return lambda x, r, w, b: F.layer_norm(x, x.shape[-1:], w, b)
    if op == "rms_norm":
        return lambda x, r, w, b: F.rms_norm(x, x.shape[-1:], w)

    def add_rms(x, r, w, b):
        res = x + r
        return F.rms_norm(res, x.shape[-1:], w), res

    return add_rms


def _normlib(op: str) -> Callable:
    from normlib import ops

    if op == "layer_norm":
        return lambda x, r, w, b: ops.layer_norm(x, w, b)
    if op == "rms_norm":
        return lambda x, r, w, b: ops.rms_norm(x, w)
    return lambda x, r, w, b: ops.add_rms_norm(x, r, w)


def _provider_fn(provider: str, op: str) -> Callable:
    if provider == "normlib":
        return _normlib(op)
    if provider == "torch":
        return _eager(op)
    if provider == "torch.compile":
        return torch.compile(_eager(op), dynamic=False)
    raise ValueError(f"unknown provider {provider!r}")


def _time_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure(op: str, mode: str, provider: str, M: int, N: int, dtype: torch.dtype) -> float:
    """Median milliseconds of one call (forward, or forward and backward together)."""
    dev = "cuda"
    x = torch.randn(M, N, device=dev, dtype=dtype)
    r = torch.randn(M, N, device=dev, dtype=dtype)
    w = torch.randn(N, device=dev, dtype=dtype)
    b = torch.randn(N, device=dev, dtype=dtype)
    fn = _provider_fn(provider, op)
    if mode == "fwd":
        with torch.no_grad():
            return _time_ms(lambda: fn(x, r, w, b))
    for t in (x, r, w, b):
        t.requires_grad_(True)
    dy = torch.randn(M, N, device=dev, dtype=dtype)

    def step():
        out = fn(x, r, w, b)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, (dy,) * len(outs))
        for t in (x, r, w, b):
            t.grad = None

    return _time_ms(step)


def copy_ms(M: int, N: int, dtype: torch.dtype) -> float:
    src = torch.randn(M, N, device="cuda", dtype=dtype)
    dst = torch.empty_like(src)
    return _time_ms(lambda: dst.copy_(src))


def environment() -> dict:
    import triton

    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        driver = "unknown"
    return {
        "device": torch.cuda.get_device_name(0),
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def run(dtypes: Iterable[str], rows=ROWS, widths=WIDTHS, ops=OPS, providers=PROVIDERS, log=print) -> dict:
    """Measure every (dtype, op, mode, provider, M, N); returns the JSON-ready record."""
    records = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        esize = torch.empty((), dtype=dtype).element_size()
        for M in rows:
            for N in widths:
                ms = copy_ms(M, N, dtype)
                gbps = bytes_moved("", "copy", M, N, esize) / ms / 1e6
                records.append(dict(op="copy", mode="copy", provider="copy", dtype=dname, M=M, N=N, ms=ms, gbps=gbps))
                log(f"{dname} M={M} N={N} copy {gbps:8.1f} GB/s")
                for op in ops:
                    for mode in MODES:
                        for provider in providers:
                            ms = measure(op, mode, provider, M, N, dtype)
                            gbps = bytes_moved(op, mode, M, N, esize) / ms / 1e6
                            records.append(dict(op=op, mode=mode, provider=provider, dtype=dname, M=M, N=N, ms=ms, gbps=gbps))
                            log(f"{dname} M={M} N={N} {op} {mode} {provider} {gbps:8.1f} GB/s")
    return {"environment": environment(), "bytes_model": {f"{k[0]} {k[1]}": v for k, v in _TENSOR_PASSES.items()}, "results": records}


def ratios(data: dict, dtype: str = "bf16") -> dict:
    """Summary ratios per (op, mode): median normlib/copy, min normlib/copy, and speed-ups.

    Speed-ups are medians over shapes of the time ratios ``t_provider / t_normlib``.
    """
    res = [r for r in data["results"] if r["dtype"] == dtype]
    copy = {(r["M"], r["N"]): r["gbps"] for r in res if r["provider"] == "copy"}
    by = {(r["op"], r["mode"], r["provider"], r["M"], r["N"]): r for r in res if r["provider"] != "copy"}
    out = {}
    for op, mode in sorted({(r["op"], r["mode"]) for r in res if r["provider"] == "normlib"}):
        shapes = sorted((M, N) for (o, m, p, M, N) in by if (o, m, p) == (op, mode, "normlib"))
        frac = [by[(op, mode, "normlib", M, N)]["gbps"] / copy[(M, N)] for M, N in shapes]
        big = [f for (M, N), f in zip(shapes, frac) if M * N >= 2**25]
        entry = {
            "median_of_copy_bandwidth_MN_ge_2^25": statistics.median(big) if big else None,
            "min_of_copy_bandwidth": min(frac),
        }
        for prov in ("torch", "torch.compile"):
            sp = [by[(op, mode, prov, M, N)]["ms"] / by[(op, mode, "normlib", M, N)]["ms"] for M, N in shapes if (op, mode, prov, M, N) in by]
            entry[f"speedup_vs_{prov}"] = statistics.median(sp) if sp else None
        out[f"{op} {mode}"] = entry
    return out


def plot(data: dict, path: str, dtype: str = "bf16", M: int = 16384) -> None:
    """GB/s against N at one M, one panel per (op, mode), copy bandwidth dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = [r for r in data["results"] if r["dtype"] == dtype and r["M"] == M]
    panels = sorted({(r["op"], r["mode"]) for r in res if r["provider"] != "copy"})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), sharey=True, squeeze=False)
    copy = sorted((r["N"], r["gbps"]) for r in res if r["provider"] == "copy")
    for ax, (op, mode) in zip(axes[0], panels):
        for prov in PROVIDERS:
            pts = sorted((r["N"], r["gbps"]) for r in res if (r["op"], r["mode"], r["provider"]) == (op, mode, prov))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=prov)
        ax.plot(*zip(*copy), "k--", label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op} {mode}", fontsize=9)
        ax.set_xlabel("N")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s")
    axes[0][-1].legend(frameon=False, fontsize=8)
    env = data["environment"]
    fig.suptitle(f"{dtype}, M={M}: {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normlib.benchmark", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    parser.add_argument("--out", default="benchmark.json", help="where to write the JSON record")
    parser.add_argument("--plot", default=None, help="also draw GB/s against N into this PNG")
    args = parser.parse_args(argv)
    from normlib import ops

    if not torch.cuda.is_available():
        print("normlib.benchmark: no CUDA GPU is available; it measures GPU memory bandwidth and "
              "reports nothing it did not measure.", file=sys.stderr)
        return 2
    if not ops.HAS_TRITON:
        print("normlib.benchmark: Triton is not installed (pip install 'normlib[triton]').", file=sys.stderr)
        return 2
    data = run(args.dtype, rows=args.rows, widths=args.widths)
    data["summary"] = {d: ratios(data, d) for d in args.dtype}
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    print(f"wrote {args.out}")
    if args.plot:
        plot(data, args.plot, dtype=args.dtype[0], M=16384 if 16384 in args.rows else args.rows[0])
        print(f"wrote {args.plot}")
    print(json.dumps(data["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
