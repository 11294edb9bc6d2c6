"""Measure where torch's native op or normlib's reference is faster, and write the route's crossover table.

Run it with::

    python -m normlib.benchmark.crossover --out normlib/ops/crossover.json

For each op that has a native path (LayerNorm, GroupNorm, BatchNorm in
training and in evaluation, InstanceNorm) and a ladder of input sizes, the normlib module is timed on
the ``"native"`` and on the ``"reference"`` path (:func:`normlib.ops.force_path`),
forward alone and forward + backward, interleaved round by round; the
faster path by median at each size becomes that size's band (adjacent sizes
with one answer merge). :func:`normlib.ops.routing.route` reads the table;
its provenance (machine, CPU, threads, versions, date) is written beside it.
A path wins a size only by more than 5 %: within that the native path
stands (it is torch.nn's own computation).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Callable, Optional

import torch

from .. import ops
from ..batchnorm import BatchNorm2d, InstanceNorm2d
from ..normalization import GroupNorm, LayerNorm
from ._common import fastest, provenance, reps_for, write_json

__all__ = ["LADDERS", "measure", "bands", "main"]

# (module factory, input shape for a scale k): element counts from ~10^3 to ~10^7
LADDERS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], tuple]]] = {
    "layer_norm": (lambda: LayerNorm(768), lambda k: (k, 768)),
    "group_norm": (lambda: GroupNorm(8, 64), lambda k: (k, 64, 16, 16)),
    "batch_norm": (lambda: BatchNorm2d(64), lambda k: (max(k, 2), 64, 16, 16)),
    "batch_norm_eval": (lambda: BatchNorm2d(64).eval(), lambda k: (k, 64, 16, 16)),
    "instance_norm": (lambda: InstanceNorm2d(64, affine=True), lambda k: (k, 64, 16, 16)),
}
SCALES = (1, 4, 16, 64, 256)
MARGIN = 1.05


def _runs(module, x, dy, grad: bool):
    params = list(module.parameters())

    def fwd():
        with torch.no_grad():
            module(x)

    def fwd_bwd():
        xg.grad = None
        for p in params:
            p.grad = None
        module(xg).backward(dy)

    xg = x.clone().requires_grad_()
    return fwd_bwd if grad else fwd


def measure(op: str, scale: int, rounds: int = 7, budget: float = 0.05) -> dict:
    """Median times (s) of the native and reference paths for ``op`` at ``scale``, forward and backward."""
    make, shape_of = LADDERS[op]
    module = make()
    x = torch.randn(shape_of(scale))
    dy = torch.randn(x.shape)
    out: dict = {"numel": x.numel(), "shape": list(x.shape)}
    for direction, grad in (("forward", False), ("backward", True)):
        run = _runs(module, x, dy, grad)
        reps = {}
        for path in ("native", "reference"):
            with ops.force_path(path):
                reps[path] = reps_for(run, budget)
        times: dict[str, list[float]] = {"native": [], "reference": []}
        for r in range(rounds):
            for path in (("native", "reference") if r % 2 == 0 else ("reference", "native")):
                with ops.force_path(path):
                    times[path].append(fastest(run, reps[path]))
        out[direction] = {p: statistics.median(t) for p, t in times.items()}
    return out


def bands(points: list[dict], direction: str) -> list[list]:
    """``[[min_numel, path], ...]``: the faster path per measured size, merged; from 0 up."""
    result: list[list] = []
    for i, pt in enumerate(sorted(points, key=lambda p: p["numel"])):
        t = pt[direction]
        path = "reference" if t["reference"] * MARGIN < t["native"] else "native"
        lo = 0 if i == 0 else pt["numel"]
        if not result or result[-1][1] != path:
            result.append([lo, path])
    return result


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normlib.benchmark.crossover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="crossover.json")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    data: dict = {"provenance": provenance(), "margin": MARGIN, "measured": {}, "routes": {"cpu": {}}}
    for op in LADDERS:
        pts = []
        for k in SCALES:
            print(f"... {op} x{k}", file=sys.stderr, flush=True)
            pts.append(measure(op, k, args.rounds))
        data["measured"][op] = pts
        data["routes"]["cpu"][op] = {d: bands(pts, d) for d in ("forward", "backward")}
    write_json(data, args.out, newline=True)
    for op, dirs in data["routes"]["cpu"].items():
        for d, b in dirs.items():
            ratios = [f"{p[d]['reference'] / p[d]['native']:.2f}" for p in data["measured"][op]]
            print(f"{op:<14}{d:<9}{b}  reference/native by size: {' '.join(ratios)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
