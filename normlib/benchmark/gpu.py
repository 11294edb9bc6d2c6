"""GB/s benchmark of the fused norms against torch eager, torch.compile, Liger-Kernel (where installed) and a plain copy.

Run on a machine with a CUDA GPU::

    python -m normlib.benchmark --out book/data/benchmark.json --plot book/data/benchmark.png

The providers are ``normlib``, torch eager, ``torch.compile`` (inductor, which
compiles to Triton: it is there wherever this benchmark can run) and, where
Liger-Kernel is installed (``pip install liger-kernel``), ``liger``: its
LayerNorm, RMSNorm and fused add + RMSNorm Functions. Liger is imported only
when that provider runs; without it the command says it skips ``liger`` and
measures the others.

Each op is timed with ``triton.testing.do_bench`` (CUDA events, L2 flushed
between runs) in three modes — forward, backward alone (on a retained graph),
and forward + backward — and converted to GB/s from the bytes the op must
move at least (see :func:`bytes_moved`). A device-to-device copy of the same
tensor is timed too: its GB/s is the practical bandwidth ceiling the kernels
are judged against (:func:`targets`). The JSON records the device, driver,
torch and Triton versions and the date.

The full grid compiles ``torch.compile`` once per (op, shape, dtype) and
takes several minutes. The JSON is rewritten after every shape, and
``--resume`` measures only what a record from the same device and versions
still lacks, so an interrupted run can be completed.

Without a CUDA device the command says so and exits with status 2: it never
produces numbers it did not measure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import statistics
import sys
from typing import Any, Callable, Iterable, Optional

import torch

from .. import _cli
from ._common import cuda_timer, environment, graph_timer, warm_up_gpu, write_json

OPS = ("layer_norm", "rms_norm", "add_rms_norm")
MODES = ("fwd", "bwd", "fwd+bwd")
PROVIDERS = ("normlib", "torch", "torch.compile")
OPTIONAL_PROVIDERS = ("liger",)  # measured where their package is installed
ROWS = (4096, 16384, 32768)
WIDTHS = (1024, 2048, 4096, 8192, 16384)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
COMPILE_BACKEND = "inductor"  # the tests swap in "aot_eager" to exercise the machinery on CPU

# Tensors of M x N elements each op must read or write at least once.
_TENSOR_PASSES = {
    ("layer_norm", "fwd"): 2,  # read x, write y
    ("rms_norm", "fwd"): 2,
    ("add_rms_norm", "fwd"): 4,  # read x, residual; write y, residual_out
    ("layer_norm", "bwd"): 3,  # read x, dy; write dx
    ("rms_norm", "bwd"): 3,
    ("add_rms_norm", "bwd"): 5,  # read residual_out, dy, d(residual_out); write dx, dresidual
    ("layer_norm", "fwd+bwd"): 5,
    ("rms_norm", "fwd+bwd"): 5,
    ("add_rms_norm", "fwd+bwd"): 9,
}

_ENV_KEYS = ("device", "torch", "triton")  # what must match for --resume to add to a record


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


# Liger-Kernel's autograd Function for each op (module, name), imported only when the liger provider runs.
_LIGER = {
    "layer_norm": ("liger_kernel.ops.layer_norm", "LigerLayerNormFunction"),
    "rms_norm": ("liger_kernel.ops.rms_norm", "LigerRMSNormFunction"),
    "add_rms_norm": ("liger_kernel.ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction"),
}
# normlib's and torch's default RMSNorm eps (eps=None): that of float32, the dtype bf16 and fp32 are computed in
_RMS_EPS = torch.finfo(torch.float32).eps


def _liger(op: str) -> Callable:
    """Liger-Kernel's Function for ``op``, called as its own modules call it.

    LayerNorm with eps 1e-5; RMSNorm with no weight offset, Liger's default
    casting mode ``"llama"`` and ``in_place=False`` (the gradient of ``y`` is
    left intact, as every other provider leaves it).
    """
    module, name = _LIGER[op]
    fn = getattr(importlib.import_module(module), name)
    if op == "layer_norm":
        return lambda x, r, w, b: fn.apply(x, w, b, 1e-5)
    if op == "rms_norm":
        return lambda x, r, w, b: fn.apply(x, w, _RMS_EPS, 0.0, "llama", False)
    return lambda x, r, w, b: fn.apply(x, r, w, _RMS_EPS, 0.0, "llama", False)  # returns (y, residual_out)


def unavailable(provider: str, ops: Iterable[str] = OPS) -> Optional[str]:
    """Why ``provider`` cannot measure ``ops`` on this machine, or ``None`` when it can."""
    if provider not in OPTIONAL_PROVIDERS:
        return None
    if importlib.util.find_spec("liger_kernel") is None:
        return "Liger-Kernel is not installed (pip install liger-kernel)"
    for op in ops:
        module, name = _LIGER[op]
        try:
            getattr(importlib.import_module(module), name)
        except Exception as err:  # an old release without the op, or one that does not load here
            return f"Liger-Kernel is installed, but {module}.{name} cannot be loaded ({type(err).__name__}: {err})"
    return None


def choose_providers(requested: Optional[Iterable[str]], ops: Iterable[str] = OPS) -> tuple[list[str], list[str]]:
    """The providers to measure, and a line for each one left out.

    ``requested=None`` means every provider this machine has: ``PROVIDERS`` and
    each optional one whose package is installed.
    """
    ops = list(ops)
    wanted = list(PROVIDERS + OPTIONAL_PROVIDERS) if requested is None else list(requested)
    chosen, skipped = [], []
    for provider in wanted:
        why = unavailable(provider, ops)
        if why is None:
            chosen.append(provider)
        else:
            skipped.append(f"skipping provider {provider}: {why}")
    return chosen, skipped


def _provider_fn(provider: str, op: str) -> Callable:
    if provider == "normlib":
        return _normlib(op)
    if provider == "liger":
        return _liger(op)
    if provider == "torch":
        return _eager(op)
    if provider == "torch.compile":
        # Dynamo caches per code object, and every shape recompiles (dynamic=False):
        # without a reset the recompile limit would silently fall back to eager.
        torch._dynamo.reset()
        return torch.compile(_eager(op), dynamic=False, fullgraph=True, backend=COMPILE_BACKEND)
    raise ValueError(f"unknown provider {provider!r}")


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def measure_op(fn: Callable, modes: Iterable[str], M: int, N: int, dtype: torch.dtype, device: str, timer: Callable,
               gpu_timer: Optional[Callable] = None) -> dict:
    """Milliseconds per call of ``fn(x, residual, weight, bias)`` in each mode.

    ``fwd`` runs without autograd; ``bwd`` replays the backward pass of one
    retained graph; ``fwd+bwd`` builds and consumes a graph per call. Returns
    ``{mode: ms}``, or with ``gpu_timer`` ``{mode: (ms, gpu_ms)}``.
    """
    # a separate gradient for each output: one tensor for both would be read from L2 the second time
    x, r, dy, dres = (torch.randn(M, N, device=device, dtype=dtype) for _ in range(4))
    w, b = (torch.randn(N, device=device, dtype=dtype) for _ in range(2))
    leaves = (x, r, w, b)
    out = {}

    def gpu(f, **kw):
        if gpu_timer is None:  # only called with one
            raise ValueError("measure_op: no gpu_timer to time with")
        try:
            return gpu_timer(f, **kw)
        except Exception as err:  # keep the eager measurement; say why the GPU time is missing
            if device == "cuda":
                torch.cuda.synchronize()
            return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"

    def both(f, **kw):
        ms = timer(f, **kw)
        return ms if gpu_timer is None else (ms, gpu(f, **kw))

    for mode in modes:
        if mode == "fwd":
            with torch.no_grad():
                out[mode] = both(lambda: fn(x, r, w, b))
            continue
        for t in leaves:
            t.requires_grad_(True)
        if mode == "bwd":
            outs = _outputs(fn(x, r, w, b))
            grads = (dy, dres)[: len(outs)]
            ms = timer(lambda: torch.autograd.backward(outs, grads, retain_graph=True), grad_to_none=leaves)
            del outs
            if gpu_timer is None:
                out[mode] = ms
            else:
                # the backward pass runs on the stream of its forward pass: capture on that stream
                stream = torch.cuda.Stream() if device == "cuda" else None
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    outs = _outputs(fn(x, r, w, b))
                out[mode] = (ms, gpu(lambda: torch.autograd.backward(outs, grads, retain_graph=True),
                                     grad_to_none=leaves, stream=stream))
                del outs
        else:

            def step():
                outs = _outputs(fn(x, r, w, b))
                torch.autograd.backward(outs, (dy, dres)[: len(outs)])

            out[mode] = both(step, grad_to_none=leaves)
        for t in leaves:
            t.requires_grad_(False)
            t.grad = None
    return out


def copy_ms(M: int, N: int, dtype: torch.dtype, device: str = "cuda", timer: Callable = cuda_timer) -> float:
    src = torch.randn(M, N, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src))


def _time(rec: dict) -> float:
    """The time a record is judged by: GPU time where it was measured, else the eager time."""
    return rec.get("gpu_ms") or rec["ms"]


def _key(rec: dict) -> tuple:
    return (rec["dtype"], rec["op"], rec["mode"], rec["provider"], rec["M"], rec["N"])


def run(
    dtypes: Iterable[str],
    rows=ROWS,
    widths=WIDTHS,
    ops=OPS,
    providers=PROVIDERS,
    *,
    device: str = "cuda",
    timer: Callable = cuda_timer,
    gpu_timer: Optional[Callable] = None,
    previous: Optional[dict] = None,
    save: Optional[Callable[[dict], None]] = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Measure every (dtype, M, N, op, provider, mode) and the copy; returns the JSON-ready record.

    With ``previous`` (a record from the same device and versions), only what
    it lacks is measured. ``save`` is called with the record after every shape.
    Each result holds ``ms`` (``timer``: an eager call) and, with ``gpu_timer``,
    ``gpu_ms`` (the GPU's own time); ``gbps`` comes from ``gpu_ms`` when there
    is one, ``eager_gbps`` from ``ms``.
    """
    env = environment(device)
    if device == "cuda":
        warm_up_gpu()
    data: dict[str, Any] = {"environment": env, "runs": [env["date"]], "bytes_model": {f"{k[0]} {k[1]}": v for k, v in _TENSOR_PASSES.items()}, "results": []}
    if previous is not None:
        old = previous["environment"]
        if any(old[k] != env[k] for k in _ENV_KEYS):
            raise ValueError(
                "cannot add to a record from another environment: "
                + ", ".join(f"{k} {old[k]!r} vs {env[k]!r}" for k in _ENV_KEYS if old[k] != env[k])
            )
        data["environment"] = old
        data["runs"] = previous.get("runs", [old["date"]]) + [env["date"]]
        data["results"] = list(previous["results"])
    done = {_key(r) for r in data["results"]}
    for dname in dtypes:
        dtype = DTYPES[dname]
        esize = torch.empty((), dtype=dtype).element_size()
        for M in rows:
            for N in widths:

                def record(op, mode, provider, times):
                    ms, gpu_ms = times if isinstance(times, tuple) else (times, None)
                    nbytes = bytes_moved(op, mode, M, N, esize)
                    rec = dict(op=op, mode=mode, provider=provider, dtype=dname, M=M, N=N, ms=ms)
                    if isinstance(gpu_ms, str):
                        rec["gpu_error"], gpu_ms = gpu_ms, None
                        log(f"  GPU time not measured: {rec['gpu_error']}")
                    if gpu_ms is not None:
                        rec["gpu_ms"] = gpu_ms
                    rec["gbps"] = nbytes / _time(rec) / 1e6
                    rec["eager_gbps"] = nbytes / ms / 1e6
                    data["results"].append(rec)
                    log(f"{dname} M={M:6d} N={N:6d} {op:13s} {mode:8s} {provider:14s} {rec['gbps']:8.1f} GB/s"
                        + (f" (eager call {rec['eager_gbps']:8.1f})" if gpu_ms is not None else ""))

                if (dname, "copy", "copy", "copy", M, N) not in done:
                    record("copy", "copy", "copy", copy_ms(M, N, dtype, device, timer))
                for op in ops:
                    for provider in providers:
                        todo = [m for m in MODES if (dname, op, m, provider, M, N) not in done]
                        if todo:
                            fn = _provider_fn(provider, op)
                            for mode, times in measure_op(fn, todo, M, N, dtype, device, timer, gpu_timer).items():
                                record(op, mode, provider, times)
                if device == "cuda":
                    torch.cuda.empty_cache()
                if save is not None:
                    save(data)
    return data


