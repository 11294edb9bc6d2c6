"""What the benchmarks share: the JSON writer, where-and-with-what records, GPU warm-up, timers.

Every instrument in :mod:`normlib.benchmark` writes a JSON record that says
where it was measured. Two kinds of record exist, and each keeps its fields:
:func:`environment` (GPU records: device, driver, CUDA, torch and Triton
versions, ISO date) and :func:`provenance` (CPU records: machine, CPU model,
threads, torch and Python versions, date, load average).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Callable

import torch

from .._cli import write_text


def write_json(data: dict, path: str, newline: bool = False) -> None:
    """Write ``data`` to ``path`` (indent 1) atomically (:func:`normlib._cli.write_text`), so that an
    interrupted or failed write leaves the last whole record and nothing beside it.

    ``newline`` ends the file with a newline (the host-overhead and crossover
    records have one; the others do not).
    """
    write_text(path, json.dumps(data, indent=1) + ("\n" if newline else ""))


def environment(device: str = "cuda") -> dict:
    """Device, driver, CUDA, torch and Triton versions, and the date (UTC): the GPU records' provenance."""
    import triton

    if device == "cuda":
        name = torch.cuda.get_device_name(0)
        try:
            driver = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, check=True, timeout=30,
            ).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            driver = "unknown"
    else:
        name, driver = f"{device} ({platform.machine()})", "none"
    return {
        "device": name,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> list | None:
    """The machine's load average over 1, 5 and 15 minutes (``None`` where the OS has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def provenance() -> dict:
    """Where and with what CPU numbers were measured: the CPU records' provenance."""
    return {
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "loadavg_before": loadavg(),
    }


def warm_up_gpu(seconds: float = 2.0) -> None:
    """Keep the GPU busy so its clocks have ramped up before the first timing (a cold GPU times slow)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()


# GPU timers: each returns median milliseconds of ``fn``; ``grad_to_none`` lists
# tensors whose ``.grad`` is cleared between calls.


def cuda_timer(fn: Callable[[], object], grad_to_none=None) -> float:
    """Median milliseconds of an eager call of ``fn``: ``triton.testing.do_bench`` (CUDA events, L2 flushed).

    This is what a caller sees: when launching ``fn`` from Python takes longer
    than the GPU work it queues, the time includes that launch cost.
    """
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=50, grad_to_none=grad_to_none, return_mode="median"))


def graph_timer(fn: Callable[[], object], grad_to_none=None, stream=None) -> float:
    """Median GPU milliseconds of ``fn``, captured once in a CUDA graph and replayed.

    Replaying leaves out Python's launch cost, so this is the time the GPU
    spends, the figure the bandwidth targets are about. ``do_bench`` still
    flushes the L2 cache before every replay. ``stream`` is the stream to
    capture on: a backward pass must be captured on the stream its forward
    pass ran on.
    """
    from triton.testing import do_bench

    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (and compile) outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    for t in grad_to_none or ():
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    ms = float(do_bench(graph.replay, warmup=10, rep=50, return_mode="median"))
    del graph
    return ms


def wall_timer(fn: Callable[[], object], grad_to_none=None, reps: int = 3, stream=None) -> float:
    """Median wall-clock milliseconds of ``fn``: for exercising the GPU machinery off the GPU only."""
    times = []
    for _ in range(reps + 1):
        for t in grad_to_none or ():
            t.grad = None
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


# CPU timers: seconds, the fastest of several calls.


def fastest(run: Callable[[], object], reps: int) -> float:
    """Seconds of the fastest of ``reps`` calls: load from other processes only ever adds time."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def reps_for(run: Callable[[], object], budget: float) -> int:
    """Calls per measurement, so that one takes about ``budget`` seconds (after a warm-up call); at least 2."""
    run()
    t = fastest(run, 1)
    return max(2, min(100, int(budget / max(t, 1e-6))))
