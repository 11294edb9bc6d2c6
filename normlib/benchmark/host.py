"""What a normlib call costs the host: its modules against torch.nn's on tiny CPU tensors, and the fused path's
own work before its kernel starts, timed on CPU with the launch stubbed.

Run it with::

    python -m normlib.benchmark.host --out book/data/host_overhead.json

Tiny tensors cost almost nothing to compute, so a call on them costs what
its Python and dispatch cost. ``modules``: each of normlib's modules and
its torch.nn namesake on the same tiny CPU tensor, forward (under
``no_grad``) and forward + backward, one thread, interleaved round by round;
medians, ratios and their spread. ``stops``: the Python functions of normlib
a LayerNorm call enters between the module and the op that computes (CPU,
and the fused path a CUDA tensor takes). ``fused``: on a GPU a norm's kernel
runs in microseconds; what the caller waits for from Python is everything
before the launch: argument checks, the plan, allocations, the autograd
Function, the launch heuristic. That part is measured on any machine: the
plan is forced onto the fused path for CPU tensors and the Triton kernels
are replaced by stubs that return at once, so a call does all its host work
and no device work. Two figures per fused case:

* ``calls``: the function calls normlib's own code makes during one call
  (``sys.setprofile``: its Python functions entered, and its calls into C):
  deterministic, the same on every machine and torch release, and what
  ``tests/test_host_overhead.py`` holds the package to;
* ``us`` and ``ratio``: the median time of one call, and its ratio to
  torch's own eager call on the same tensor (``torch.nn.functional`` /
  ``torch.nn``), interleaved round by round.

Needs Triton installed (the launch heuristics live beside the kernels);
it never runs a kernel.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as TF

from .. import _cli, ops
from ..batchnorm import BatchNorm1d, BatchNorm2d
from ..normalization import GroupNorm, LayerNorm, RMSNorm
from ..ops import routing
from ._common import fastest, provenance, write_json

__all__ = ["CASES", "MODULE_CASES", "stubbed_launch", "count_calls", "count_stops", "measure", "main"]


class _Stub:
    """Stands for a Triton kernel: ``kernel[grid](*args, **meta)`` returns at once."""

    def __getitem__(self, grid):
        return self

    def __call__(self, *args, **kwargs):
        return None


@contextlib.contextmanager
def stubbed_launch() -> Iterator[None]:
    """Route CPU tensors onto the fused path with kernels that do nothing."""
    import triton

    from ..ops import _kernels

    # @triton.jit makes a JITFunction, or an InterpretedFunction under TRITON_INTERPRET=1: stub both
    kinds = tuple(k for k in (getattr(triton.runtime, "JITFunction", None),
                              getattr(getattr(triton.runtime, "interpreter", None), "InterpretedFunction", None),
                              _kernels._Serialised)
                  if isinstance(k, type))
    kernels = {name: k for name, k in vars(_kernels).items() if isinstance(k, kinds)}
    saved = (routing.HAS_TRITON, routing._interpreter_on)
    for name in kernels:
        setattr(_kernels, name, _Stub())
    routing.HAS_TRITON = True
    routing._interpreter_on = lambda: True
    try:
        with ops.force_path("fused"):
            yield
    finally:
        for name, k in kernels.items():
            setattr(_kernels, name, k)
        routing.HAS_TRITON, routing._interpreter_on = saved


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def count_calls(fn: Callable[[], object]) -> int:
    """Function calls normlib's own code makes while ``fn()`` runs once (after one warm-up call).

    Every Python function of normlib entered, and every call normlib's code
    makes into C (a torch op, ``isinstance``, ...): the work of normlib's
    host path, independent of the torch release around it.
    """
    fn()
    n = 0

    def prof(frame, event, arg):
        nonlocal n
        if event in ("call", "c_call") and frame.f_code.co_filename.startswith(_PACKAGE):
            n += 1

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n - 1  # the call that switched the counting off is this file's own


def count_stops(fn: Callable[[], object]) -> list[str]:
    """The Python functions of normlib that one call of ``fn()`` enters, in order (after a warm-up call):
    the stops between the module and the op that computes."""
    fn()
    stops: list[str] = []

    def prof(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(_PACKAGE) and code.co_filename != __file__:
            stops.append(f"{os.path.relpath(code.co_filename, _PACKAGE)}:{code.co_name}")

    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return stops


def _module_cases() -> dict[str, tuple[Callable[[bool], torch.nn.Module], tuple[int, ...], bool]]:
    """name -> (module factory (``torch_side``), input shape, training)."""
    nn = torch.nn
    return {
        "LayerNorm(64), 8x64": (lambda t: (nn.LayerNorm if t else LayerNorm)(64), (8, 64), True),
        "LayerNorm(4096), 1x4096": (lambda t: (nn.LayerNorm if t else LayerNorm)(4096), (1, 4096), True),
        "RMSNorm(4096), 1x4096": (lambda t: (nn.RMSNorm if t else RMSNorm)(4096), (1, 4096), True),
        "GroupNorm(4, 16), 2x16x4x4": (lambda t: (nn.GroupNorm if t else GroupNorm)(4, 16), (2, 16, 4, 4), True),
        "BatchNorm1d(16) eval, 8x16": (lambda t: (nn.BatchNorm1d if t else BatchNorm1d)(16), (8, 16), False),
        "BatchNorm2d(16) train, 4x16x4x4": (lambda t: (nn.BatchNorm2d if t else BatchNorm2d)(16), (4, 16, 4, 4),
                                            True),
    }


MODULE_CASES = list(_module_cases())


def _module_calls(name: str) -> tuple[Callable[[], object], ...]:
    """``(ours forward, torch's forward, ours fwd+bwd, torch's fwd+bwd)`` of one module case."""
    factory, shape, training = _module_cases()[name]
    torch.manual_seed(0)
    x = torch.randn(shape)
    xg = x.clone().requires_grad_()
    dy = torch.randn(shape)
    calls = []
    for grad in (False, True):
        for torch_side in (False, True):
            m = factory(torch_side).train(training)
            if grad:
                calls.append(lambda m=m: m(xg).backward(dy))
            else:
                def forward(m=m):
                    with torch.no_grad():
                        return m(x)
                calls.append(forward)
    return calls[0], calls[1], calls[2], calls[3]


def _interleaved(ours: Callable[[], object], theirs: Callable[[], object], rounds: int, reps: int,
                 ours_ctx=contextlib.nullcontext) -> dict:
    """Median seconds of each, and the median and range of their per-round ratio, interleaved by round."""
    t_ours: list[float] = []
    t_theirs: list[float] = []
    for r in range(rounds):
        for who in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
            if who == "ours":
                with ours_ctx():
                    t_ours.append(fastest(ours, reps))
            else:
                t_theirs.append(fastest(theirs, reps))
    ratios = [a / b for a, b in zip(t_ours, t_theirs)]
    return {"us": 1e6 * statistics.median(t_ours), "torch_us": 1e6 * statistics.median(t_theirs),
            "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}


def measure_modules(rounds: int = 15, reps: int = 200) -> dict:
    """Every module case: forward and forward + backward, ours against torch.nn's, interleaved."""
    out = {}
    for name in MODULE_CASES:
        ours_f, theirs_f, ours_b, theirs_b = _module_calls(name)
        for fn in (ours_f, theirs_f, ours_b, theirs_b):
            fn()
        out[name] = {"forward": _interleaved(ours_f, theirs_f, rounds, reps),
                     "forward+backward": _interleaved(ours_b, theirs_b, rounds, reps)}
    return out