def ratios(data: dict, dtype: str = "bf16") -> dict:
    """Summary ratios per (op, mode): normlib's share of copy bandwidth, and its speed-ups.

    Speed-ups are medians over shapes of the time ratios ``t_provider / t_normlib``.
    """
    res = [r for r in data["results"] if r["dtype"] == dtype]
    copy = {(r["M"], r["N"]): r["gbps"] for r in res if r["provider"] == "copy"}
    by = {(r["op"], r["mode"], r["provider"], r["M"], r["N"]): r for r in res if r["provider"] != "copy"}
    # an optional provider gets its fields only where it was measured: records without it keep theirs
    optional = tuple(p for p in OPTIONAL_PROVIDERS if any(r["provider"] == p for r in res))
    out = {}
    for op, mode in sorted({(r["op"], r["mode"]) for r in res if r["provider"] == "normlib"}):
        shapes = sorted((M, N) for (o, m, p, M, N) in by if (o, m, p) == (op, mode, "normlib") and (M, N) in copy)
        frac = {(M, N): by[(op, mode, "normlib", M, N)]["gbps"] / copy[(M, N)] for M, N in shapes}
        big = [f for (M, N), f in frac.items() if M * N >= 2**25]
        bwd_band = [f for (M, N), f in frac.items() if N <= 8192 and M >= 16384]
        entry = {
            "median_of_copy_bandwidth_MN_ge_2^25": statistics.median(big) if big else None,
            "median_of_copy_bandwidth_N_le_8K_M_ge_16K": statistics.median(bwd_band) if bwd_band else None,
            "min_of_copy_bandwidth": min(frac.values()) if frac else None,
        }
        for prov in ("torch", "torch.compile") + optional:
            pairs = [(by[(op, mode, prov, M, N)], by[(op, mode, "normlib", M, N)]) for M, N in shapes if (op, mode, prov, M, N) in by]
            sp = [_time(a) / _time(b) for a, b in pairs]
            entry[f"speedup_vs_{prov}"] = statistics.median(sp) if sp else None
            eager = [a["ms"] / b["ms"] for a, b in pairs]
            entry[f"eager_call_speedup_vs_{prov}"] = statistics.median(eager) if eager else None
        out[f"{op} {mode}"] = entry
    return out


