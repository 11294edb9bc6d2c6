"""Time launch configurations of the fused kernels on a GPU: the data behind the launcher's heuristic.

The launchers pick, for a row width ``N``, how many warps a program gets, how
many rows it normalizes at once (``rows``), and for the backward pass how
many programs share the rows (``programs_per_sm``) and how deep the row loop
is software-pipelined (``num_stages``) — see
:func:`normlib.ops._kernels.fwd_config` and :func:`~normlib.ops._kernels.bwd_config`.
This tool searches those settings one at a time (coordinate descent, two
sweeps, starting from the current heuristic), checks every variant's output
against the default configuration's, and reports GB/s and the share of a
device-to-device copy of the same tensor::

    TRITON_INTERPRET=0 python -m normlib.benchmark.tune --out tune.json [--baseline old_kernels.py]

``--baseline`` times the launchers of another copy of ``_kernels.py`` too
(e.g. the version before a change), in the same run. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
from typing import Any, Callable, Optional

import torch

from .. import _cli
from ._common import graph_timer, warm_up_gpu, write_json
from ..testing.tolerance import tolerance
from .gpu import _TENSOR_PASSES, bytes_moved, copy_ms

# (op, dtype, M, N) searched by default: both kinds, the widths of common models.
DEFAULT_CASES = [
    ("layer_norm", "bf16", 16384, 1024),
    ("layer_norm", "bf16", 16384, 4096),
    ("layer_norm", "bf16", 16384, 16384),
    ("rms_norm", "bf16", 16384, 1024),
    ("rms_norm", "bf16", 16384, 4096),
    ("rms_norm", "bf16", 16384, 8192),
    ("add_rms_norm", "bf16", 16384, 4096),
    ("layer_norm", "fp32", 16384, 4096),
    ("layer_norm", "bf16", 4096, 1024),
]
_OPS = ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# M x N tensor passes each direction must make at least, without and with a residual: the GPU benchmark's bytes model
PASSES = {(d, res): _TENSOR_PASSES[("add_rms_norm" if res else "rms_norm", d)] for d in ("fwd", "bwd") for res in (False, True)}


class Case:
    """Inputs of one (op, dtype, M, N), its forward outputs, and a gradient to push back."""

    def __init__(self, op: str, dtype: str, M: int, N: int, seed: int = 0, device: str = "cuda"):
        g = torch.Generator(device=device).manual_seed(seed)
        dt = DTYPES[dtype]
        if op not in _OPS:
            raise ValueError(f"op must be one of {_OPS} (got {op!r})")
        self.op, self.dtype, self.M, self.N = op, dtype, M, N
        self.is_rms = op in ("rms_norm", "add_rms_norm")
        self.has_res = op.startswith("add_")

        def rnd(*shape):
            return torch.randn(*shape, device=device, generator=g).to(dt)

        self.x, self.dy = rnd(M, N), rnd(M, N)
        self.r = rnd(M, N) if self.has_res else None
        self.dres = rnd(M, N) if self.has_res else None
        self.w = rnd(N)
        self.b = None if self.is_rms else rnd(N)
        self.esize = self.x.element_size()

    def fwd(self, K, config=None):
        kw = {} if config is None else {"config": config}
        return K.norm_fwd(self.x, self.r, self.w, self.b, 1e-5, self.is_rms, **kw)

    def bwd(self, K, saved, config=None):
        y, res_out, mean, rstd = saved
        kw = {} if config is None else {"config": config}
        normalized = res_out if res_out is not None else self.x
        bias_dtype = None if self.b is None else self.b.dtype  # b is None exactly when is_rms
        residual_dtype = None if self.r is None else self.r.dtype  # r is None exactly without has_res
        return K.norm_bwd(
            self.dy, self.dres, normalized, self.w, bias_dtype, mean, rstd,
            self.is_rms, self.x.dtype, residual_dtype, **kw,
        )

    def gbytes(self, direction: str) -> float:
        return PASSES[(direction, self.has_res)] * self.M * self.N * self.esize / 1e9


def _same(a, b) -> bool:
    """Every output within normlib's tolerance of the default configuration's (reductions may be reordered)."""
    for u, v in zip(a, b):
        if (u is None) != (v is None):
            return False
        if u is None:
            continue
        tol = tolerance(u.dtype, n=u.shape[-1])
        if not torch.allclose(u.double(), v.double(), rtol=tol, atol=tol) or u.isnan().any():
            return False
    return True


def _poison(like) -> None:
    """Allocate and free NaN-filled blocks of the outputs' sizes, so the next launch gets memory holding NaN.

    The caching allocator hands a freed block of the same size to the next
    request: an output element the kernel forgets to write stays NaN.
    """
    junk = [torch.full_like(t, float("nan")) for t in like if t is not None and t.is_floating_point()]
    if junk and junk[0].is_cuda:
        torch.cuda.synchronize()
    del junk


def _candidates(direction: str, key: str, cfg: dict, N: int) -> list:
    w = cfg["num_warps"]
    if key == "num_warps":
        return sorted({max(1, min(32, v)) for v in (w // 2, w, 2 * w)})
    if key == "rows":
        return [r for r in (1, 2, 4, 8) if r * cfg["block_n"] <= 8192]
    if key == "programs_per_sm":
        return [1, 2, 4, 8]
    if key == "num_stages":
        return [1, 2, 3]
    raise KeyError(key)


def search(
    case: Case, K, direction: str, log: Callable[[str], None] = print, timer: Optional[Callable] = None,
    sweeps: int = 2, confirm: bool = True,
) -> list[dict]:
    """Coordinate descent over the launch settings of one direction; returns every timed variant.

    ``timer`` (default: ``graph_timer``, a CUDA graph replayed under ``triton.testing.do_bench``) returns milliseconds.
    """
    timer = timer or graph_timer
    saved = case.fwd(K)
    if direction == "fwd":
        default = K.fwd_config(case.N, case.esize)
        keys = ["num_warps", "rows"]
        ref = saved
        run = lambda cfg: case.fwd(K, cfg)  # noqa: E731
    else:
        default = K.bwd_config(case.N, case.esize, case.is_rms)
        keys = ["programs_per_sm", "num_warps", "rows", "num_stages"]
        ref = case.bwd(K, saved)
        run = lambda cfg: case.bwd(K, saved, cfg)  # noqa: E731
    tunable = {k: default[k] for k in keys}
    timed: dict[tuple, float] = {}
    records = []

    def measure(cfg):
        k = tuple(sorted(cfg.items()))
        if k in timed:
            return timed[k]
        _poison(ref)
        ok = _same(run(cfg), ref)
        ms = timer(lambda: run(cfg)) if ok else float("nan")
        timed[k] = ms
        gbps = case.gbytes(direction) / ms * 1e3
        records.append(dict(op=case.op, dtype=case.dtype, M=case.M, N=case.N, direction=direction,
                            config=dict(cfg), ms=ms, gbps=gbps, correct=ok))
        log(f"  {direction} {cfg} {ms * 1e3:9.1f} us {gbps:8.1f} GB/s{'' if ok else '  WRONG OUTPUT'}")
        return ms

    best = dict(tunable)
    best_ms = measure(best)
    for _sweep in range(sweeps):
        improved = False
        for key in keys:
            for value in _candidates(direction, key, default, case.N):
                cfg = dict(best, **{key: value})
                ms = measure(cfg)
                if ms == ms and ms < best_ms * 0.98:  # a 2 % margin against timing noise
                    best, best_ms, improved = cfg, ms, True
        if not improved:
            break
    for r in records:
        r["best"] = r["config"] == best
        r["default"] = r["config"] == tunable
    if confirm and best != tunable:
        # time the default and the winner again, alternately: a gain smaller than this spread is noise
        again: dict[str, list[float]] = {"default": [], "best": []}
        for _ in range(3):
            for name, cfg in (("default", tunable), ("best", best)):
                again[name].append(timer(lambda: run(cfg)))
        for r in records:
            for name in again:
                if r[name]:
                    r["retimed_ms"] = sorted(again[name])
    return records


def copy_gbps(M: int, N: int, dtype: str) -> float:
    dt = DTYPES[dtype]
    ms = copy_ms(M, N, dt, "cuda", graph_timer)
    return bytes_moved("copy", "copy", M, N, torch.empty((), dtype=dt).element_size()) / ms / 1e6


def _load(path: str):
    spec = importlib.util.spec_from_file_location("normlib_baseline_kernels", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path!r} as a Python module")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _case(text: str) -> tuple:
    """A ``--cases`` entry ``op:dtype:M:N``, checked (a row the kernels take)."""
    from ..ops.routing import MAX_ROW_BYTES

    op, dt, M, N = _cli.spec("op:dtype:M:N", (_cli.one_of(_OPS), _cli.one_of(tuple(DTYPES)), _cli.field_int(1, 2**20),
                                              _cli.field_int(1)))(text)
    widest = MAX_ROW_BYTES // DTYPES[dt].itemsize
    if N > widest:
        raise argparse.ArgumentTypeError(f"{text!r}: the field N must be at most {widest} for {dt} "
                                         f"(the kernels hold a row of up to {MAX_ROW_BYTES} bytes), got {N}")
    return op, dt, M, N


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.benchmark.tune``."""
    p = _cli.Parser(prog="python -m normlib.benchmark.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=_cli.output_file((".json",)), default="tune.json", help="where to write the JSON record")
    p.add_argument("--baseline", type=_cli.input_file((".py",)), default=None,
                   help="another _kernels.py whose default launch to time too")
    p.add_argument("--cases", nargs="+", type=_case, default=None,
                   help=f"op:dtype:M:N, op from {', '.join(_OPS)}, dtype from {', '.join(DTYPES)} "
                        "(default: a built-in list)")
    p.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--sweeps", type=_cli.int_at_least(1, 100), default=2, help="coordinate-descent sweeps per case")
    return p


def main(argv=None) -> int:
    """The command line: ``python -m normlib.benchmark.tune --help``."""
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        return _cli.fail("normlib.benchmark.tune", "needs a CUDA GPU")
    from normlib.ops import _kernels as K

    base = _load(args.baseline) if args.baseline else None
    warm_up_gpu()
    cases = args.cases or DEFAULT_CASES
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": [], "summary": []}
    import triton

    out["triton"] = triton.__version__
    for op, dt, M, N in cases:
        case = Case(op, dt, M, N)
        cp = copy_gbps(M, N, dt)
        print(f"{op} {dt} M={M} N={N}: copy {cp:.0f} GB/s", flush=True)
        for direction in args.directions:
            recs = search(case, K, direction, sweeps=args.sweeps)
            for r in recs:
                r["copy_gbps"] = cp
            out["results"] += recs
            row = dict(op=op, dtype=dt, M=M, N=N, direction=direction, copy_gbps=cp)
            d = next(r for r in recs if r["default"])
            b = next(r for r in recs if r["best"])
            dms = statistics.median(d.get("retimed_ms", [d["ms"]]))
            bms = statistics.median(b.get("retimed_ms", [b["ms"]]))
            row.update(default_gbps=case.gbytes(direction) / dms * 1e3, best_gbps=case.gbytes(direction) / bms * 1e3,
                       best_config=b["config"])
            if base is not None:
                saved = case.fwd(base)
                fn = (lambda: case.fwd(base)) if direction == "fwd" else (lambda: case.bwd(base, saved))
                ms = statistics.median(graph_timer(fn) for _ in range(3))
                row["baseline_gbps"] = case.gbytes(direction) / ms * 1e3
            out["summary"].append(row)
            write_json(out, args.out)
    print(f"\n{'op':13s} {'dt':4s} {'M':>6s} {'N':>6s} dir  {'copy':>6s} {'base':>6s} {'dflt':>6s} {'best':>6s}  best config")
    for r in out["summary"]:
        base_s = f"{r['baseline_gbps'] / r['copy_gbps']:6.2f}" if "baseline_gbps" in r else "     -"
        print(f"{r['op']:13s} {r['dtype']:4s} {r['M']:6d} {r['N']:6d} {r['direction']:4s} {r['copy_gbps']:6.0f} "
              f"{base_s} {r['default_gbps'] / r['copy_gbps']:6.2f} {r['best_gbps'] / r['copy_gbps']:6.2f}  {r['best_config']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
