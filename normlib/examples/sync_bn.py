"""Data-parallel training with normlib.SyncBatchNorm on CPU processes, checked and timed.

    python -m normlib.examples.sync_bn --nproc 2
    torchrun --standalone --nproc-per-node 2 -m normlib.examples.sync_bn

Every process builds the same small CNN (two ``torch.nn.BatchNorm2d`` layers),
holds ``--per-rank`` samples of each global batch, and trains with
``DistributedDataParallel`` over the gloo backend. Three things are reported
(by rank 0; ``--json PATH`` also writes them to a file):

1. **sync = one process on the whole batch** (float64): after
   ``SyncBatchNorm.convert_sync_batchnorm`` the parameters and running
   statistics after ``--steps`` SGD steps equal those of one process training
   the unconverted model on the concatenated batches.
2. **no sync = per-device statistics** (float64): plain DDP, where each process
   normalizes with its own slice's statistics, equals one process running
   :class:`PerDeviceBatchNorm2d`, which normalizes each slice of the batch
   separately; and it differs from training on the whole batch.
3. **what synchronising costs** (float32): the SyncBatchNorm collectives of
   one training step and the bytes each process hands to them (counted by
   intercepting ``torch.distributed.all_gather``/``all_reduce``; DDP's own
   gradient all-reduce runs in C++ and is not counted), and the time per step
   with and without synchronisation, interleaved, as medians and their ratio.

Rank 0 also reports what ``torch.nn.SyncBatchNorm`` says when given CPU
tensors in the same process group. Outputs 1-2 are deterministic; the timings
of 3 are not.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import _cli
from ..distributed import DistributedDataParallel, SyncBatchNorm

__all__ = [
    "make_data",
    "make_model",
    "PerDeviceBatchNorm2d",
    "convert_per_device",
    "sgd_step",
    "train",
    "main",
]

CLASSES = 4
SIZE = 8  # images are 1 x SIZE x SIZE


def _templates() -> torch.Tensor:
    """Four 8 x 8 class patterns: a horizontal bar, a vertical bar, a diagonal, a square ring."""
    t = torch.zeros(CLASSES, SIZE, SIZE)
    t[0, 3:5, 1:7] = 1
    t[1, 1:7, 3:5] = 1
    for i in range(1, 7):
        t[2, i, i] = t[2, i, min(i + 1, 6)] = 1
    t[3, 1:7, 1] = t[3, 1:7, 6] = t[3, 1, 1:7] = t[3, 6, 1:7] = 1
    return t


def make_data(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` labelled images ``(n, 1, 8, 8)``: a class pattern, shifted by up to one pixel,
    with a per-image contrast and brightness and pixel noise. Deterministic in ``seed``.

    The per-image brightness (an offset shared by all pixels of an image) makes
    the pixels of one image correlated, as in real data: a channel's statistics
    then depend mostly on *how many images* a batch holds, not on how many pixels.
    """
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    shift = torch.randint(0, 9, (n,), generator=g)  # one of the 3 x 3 shifts by -1, 0, +1 pixels
    x = _shifted_templates()[y, shift]  # (n, 8, 8)
    contrast = 0.5 + torch.rand(n, 1, 1, generator=g)
    brightness = 0.7 * torch.randn(n, 1, 1, generator=g)
    x = contrast * x + brightness + 0.3 * torch.randn(n, SIZE, SIZE, generator=g)
    return x.unsqueeze(1).to(dtype), y  # (n, 1, 8, 8), (n,)


def _shifted_templates() -> torch.Tensor:
    """(CLASSES, 9, 8, 8): each template rolled by (dy, dx) in {-1, 0, 1}^2."""
    t = _templates()
    shifts = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
    return torch.stack([torch.roll(t, s, dims=(1, 2)) for s in shifts], dim=1)