def measure_stops() -> dict:
    """The stops of a LayerNorm forward: on CPU (torch's op, checked) and on the fused path a CUDA tensor takes."""
    m = LayerNorm(4096)
    x = torch.randn(1, 4096)
    with torch.no_grad():
        cpu = count_stops(lambda: m(x))
        with stubbed_launch():
            fused = count_stops(lambda: m(x))
    return {"cpu": {"functions": len(cpu), "files": len({s.split(":")[0] for s in cpu}), "path": cpu},
            "fused": {"functions": len(fused), "files": len({s.split(":")[0] for s in fused}), "path": fused}}


_TRITON_OP: list = []  # the benchmark's own torch.library.triton_op, registered on first use


def _triton_op():
    """A ``torch.library.triton_op`` around normlib's forward launcher (eager calls run its body; the
    stubbed kernels are not wrapped with ``wrap_triton``, which only matters while compiling)."""
    if not _TRITON_OP:
        from ..ops import _functions
        from ..ops.rounding import TORCH

        @torch.library.triton_op("normlib_host_benchmark::fused_norm", mutates_args=())
        def fused_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
            return _functions.forward(x, None, weight, bias, eps, False, TORCH)[0]

        _TRITON_OP.append(fused_norm)
    return _TRITON_OP[0]