def targets(data: dict, dtype: str = "bf16") -> list[dict]:
    """The fused path's performance targets, each with its measured value and whether it is met.

    Copy bandwidth: forward median >= 0.90x over shapes with M*N >= 2^25 and
    no shape below 0.75x; backward median >= 0.80x over the same shapes.
    Against torch eager: forward >= 1.3x for LayerNorm and >= 1.4x for RMSNorm
    (add+RMSNorm too), backward >= 1.5x and >= 2x; add+RMSNorm forward+backward
    >= 1.8x. Against torch.compile: forward >= 0.95x, backward and
    forward+backward >= 1.0x. A target whose shapes were not measured has
    value ``None`` and ``met`` ``None``.
    """
    summary = ratios(data, dtype)
    rows = []

    def add(what, key, field, required):
        value = summary.get(key, {}).get(field)
        rows.append(dict(target=what, op_mode=key, value=value, required=required, met=None if value is None else value >= required))

    for op in OPS:
        eager_fwd, eager_bwd = (1.3, 1.5) if op == "layer_norm" else (1.4, 2.0)
        add("share of copy bandwidth, median, M*N >= 2^25", f"{op} fwd", "median_of_copy_bandwidth_MN_ge_2^25", 0.90)
        add("share of copy bandwidth, every shape", f"{op} fwd", "min_of_copy_bandwidth", 0.75)
        add("share of copy bandwidth, median, M*N >= 2^25", f"{op} bwd", "median_of_copy_bandwidth_MN_ge_2^25", 0.80)
        add("speed-up over torch eager", f"{op} fwd", "speedup_vs_torch", eager_fwd)
        add("speed-up over torch eager", f"{op} bwd", "speedup_vs_torch", eager_bwd)
    add("speed-up over torch eager", "add_rms_norm fwd+bwd", "speedup_vs_torch", 1.8)
    for op in OPS:
        for mode in MODES:
            add("speed-up over torch.compile", f"{op} {mode}", "speedup_vs_torch.compile", 0.95 if mode == "fwd" else 1.0)
    return rows


