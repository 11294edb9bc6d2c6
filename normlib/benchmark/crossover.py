"""Measure where torch's native op or normlib's own path is faster, and write the route's crossover table.

Run it with::

    python -m normlib.benchmark.crossover --out normlib/ops/crossover.json                # CPU
    python -m normlib.benchmark.crossover --device cuda --out normlib/ops/crossover.json  # a GPU

On a GPU (``--device cuda``) the question is another one: whether a small
call (1 to 64 rows, as a decoding step makes) is done sooner by torch's own
op, checked as on CPU, than by normlib's kernels, each called from Python as a
model calls it. LayerNorm(4096) and RMSNorm(4096) forwards in bfloat16 are
timed on both paths over a ladder of row counts (wall time of a call,
the device synchronized once per batch of calls), and the result becomes the
``cuda`` entry's forward bands; the ``cpu`` entry and its provenance in the
file are kept.

For each op that has a native path (LayerNorm, RMSNorm, GroupNorm, BatchNorm in
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

import statistics
import sys
from typing import Callable, Optional

import torch

from .. import _cli, ops
from ..ops.routing import Path
from ..batchnorm import BatchNorm2d, InstanceNorm2d
from ..normalization import GroupNorm, LayerNorm, RMSNorm
from ._common import environment, fastest, provenance, reps_for, write_json

__all__ = ["LADDERS", "CUDA_LADDERS", "measure", "measure_cuda", "bands", "main"]

# (module factory, input shape for a scale k): element counts from ~10^3 to ~10^7
LADDERS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], tuple]]] = {
    "layer_norm": (lambda: LayerNorm(768), lambda k: (k, 768)),
    "rms_norm": (lambda: RMSNorm(768), lambda k: (k, 768)),
    "group_norm": (lambda: GroupNorm(8, 64), lambda k: (k, 64, 16, 16)),
    "batch_norm": (lambda: BatchNorm2d(64), lambda k: (max(k, 2), 64, 16, 16)),
    "batch_norm_eval": (lambda: BatchNorm2d(64).eval(), lambda k: (k, 64, 16, 16)),
    "instance_norm": (lambda: InstanceNorm2d(64, affine=True), lambda k: (k, 64, 16, 16)),
}
SCALES = (1, 4, 16, 64, 256)
# Row norms reach the sizes of a (32, 128, 768) activation (3.1M values), where the channel norms' ladders end.
ROW_SCALES = SCALES + (512, 1024, 2048, 4096)
MARGIN = 1.05

# On a GPU: the rows a decoding step (1 to 64) and a prefill or training step (4096) hand a norm.
CUDA_LADDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "layer_norm": lambda: LayerNorm(4096),
    "rms_norm": lambda: RMSNorm(4096),
}
CUDA_ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 4096)


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
        pair: tuple[Path, Path] = ("native", "reference")
        for path in pair:
            with ops.force_path(path):
                reps[path] = reps_for(run, budget)
        times: dict[str, list[float]] = {"native": [], "reference": []}
        for r in range(rounds):
            for path in (pair if r % 2 == 0 else pair[::-1]):
                with ops.force_path(path):
                    times[path].append(fastest(run, reps[path]))
        out[direction] = {p: statistics.median(t) for p, t in times.items()}
    return out


def _call_time(run: Callable[[], object], reps: int) -> float:
    """Seconds per call from Python: ``reps`` calls back to back, the device synchronized once after them."""
    import time

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def measure_cuda(op: str, rows: int, rounds: int = 7, reps: int = 100) -> dict:
    """Median seconds per forward call of ``op`` on ``rows`` bfloat16 rows: torch's op (checked) and the kernels."""
    module = CUDA_LADDERS[op]().to("cuda", torch.bfloat16)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)

    def run():
        with torch.no_grad():
            module(x)

    pair: tuple[Path, Path] = ("native", "fused")
    times: dict[str, list[float]] = {"native": [], "fused": []}
    for path in pair:
        with ops.force_path(path):
            run()
    for r in range(rounds):
        for path in (pair if r % 2 == 0 else pair[::-1]):
            with ops.force_path(path):
                times[path].append(_call_time(run, reps))
    return {"numel": x.numel(), "shape": list(x.shape), "forward": {p: statistics.median(t) for p, t in times.items()}}


def bands(points: list[dict], direction: str, own: str = "reference") -> list[list]:
    """``[[min_numel, path], ...]``: the faster path per measured size, merged; from 0 up.

    ``own`` is normlib's path that competes with torch's (``"reference"`` on CPU, ``"fused"`` on a GPU);
    it wins a size only by more than ``MARGIN`` on CPU, where torch's op is the default, and torch's op
    wins it only by as much on a GPU, where the kernels are.
    """
    result: list[list] = []
    for i, pt in enumerate(sorted(points, key=lambda p: p["numel"])):
        t = pt[direction]
        if own == "reference":
            path = "reference" if t["reference"] * MARGIN < t["native"] else "native"
        else:
            path = "native" if t["native"] * MARGIN < t[own] else own
        lo = 0 if i == 0 else pt["numel"]
        if not result or result[-1][1] != path:
            result.append([lo, path])
    return result


def _cuda_main(args) -> int:
    import json
    from pathlib import Path

    if not torch.cuda.is_available():
        print("crossover --device cuda: no CUDA device here; nothing measured", file=sys.stderr)
        return 2
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"provenance": provenance(), "routes": {}}
    data.setdefault("provenance_by_device", {})["cuda"] = environment("cuda")
    data.setdefault("measured_by_device", {})["cuda"] = {}
    data["routes"]["cuda"] = {}
    for op in CUDA_LADDERS:
        probe = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
        with ops.force_path("native"):
            if ops.route(op, probe) != "native":  # e.g. RMSNorm where this torch has no op returning its rstd
                print(f"{op:<12} torch has no op here that normlib can check: not measured", flush=True)
                continue
        pts = []
        for rows in CUDA_ROWS:
            print(f"... {op} {rows} x 4096 bf16", file=sys.stderr, flush=True)
            pts.append(measure_cuda(op, rows, args.rounds))
        data["measured_by_device"]["cuda"][op] = pts
        data["routes"]["cuda"][op] = {"forward": bands(pts, "forward", own="fused")}
        ratios = " ".join(f"{p['shape'][0]}:{p['forward']['native'] / p['forward']['fused']:.2f}" for p in pts)
        print(f"{op:<12} forward {data['routes']['cuda'][op]['forward']}  native/fused by rows: {ratios}")
    write_json(data, args.out, newline=True)
    return 0


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.benchmark.crossover``."""
    p = _cli.Parser(prog="python -m normlib.benchmark.crossover", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=_cli.output_file((".json",)), default="crossover.json", help="where to write the table")
    p.add_argument("--rounds", type=_cli.int_at_least(1, 1000), default=7, help="interleaved rounds per size (median taken)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="whose routes to measure")
    return p


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    if args.device == "cuda":
        return _cuda_main(args)
    data: dict = {"provenance": provenance(), "margin": MARGIN, "measured": {}, "routes": {"cpu": {}}}
    for op in LADDERS:
        pts = []
        for k in (ROW_SCALES if op in ("layer_norm", "rms_norm") else SCALES):
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
