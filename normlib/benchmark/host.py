"""What a call into the fused path costs the host before its kernel starts: timed on CPU with the launch stubbed.

Run it with::

    python -m normlib.benchmark.host --out book/data/host_overhead.json

On a GPU a norm's kernel runs in microseconds; what the caller waits for
from Python is everything before the launch: argument checks, the routing
decision, allocations, the autograd Function, the launch heuristic. This
tool measures exactly that part on any machine: the route is forced onto
the fused path for CPU tensors and the two Triton kernels are replaced by
stubs that return at once, so a call does all its host work and no
device work. Two figures per case:

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

import argparse
import contextlib
import os
import statistics
import sys
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as TF

from .. import ops
from ..normalization import LayerNorm, RMSNorm
from ..ops import routing
from ._common import fastest, provenance, write_json

__all__ = ["CASES", "stubbed_launch", "count_calls", "measure", "main"]


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
                              getattr(getattr(triton.runtime, "interpreter", None), "InterpretedFunction", None))
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
        "LayerNorm(4096) forward+backward, 64 rows": ln(64, True),
        "RMSNorm(4096) forward, 1 row": rms(1),
        "add_rms_norm(4096) forward, 1 row": add_rms(1),
    }


CASES = list(_cases())


def measure(rounds: int = 15, reps: int = 200) -> dict:
    """Calls and interleaved median times of every case, with and against torch's eager call."""
    out: dict = {"provenance": provenance(), "rounds": rounds, "reps": reps, "cases": {}}
    torch.set_grad_enabled(True)
    for name, (ours_f, theirs_f) in _cases().items():
        with torch.no_grad() if "backward" not in name else contextlib.nullcontext():
            with stubbed_launch():
                ours = ours_f()
                calls = count_calls(ours)
            theirs = theirs_f()
            t_ours: list[float] = []
            t_theirs: list[float] = []
            for r in range(rounds):
                for who in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
                    if who == "ours":
                        with stubbed_launch():
                            t_ours.append(fastest(ours, reps))
                    else:
                        t_theirs.append(fastest(theirs, reps))
        ratios = [a / b for a, b in zip(t_ours, t_theirs)]
        out["cases"][name] = {
            "calls": calls,
            "us": 1e6 * statistics.median(t_ours),
            "torch_us": 1e6 * statistics.median(t_theirs),
            "ratio": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
        }
    return out


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normlib.benchmark.host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="host_overhead.json")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    data = measure(args.rounds)
    write_json(data, args.out, newline=True)
    print(f"host work of one call, launch stubbed ({data['provenance']['cpu_model']}, torch {data['provenance']['torch']})")
    for name, c in data["cases"].items():
        print(f"{name:<44}{c['calls']:>6} calls {c['us']:8.1f} us  torch's call {c['torch_us']:7.1f} us  "
              f"ratio {c['ratio']:.2f} [{c['ratio_range'][0]:.2f}, {c['ratio_range'][1]:.2f}]")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