def _entries() -> dict[str, Callable[[bool], Callable[[], object]]]:
    """The ways into the kernels, each a factory (``grad``) of one LayerNorm(4096) call on one row."""
    from ..ops import _custom_ops, _functions
    from ..ops.rounding import TORCH

    def build(call):
        def factory(grad):
            x = torch.randn(1, 4096, requires_grad=grad)
            w = torch.ones(4096, requires_grad=grad)
            b = torch.zeros(4096, requires_grad=grad)
            dy = torch.randn(1, 4096)
            if grad:
                return lambda: call(x, w, b)[0].backward(dy)
            return lambda: call(x, w, b)
        return factory

    return {
        "launchers, called directly (no graph)": build(
            lambda x, w, b: _functions.forward(x, None, w, b, 1e-5, False, TORCH)),
        "torch.autograd.Function": build(
            lambda x, w, b: _functions.FusedNormFunction.apply(x, None, w, b, 1e-5, False, TORCH)),
        "torch.library.custom_op (its autograd registered)": build(
            lambda x, w, b: _custom_ops.fused_norm(x, None, w, b, 1e-5, rms=False, rounding=TORCH)),
        "torch.library.triton_op (forward only)": build(lambda x, w, b: (_triton_op()(x, w, b, 1e-5),)),
    }


def measure_entries(rounds: int = 15, reps: int = 200) -> dict:
    """Host time of each way into the kernels, launch stubbed: forward (no gradient) and forward + backward."""
    out: dict = {}
    with stubbed_launch():
        for name, factory in _entries().items():
            row = {}
            for grad in (False, True):
                if grad and ("forward only" in name or "no graph" in name):
                    continue
                fn = factory(grad)
                with torch.set_grad_enabled(grad):
                    fn()
                    times = [fastest(fn, reps) for _ in range(rounds)]
                row["forward+backward" if grad else "forward"] = 1e6 * statistics.median(times)
            out[name] = row
    return out


def _median_us(fn: Callable[[], object], rounds: int, reps: int) -> float:
    return 1e6 * statistics.median(fastest(fn, reps) for _ in range(rounds))