def report(data: dict, dtype: str = "bf16") -> str:
    """The record's environment and every target as a plain-text table."""
    env = data["environment"]
    runs = data.get("runs", [env["date"]])
    lines = [
        f"measured on {env['device']} (driver {env['driver']}, CUDA {env['cuda']}),",
        f"torch {env['torch']}, triton {env['triton']}, {runs[0]}"
        + (f",\ncompleted in {len(runs)} runs, the last {runs[-1]}" if len(runs) > 1 else ""),
        f"{'op and mode':21s} {'target':46s} {'measured':>8s} {'needed':>6s}  met",
    ]
    for t in targets(data, dtype):
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        met = {True: "yes", False: "NO", None: "-"}[t["met"]]
        lines.append(f"{t['op_mode']:21s} {t['target']:46s} {value:>8s} {t['required']:6.2f}  {met}")
    summary = ratios(data, dtype)
    for prov in OPTIONAL_PROVIDERS:
        sp = {k: v[f"speedup_vs_{prov}"] for k, v in summary.items() if v.get(f"speedup_vs_{prov}") is not None}
        if sp:
            lines.append(f"speed-up over {prov} (no target): " + ", ".join(f"{k} {v:.2f}" for k, v in sp.items()))
    return "\n".join(lines)


def plot(data: dict, path: Optional[str] = None, dtype: str = "bf16", M: Optional[int] = None):
    """GB/s against N at one M: a row of panels per op, a column per mode, copy bandwidth dashed.

    Returns the matplotlib figure; saves it to ``path`` if given.
    """
    import matplotlib.pyplot as plt

    res = [r for r in data["results"] if r["dtype"] == dtype]
    if M is None:
        measured = sorted({r["M"] for r in res})
        M = 16384 if 16384 in measured else measured[0]
    res = [r for r in res if r["M"] == M]
    ops = [op for op in OPS if any(r["op"] == op for r in res)]
    fig, axes = plt.subplots(len(ops), len(MODES), figsize=(3.3 * len(MODES), 2.6 * len(ops)), sharex=True, squeeze=False)
    copy = sorted((r["N"], r["gbps"]) for r in res if r["provider"] == "copy")
    for i, op in enumerate(ops):
        for j, mode in enumerate(MODES):
            ax = axes[i][j]
            for prov in PROVIDERS + OPTIONAL_PROVIDERS:
                pts = sorted((r["N"], r["gbps"]) for r in res if (r["op"], r["mode"], r["provider"]) == (op, mode, prov))
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, label=prov)
            if copy:
                ax.plot(*zip(*copy), "k--", label="copy")
            ax.set_xscale("log", base=2)
            widths = sorted({r["N"] for r in res})
            ax.set_xticks(widths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in widths])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(f"{op} {mode}", fontsize=9)
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel("GB/s (GPU time)")
    for ax in axes[-1]:
        ax.set_xlabel("N (row width)")
    axes[0][-1].legend(frameon=False, fontsize=7)
    env = data["environment"]
    fig.suptitle(f"{dtype}, M={M}: {env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    if path is not None:
        _cli.save_figure(fig, path, dpi=150)
    return fig


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.benchmark`` (the GPU benchmark)."""
    p = _cli.Parser(prog="python -m normlib.benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default): this GPU benchmark; cpu: normlib.benchmark.cpu, with its own options")
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    p.add_argument("--rows", nargs="+", type=_cli.int_at_least(1, 2**20), default=list(ROWS), help="M, rows of each tensor")
    p.add_argument("--widths", nargs="+", type=_cli.int_at_least(1, 2**20), default=list(WIDTHS), help="N, the row width")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--providers", nargs="+", default=None, choices=PROVIDERS + OPTIONAL_PROVIDERS,
                   help="default: all of them, liger where Liger-Kernel is installed")
    p.add_argument("--out", type=_cli.output_file((".json",)), default="benchmark.json",
                   help="where to write the JSON record")
    p.add_argument("--resume", action="store_true", help="add to --out what it lacks (same device and versions)")
    p.add_argument("--plot", type=_cli.output_file((".png", ".svg", ".pdf")), default=None,
                   help="also draw GB/s against N into this figure")
    return p


def _previous(path: str) -> Optional[dict]:
    """The record ``--resume`` adds to, or None where there is none yet; ValueError if it is not one."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r} is not a JSON record of this benchmark ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("environment"), dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{path!r} is not a record of this benchmark (no environment and results)")
    missing = [k for k in _ENV_KEYS if k not in data["environment"]]
    if missing:
        raise ValueError(f"{path!r} is not a record of this benchmark (its environment lacks {', '.join(missing)})")
    return data


