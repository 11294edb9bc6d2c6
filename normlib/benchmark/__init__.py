"""The instruments: benchmarks and tuning tools that import normlib, and that normlib never imports.

One module per instrument, each with its own ``python -m`` entry:

* ``gpu`` (``python -m normlib.benchmark``): GB/s of the fused kernels against
  torch eager, ``torch.compile`` (and Liger-Kernel where it is installed) and a
  plain copy, on a CUDA GPU; its functions are re-exported here
  (``from normlib import benchmark; benchmark.report(record)``);
* ``cpu`` (``python -m normlib.benchmark --device cpu``): normlib's modules and
  reference math against ``torch.nn`` on the CPU;
* ``model`` (``python -m normlib.benchmark.model``): a whole training step;
* ``host`` (``python -m normlib.benchmark.host``): the host work of one call
  into the fused path;
* ``swap_cpu`` (``python -m normlib.benchmark.swap_cpu``): what a swapped norm
  costs on a CPU, and which faster CPU computations keep the model's numbers;
* ``crossover`` (``python -m normlib.benchmark.crossover``): the route's
  size table, ``normlib/ops/crossover.json``;
* ``tune`` (``python -m normlib.benchmark.tune``): the search behind the
  kernels' launch heuristic;
* ``resources`` (``python -m normlib.benchmark.resources``): registers, spills
  and shared memory of the kernels, compiled for a GPU that need not be here.

``_common`` holds what several of them share (the JSON writer, the records'
provenance, GPU warm-up and the timers).
"""

from .gpu import MODES, OPS, PROVIDERS, bytes_moved, main, plot, ratios, report, run, targets

__all__ = ["OPS", "MODES", "PROVIDERS", "bytes_moved", "run", "ratios", "targets", "report", "plot", "main"]