def profile_cpu_call(rounds: int = 15, reps: int = 200) -> dict:
    """Where a LayerNorm(64) forward on 8x64 CPU values spends its microseconds: each stage timed alone
    (medians), normlib's and torch.nn's, so that the differences can be read off."""
    from .. import _checks
    from ..ops import dispatch, native, routing

    m, t = LayerNorm(64), torch.nn.LayerNorm(64)
    x = torch.randn(8, 64)
    w, b = m.weight, m.bias
    _, mean, rstd = torch.native_layer_norm(x, (64,), w, b, 1e-5)
    stages = {
        "normlib: module call": lambda: m(x),
        "normlib: forward": lambda: m.forward(x),
        "normlib: ops.dispatch.layer_norm": lambda: dispatch.layer_norm(x, (64,), w, b, 1e-5),
        "normlib: argument checks": lambda: _checks.check_layer_norm_args(x, (64,), w, b, 1e-5),
        "normlib: plan": lambda: routing.plan("layer_norm", x, None, w, b, rows=True, autocast=False),
        "normlib: ops.native.layer_norm": lambda: native.layer_norm(x, (64,), w, b, 1e-5),
        "normlib: torch.native_layer_norm": lambda: torch.native_layer_norm(x, (64,), w, b, 1e-5),
        "normlib: the statistics' check": lambda: native.trusted(mean, rstd),
        "torch.nn: module call": lambda: t(x),
        "torch.nn: forward": lambda: t.forward(x),
        "torch.nn: F.layer_norm": lambda: TF.layer_norm(x, (64,), w, b, 1e-5),
    }
    times: dict[str, list[float]] = {name: [] for name in stages}
    with torch.no_grad():
        for _ in range(rounds):  # every stage once a round: drift in the machine's speed touches all alike
            for name, fn in stages.items():
                times[name].append(fastest(fn, reps))
    us = {name: 1e6 * statistics.median(t) for name, t in times.items()}
    own = {
        "Module.__call__": us["normlib: module call"] - us["normlib: forward"],
        "forward (reading the parameters)": us["normlib: forward"] - us["normlib: ops.dispatch.layer_norm"],
        "dispatch's own work": (us["normlib: ops.dispatch.layer_norm"] - us["normlib: argument checks"]
                                - us["normlib: plan"] - us["normlib: ops.native.layer_norm"]),
        "argument checks": us["normlib: argument checks"],
        "plan": us["normlib: plan"],
        "torch's op": us["normlib: torch.native_layer_norm"],
        "the statistics' check": us["normlib: the statistics' check"],
        "native's own work": (us["normlib: ops.native.layer_norm"] - us["normlib: torch.native_layer_norm"]
                              - us["normlib: the statistics' check"]),
    }
    theirs = {
        "Module.__call__": us["torch.nn: module call"] - us["torch.nn: forward"],
        "forward (reading the parameters)": us["torch.nn: forward"] - us["torch.nn: F.layer_norm"],
        "F.layer_norm (its checks and torch's op)": us["torch.nn: F.layer_norm"],
    }
    return {"case": "LayerNorm(64) forward, 8x64, no_grad", "stages_us": us, "normlib_us": own, "torch_us": theirs}


def profile_fused_call(grad: bool, top: int = 12) -> list:
    """The functions a stubbed fused LayerNorm(4096) call on one row spends its time in (cProfile, per call,
    own time; cProfile's own cost inflates each Python function's share)."""
    import cProfile
    import pstats

    m = LayerNorm(4096)
    x = torch.randn(1, 4096, requires_grad=grad)
    dy = torch.randn(1, 4096)
    fn = (lambda: m(x).backward(dy)) if grad else (lambda: m(x))
    n = 2000
    with torch.set_grad_enabled(grad), stubbed_launch():
        fn()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(n):
            fn()
        prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]  # the raw table
    rows = []
    for (path, line, name), (_cc, calls, tottime, _ct, _callers) in stats.items():
        where = os.path.relpath(path, os.path.dirname(_PACKAGE)) if path.startswith(_PACKAGE) else (
            os.path.basename(path) if path != "~" else "")
        rows.append({"function": f"{where}:{name}" if where else name, "calls": calls / n,
                     "us": 1e6 * tottime / n})
    rows.sort(key=lambda r: -r["us"])
    return rows[:top]


def _cases() -> dict[str, tuple[Callable[[], Callable], Callable[[], Callable]]]:
    """name -> (normlib call factory, torch call factory); each factory builds its tensors once."""

    def ln(rows, grad):
        def build(torch_side):
            m = torch.nn.LayerNorm(4096) if torch_side else LayerNorm(4096)
            x = torch.randn(rows, 4096, requires_grad=grad)
            dy = torch.randn(rows, 4096)
            return (lambda: m(x).backward(dy)) if grad else (lambda: m(x))
        return (lambda: build(False), lambda: build(True))

    def rms(rows):
        def build(torch_side):
            m = torch.nn.RMSNorm(4096) if torch_side else RMSNorm(4096)
            x = torch.randn(rows, 4096)
            return lambda: m(x)
        return (lambda: build(False), lambda: build(True))

    def add_rms(rows):
        def build(torch_side):
            x, r, w = torch.randn(rows, 4096), torch.randn(rows, 4096), torch.randn(4096)
            if torch_side:
                def run():
                    s = x + r
                    return TF.rms_norm(s, (4096,), w), s
                return run
            return lambda: ops.add_rms_norm(x, r, w)
        return (lambda: build(False), lambda: build(True))

    return {
        "LayerNorm(4096) forward, 1 row": ln(1, False),
        "LayerNorm(4096) forward, 64 rows": ln(64, False),
        "LayerNorm(4096) forward+backward, 1 row": ln(1, True),
        "LayerNorm(4096) forward+backward, 64 rows": ln(64, True),
        "RMSNorm(4096) forward, 1 row": rms(1),
        "add_rms_norm(4096) forward, 1 row": add_rms(1),
    }