def main(argv=None) -> int:
    """The command line: ``python -m normlib.benchmark --help``.

    ``--device cpu`` runs the CPU benchmark of the reference path instead
    (:mod:`normlib.benchmark.cpu`, which takes its own options).
    """
    device = _cli.Parser(prog="python -m normlib.benchmark", add_help=False)
    device.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    known, rest = device.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if known.device == "cpu":
        from .cpu import main as cpu_main

        return cpu_main(rest)
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    previous = None
    if args.resume:
        try:
            previous = _previous(args.out)
        except ValueError as e:
            p.error(f"argument --resume: {e}")
    from normlib import ops

    if not torch.cuda.is_available():
        return _cli.fail("normlib.benchmark", "no CUDA GPU is available; it measures GPU memory bandwidth and "
                         "reports nothing it did not measure.")
    if not ops.HAS_TRITON:
        return _cli.fail("normlib.benchmark", "Triton is not installed (pip install 'normlib[triton]').")
    providers, skipped = choose_providers(args.providers, args.ops)
    for line in skipped:
        print(f"normlib.benchmark: {line}", file=sys.stderr)
    if skipped and args.providers is not None:  # asked for by name: measuring without it would be another run
        return 2
    try:
        data = run(
            args.dtype, rows=args.rows, widths=args.widths, ops=args.ops, providers=providers,
            gpu_timer=graph_timer, previous=previous, save=lambda d: write_json(d, args.out),
        )
    except ValueError as err:
        return _cli.fail("normlib.benchmark", str(err))
    data["summary"] = {d: ratios(data, d) for d in sorted({r["dtype"] for r in data["results"]})}
    write_json(data, args.out)
    print(f"wrote {args.out}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        plot(data, args.plot, dtype=args.dtype[0])
        print(f"wrote {args.plot}")
    print(report(data, args.dtype[0]))
    return 0