def make_model(norm: str = "batch", seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """A small CNN for ``make_data``: two conv layers, each followed by a norm and ReLU.

    ``norm``: ``"batch"`` (``torch.nn.BatchNorm2d``) or ``"group"``
    (``torch.nn.GroupNorm`` with 4 groups), the same weights either way.
    """

    def norm_layer(c):
        return nn.BatchNorm2d(c) if norm == "batch" else nn.GroupNorm(4, c)

    if norm not in ("batch", "group"):
        raise ValueError(f"norm must be 'batch' or 'group' (got {norm!r})")
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, bias=False),  # (N, 16, 8, 8)
        norm_layer(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, stride=2, bias=False),  # (N, 32, 4, 4)
        norm_layer(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),  # (N, 32)
        nn.Linear(32, CLASSES),
    )
    return model.to(dtype)


class PerDeviceBatchNorm2d(nn.BatchNorm2d):
    """What ``devices`` processes of DDP with plain BatchNorm compute, in one process.

    In training the batch is cut into ``devices`` equal consecutive slices
    (rank ``r`` holds slice ``r``) and each slice is normalized with its own
    statistics: per-device BatchNorm, which is also "ghost batch" BatchNorm
    with ghost batches of ``N / devices`` samples. The running statistics are
    updated from slice 0 only, because DDP (``broadcast_buffers=True``, the
    default) copies rank 0's buffers to every rank before each forward.
    Evaluation is plain BatchNorm with the running statistics.
    """

    def __init__(self, num_features: int, devices: int, **kwargs: Any) -> None:
        super().__init__(num_features, **kwargs)
        self.devices = devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        if x.shape[0] % self.devices:
            raise ValueError(f"batch of {x.shape[0]} does not split into {self.devices} equal slices")
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is not None:
            momentum = self.momentum
        elif self.num_batches_tracked is not None:
            momentum = 1.0 / float(self.num_batches_tracked)
        else:  # momentum=None without running statistics: nothing to average, as in torch
            momentum = 0.0
        outs = []
        for r, xs in enumerate(x.chunk(self.devices)):  # xs: (N / devices, C, H, W)
            track = r == 0 and self.track_running_stats
            outs.append(
                F.batch_norm(
                    xs,
                    self.running_mean if track else None,
                    self.running_var if track else None,
                    self.weight,
                    self.bias,
                    True,
                    momentum,
                    self.eps,
                )
            )
        return torch.cat(outs)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", devices={self.devices}"


def convert_per_device(module: nn.Module, devices: int) -> nn.Module:
    """Replace each ``nn.BatchNorm2d`` in ``module`` by a :class:`PerDeviceBatchNorm2d`, in place,
    keeping its parameters and buffers."""
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm2d:
            new = PerDeviceBatchNorm2d(child.num_features, devices, eps=child.eps, momentum=child.momentum)
            new.weight, new.bias = child.weight, child.bias
            new.running_mean, new.running_var = child.running_mean, child.running_var
            new.num_batches_tracked = child.num_batches_tracked
            setattr(module, name, new)
        else:
            convert_per_device(child, devices)
    return module