CASES = list(_cases())


def measure(rounds: int = 15, reps: int = 200) -> dict:
    """The modules' table, the stops, and the fused path's calls and interleaved times against torch's eager call."""
    out: dict = {"provenance": provenance(), "rounds": rounds, "reps": reps,
                 "modules": measure_modules(rounds, reps), "stops": measure_stops(),
                 "entries": measure_entries(rounds, reps), "profile": {
                     "cpu": profile_cpu_call(rounds, reps),
                     "fused forward": profile_fused_call(False), "fused forward+backward": profile_fused_call(True)},
                 "cases": {}}
    torch.set_grad_enabled(True)
    for name, (ours_f, theirs_f) in _cases().items():
        with torch.no_grad() if "backward" not in name else contextlib.nullcontext():
            with stubbed_launch():
                ours = ours_f()
                calls = count_calls(ours)
            theirs = theirs_f()
            timed = _interleaved(ours, theirs, rounds, reps, ours_ctx=stubbed_launch)
        out["cases"][name] = {"calls": calls, **timed}
    return out


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.benchmark.host``."""
    p = _cli.Parser(prog="python -m normlib.benchmark.host", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=_cli.output_file((".json",)), default="host_overhead.json",
                   help="where to write the JSON record")
    p.add_argument("--rounds", type=_cli.int_at_least(1, 1000), default=15, help="interleaved rounds (median taken)")
    p.add_argument("--threads", type=_cli.int_at_least(1, 1024), default=1, help="torch's intra-op threads (default 1)")
    return p


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    data = measure(args.rounds)
    write_json(data, args.out, newline=True)
    prov = data["provenance"]
    print(f"per call on tiny CPU tensors, normlib's module / torch.nn's ({prov['cpu_model']}, {prov['threads']} "
          f"thread(s), torch {prov['torch']})")
    for name, c in data["modules"].items():
        f, b = c["forward"], c["forward+backward"]
        print(f"{name:<34} forward {f['us']:6.1f} / {f['torch_us']:6.1f} us = {f['ratio']:.2f} "
              f"[{f['ratio_range'][0]:.2f}, {f['ratio_range'][1]:.2f}]   fwd+bwd {b['us']:6.1f} / "
              f"{b['torch_us']:6.1f} us = {b['ratio']:.2f} [{b['ratio_range'][0]:.2f}, {b['ratio_range'][1]:.2f}]")
    for where, st in data["stops"].items():
        print(f"stops of a LayerNorm forward, {where}: {st['functions']} functions in {st['files']} files: "
              + " -> ".join(st["path"]))
    print("the ways into the kernels, LayerNorm(4096) on one row, launch stubbed (us)")
    for name, row in data["entries"].items():
        print(f"{name:<50}" + "  ".join(f"{k} {v:6.1f}" for k, v in row.items()))
    prof = data["profile"]["cpu"]
    print(f"where the time goes, {prof['case']} (us, each stage timed alone)")
    for who in ("normlib_us", "torch_us"):
        print(f"  {who[:-3]:8s} " + ", ".join(f"{k} {v:.2f}" for k, v in prof[who].items()))
    for name in ("fused forward", "fused forward+backward"):
        print(f"  {name}, stubbed (cProfile, own time per call): "
              + ", ".join(f"{r['function']} {r['us']:.1f}" for r in data["profile"][name][:6]))
    print("host work of one fused call, launch stubbed")
    for name, c in data["cases"].items():
        print(f"{name:<44}{c['calls']:>6} calls {c['us']:8.1f} us  torch's call {c['torch_us']:7.1f} us  "
              f"ratio {c['ratio']:.2f} [{c['ratio_range'][0]:.2f}, {c['ratio_range'][1]:.2f}]")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
