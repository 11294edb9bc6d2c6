"""What a swapped norm costs on a CPU, and which faster CPU computations would keep the model's numbers.

Run it with::

    python -m normlib.benchmark.swap_cpu --out book/data/swap_cpu.json

On a CPU a module swapped by :func:`normlib.swap_norms` runs its class's own
``forward``, so that the model computes exactly what it computed before. This
instrument measures what that costs and what it leaves on the table. For
``torch.nn.RMSNorm`` and ``torch.nn.LayerNorm`` at shapes from a few rows to
(8, 512, 768), in float32 and bfloat16, forward + backward of each candidate is
timed against the module itself, interleaved round by round (the fastest of a
few calls each, since load only adds time; the ratio formed within the round,
its median and range over the rounds reported):

* ``swapped``: the module after :func:`normlib.swap_norms`;
* ``torch fused op``: ``torch._fused_rms_norm`` (RMSNorm, where this torch has
  it), torch's single-kernel forward with a backward of its own;
* ``normlib``: normlib's module of the same name (the path
  :func:`normlib.ops.routing.route` picks on CPU: torch's op with its
  statistics checked, or normlib's reference math).

For each candidate the record says whether its output and the gradients of
the input and γ (β) are the module's bit for bit: a swap may only take a
faster computation where they are. The JSON records the machine, CPU model,
thread count, versions, date and load average.
"""

from __future__ import annotations

import copy
import statistics
import sys
from typing import Callable, Optional

import torch
from torch import nn

from .. import _cli
from ..normalization import LayerNorm, RMSNorm
from ..ops import native
from ..interop.swap import swap_norms
from ._common import fastest, loadavg, provenance, reps_for, write_json

__all__ = ["SHAPES", "DTYPES", "measure", "main"]

SHAPES = [(4, 768), (64, 768), (8, 128, 768), (8, 512, 768), (2, 128, 4096)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _candidates(norm: str, d: int, dtype: torch.dtype) -> dict[str, nn.Module]:
    """name -> a module of x, each with its own parameters, equal to the module's (γ, β away from 1, 0)."""
    torch.manual_seed(0)
    module: nn.Module = nn.RMSNorm(d, eps=1e-6) if norm == "RMSNorm" else nn.LayerNorm(d, eps=1e-6)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    module = module.to(dtype)
    swapped = copy.deepcopy(module)
    swap_norms(swapped, warn=False)
    ours = (RMSNorm(d, eps=1e-6) if norm == "RMSNorm" else LayerNorm(d, eps=1e-6)).to(dtype)
    ours.load_state_dict(module.state_dict())
    out: dict[str, nn.Module] = {"module": module, "swapped": swapped, "normlib": ours}
    if isinstance(module, nn.RMSNorm) and native.HAS_RMS_NORM:
        out["torch fused op"] = _FusedOp(copy.deepcopy(module))
    return out


class _FusedOp(nn.Module):
    def __init__(self, m: nn.RMSNorm) -> None:
        super().__init__()
        self.m = m

    def forward(self, x):
        m = self.m
        return torch._fused_rms_norm(x, m.normalized_shape, m.weight, m.eps)[0]


def _step(fn: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], tuple]:
    params = list(fn.parameters())

    def run():
        for p in params:
            p.grad = None
        xx = x.detach().requires_grad_()
        y = fn(xx)
        y.backward(dy)
        return (y.detach(), xx.grad, *(p.grad for p in params))
    return run


def _case(norm: str, shape: tuple, dtype: torch.dtype, rounds: int, budget: float) -> dict:
    cands = _candidates(norm, shape[-1], dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).to(dtype)
    dy = torch.randn(shape, generator=g).to(dtype)
    steps = {name: _step(fn, x, dy) for name, fn in cands.items()}
    want = steps["module"]()
    same = {name: all(torch.equal(a, b) for a, b in zip(want, run())) for name, run in steps.items() if name != "module"}
    reps = reps_for(steps["module"], budget)
    ratios: dict[str, list] = {name: [] for name in steps if name != "module"}
    module_s = []
    for _ in range(rounds):
        t = {name: fastest(run, reps) for name, run in steps.items()}
        module_s.append(t["module"])
        for name in ratios:
            ratios[name].append(t[name] / t["module"])
    return {
        "module_us": statistics.median(module_s) * 1e6,
        "candidates": {
            name: {"ratio": statistics.median(r), "ratio_range": [min(r), max(r)], "bitwise": same[name]}
            for name, r in ratios.items()
        },
    }


def measure(rounds: int = 9, budget: float = 0.05, shapes: Optional[list] = None) -> dict:
    """The record: per norm, dtype and shape, the module's time and each candidate's ratio and bitwise flag."""
    data: dict = {"provenance": provenance(), "rounds": rounds, "cases": {}}
    for norm in ("RMSNorm", "LayerNorm"):
        for dname, dtype in DTYPES.items():
            for shape in shapes or SHAPES:
                data["cases"][f"{norm} {dname} {tuple(shape)}"] = _case(norm, tuple(shape), dtype, rounds, budget)
    data["provenance"]["loadavg_after"] = loadavg()
    return data


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.benchmark.swap_cpu``."""
    p = _cli.Parser(prog="python -m normlib.benchmark.swap_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=_cli.output_file((".json",)), default="swap_cpu.json",
                   help="where to write the JSON record")
    p.add_argument("--rounds", type=_cli.int_at_least(1, 1000), default=9, help="interleaved rounds (median taken)")
    p.add_argument("--budget", type=_cli.positive_float(60.0), default=0.05,
                   help="seconds per measurement of the module (calls per measurement follow from it)")
    return p


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    data = measure(args.rounds, args.budget)
    write_json(data, args.out, newline=True)
    prov = data["provenance"]
    print(f"forward + backward on CPU, each candidate / the torch.nn module, median [range] over {args.rounds} "
          f"rounds; = : output and gradients bit for bit ({prov['cpu_model']}, {prov['threads']} thread(s), "
          f"torch {prov['torch']})")
    for name, c in data["cases"].items():
        print(f"{name:<32} {c['module_us'] / 1e3:8.3f} ms  " + "  ".join(
            f"{cand} {v['ratio']:.2f} [{v['ratio_range'][0]:.2f}, {v['ratio_range'][1]:.2f}]{' =' if v['bitwise'] else ' ≠'}"
            for cand, v in c["candidates"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