def batches(step: int, global_batch: int, seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch number ``step``: the same on every process."""
    return make_data(global_batch, seed=seed * 100_003 + step, dtype=dtype)


def sgd_step(params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], lr: float, momentum: float = 0.9) -> None:
    """``torch.optim.SGD(lr=lr, momentum=momentum)``'s update, written out:
    ``buf = momentum * buf + grad; p -= lr * buf`` (``buf`` starts at 0)."""
    with torch.no_grad():
        for p, buf in zip(params, buffers):
            if p.grad is None:
                raise ValueError("sgd_step: a parameter has no gradient (run backward first)")
            buf.mul_(momentum).add_(p.grad)
            p.sub_(lr * buf)


def train(
    model: nn.Module,
    steps: int,
    global_batch: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    lr: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    first_step: int = 0,
    data: list | None = None,
    cosine: bool = False,
) -> list[float]:
    """SGD with momentum 0.9 on ``steps`` global batches; this process trains on its slice.

    The loss is the mean over the process's slice; DDP averages the gradients
    over processes, so with equal slices that is the mean over the global batch.
    ``data`` (optional) holds the global batches already made; ``cosine``
    decays the learning rate from ``lr`` to 0 along a half cosine. Returns this
    process's loss at each step. (The SGD update is written out because
    ``torch.optim`` takes seconds to import on a small CPU.)
    """
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [torch.zeros_like(p) for p in params]
    per_rank = global_batch // world_size
    losses = []
    model.train()
    for i, step in enumerate(range(first_step, first_step + steps)):
        x, y = data[i] if data is not None else batches(step, global_batch, seed, dtype)
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        for p in params:
            p.grad = None
        loss = F.cross_entropy(model(xs), ys)
        loss.backward()
        sgd_step(params, buffers, lr * (0.5 + 0.5 * math.cos(math.pi * i / steps)) if cosine else lr)
        losses.append(loss.item())
    return losses


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    model = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"different state_dict keys: {sorted(a)} vs {sorted(b)}")
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@contextlib.contextmanager
def _count_collectives(log: list) -> Iterator[None]:
    """Record (name, bytes this rank sends) of the Python-level all_gather/all_reduce calls."""
    originals = {name: getattr(dist, name) for name in ("all_gather", "all_reduce")}

    def wrap(name):
        def call(*args, **kwargs):
            tensor = args[1] if name == "all_gather" else args[0]
            log.append((name, tensor.numel() * tensor.element_size()))
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def run(rank: int, world_size: int, cfg: dict) -> dict:
    """The experiments, in one process of the group (rank 0 also runs the one-process references)."""
    DDP = DistributedDataParallel  # torch's, letting normlib's SyncBatchNorm run on CPU
    out: dict[str, Any] = {"world_size": world_size, "per_rank": cfg["per_rank"]}
    global_batch = cfg["per_rank"] * world_size
    f64 = torch.float64

    # 0. torch.nn.SyncBatchNorm in the same group, on CPU tensors (it raises before communicating).
    try:
        nn.SyncBatchNorm(2)(torch.randn(4, 2))
        out["torch_sync_bn_on_cpu"] = "no error"
    except ValueError as e:
        out["torch_sync_bn_on_cpu"] = f"ValueError: {e}"

    # 1-2. float64: synchronised and per-device training against one process.
    base = make_model(seed=cfg["seed"], dtype=f64)
    synced = DDP(SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base)))
    local = DDP(copy.deepcopy(base))
    kw = dict(rank=rank, world_size=world_size, seed=cfg["seed"], dtype=f64)
    out["loss_sync"] = train(synced, cfg["steps"], global_batch, **kw)
    out["loss_local"] = train(local, cfg["steps"], global_batch, **kw)
    if rank == 0:
        whole = copy.deepcopy(base)
        per_device = convert_per_device(copy.deepcopy(base), world_size)
        kw1 = dict(seed=cfg["seed"], dtype=f64)
        out["loss_whole"] = train(whole, cfg["steps"], global_batch, **kw1)
        train(per_device, cfg["steps"], global_batch, **kw1)
        out["sync_vs_whole"] = _max_diff(_state(synced), _state(whole))
        out["local_vs_per_device"] = _max_diff(_state(local), _state(per_device))
        out["local_vs_whole"] = _max_diff(_state(local), _state(whole))

    # 3. float32: collectives of one step, then time per step with and without sync.
    if cfg["time_steps"] > 0:
        b = cfg["time_batch"]
        base = make_model(seed=cfg["seed"])
        models = {
            "sync": DDP(SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base))),
            "local": DDP(copy.deepcopy(base)),
        }
        first: list = []
        log: list = []
        with _count_collectives(first):  # the first step also checks the layers agree across ranks
            train(models["sync"], 1, b * world_size, rank=rank, world_size=world_size)
        with _count_collectives(log):
            train(models["sync"], 1, b * world_size, rank=rank, world_size=world_size)
        out["collectives_first_step"] = first
        out["collectives"] = log
        out["gradient_bytes"] = sum(p.numel() * p.element_size() for p in base.parameters())
        out["bn_channels"] = [m.num_features for m in base.modules() if isinstance(m, nn.BatchNorm2d)]
        times: dict[str, list[float]] = {"sync": [], "local": []}
        warmup = 3
        for step in range(warmup + cfg["time_steps"]):
            data = [batches(step, b * world_size, cfg["seed"], torch.float32)]
            for name, model in models.items():
                dist.barrier()
                t0 = time.perf_counter()
                train(model, 1, b * world_size, rank=rank, world_size=world_size, data=data)
                if step >= warmup:
                    times[name].append(time.perf_counter() - t0)
        out["ms_per_step"] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        out["time_batch"] = b
        out["torch"] = torch.__version__
        out["threads"] = torch.get_num_threads()
    return out


def report(res: dict) -> str:
    """The human-readable summary that rank 0 prints."""
    W, b = res["world_size"], res["per_rank"]
    lines = [
        f"torch.nn.SyncBatchNorm on CPU tensors with gloo: {res['torch_sync_bn_on_cpu']}",
        f"{W} processes x {b} samples each (global batch {W * b}), float64, "
        f"{len(res['loss_sync'])} SGD steps:",
        f"  SyncBatchNorm == one process on the whole batch: "
        f"max |difference| of parameters and running statistics = {res['sync_vs_whole']:.1e}",
        f"  plain BatchNorm (per-process statistics) == one process with per-device slices: "
        f"max |difference| = {res['local_vs_per_device']:.1e}",
        f"  plain BatchNorm vs the whole batch: max |difference| = {res['local_vs_whole']:.2g}",
    ]
    if "ms_per_step" in res:
        ms = res["ms_per_step"]
        n_bytes = sum(n for _, n in res["collectives"])
        lines += [
            f"SyncBatchNorm collectives in one training step: {len(res['collectives'])} "
            f"({', '.join(name for name, _ in res['collectives'])}), "
            f"payload {n_bytes} bytes per process",
            f"time per step, float32, {res['time_batch']} samples per process "
            f"(median; torch {res['torch']}, {res['threads']} thread per process): "
            f"sync {ms['sync']:.2f} ms, no sync {ms['local']:.2f} ms, ratio {ms['sync'] / ms['local']:.2f}",
        ]
    return "\n".join(lines)


def parser() -> _cli.Parser:
    """The command line of ``python -m normlib.examples.sync_bn``."""
    p = _cli.Parser(
        prog="python -m normlib.examples.sync_bn",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=_cli.int_at_least(1, 64), default=2, help="processes to spawn (ignored under torchrun)")
    p.add_argument("--per-rank", type=_cli.int_at_least(1, 4096), default=4, help="samples per process per step")
    p.add_argument("--steps", type=_cli.int_at_least(1, 100000), default=10, help="float64 training steps compared")
    p.add_argument("--time-steps", type=_cli.int_at_least(0, 100000), default=20,
                   help="timed steps of each kind (0: no timing)")
    p.add_argument("--time-batch", type=_cli.int_at_least(1, 4096), default=32,
                   help="samples per process in the timed steps")
    p.add_argument("--seed", type=_cli.int_at_least(0, 2**32 - 1), default=0, help="seed of the data and the weights")
    p.add_argument("--timeout", type=_cli.positive_float(86400.0), default=300.0, help="seconds before giving up")
    p.add_argument("--json", metavar="PATH", type=_cli.output_file((".json",)),
                   help="also write rank 0's results here (checked before any process starts)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("per_rank", "steps", "time_steps", "time_batch", "seed")}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        try:
            res = run(dist.get_rank(), dist.get_world_size(), cfg)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return res
    else:
        from normlib.examples import sync_bn  # `run` by its importable name, also under `python -m`

        from .launch import spawn

        res = spawn(sync_bn.run, args.nproc, (cfg,), timeout=args.timeout)[0]
    print(report(res))
    if args.json:
        _cli.write_text(args.json, json.dumps(res, indent=1))
    return res


def _command(argv: list[str] | None = None) -> int:
    """``python -m normlib.examples.sync_bn``: :func:`main`, with a run that did not finish in ``--timeout``
    seconds reported in one line (exit status 1)."""
    try:
        main(argv)
    except TimeoutError as e:
        return _cli.fail("python -m normlib.examples.sync_bn", str(e), status=1)
    return 0


if __name__ == "__main__":
    sys.exit(_command())
