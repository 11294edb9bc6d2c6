"""Run a function in ``nproc`` fresh processes joined in one ``torch.distributed`` group.

    results = spawn(fn, nproc=2, args=(...,), backend="gloo", timeout=120)

Each child runs ``fn(rank, world_size, *args)`` after
``init_process_group`` and returns a picklable value; ``spawn`` returns the
values in rank order. The rules it keeps (the ones that make multi-process
code safe to run from a test or a notebook):

* **a free port, without a race**: the parent opens the rendezvous store
  (a ``TCPStore``) on port 0, so the operating system picks a free port, and
  the children connect to it;
* **children are started with "spawn"** (a fresh interpreter: no forked
  copies of the parent's threads or of a Jupyter kernel) and ``fn`` must be
  defined at module level, importable by its module name;
* **bounded time**: collectives time out after ``timeout`` seconds, and the
  parent stops waiting after ``timeout`` seconds too;
* **always reaped**: if a child raises, the others are terminated and the
  child's traceback is re-raised in the parent; on timeout every child is
  killed; the store and the result files are cleaned up in every case.
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn"]

HOST = "127.0.0.1"
_DONE = "normlib_launch_done"  # the store's count of ranks that are through


def _child(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: Sequence[Any],
    outdir: str,
    threads: int,
    timeout: float,
) -> None:
    # Several processes share the machine's cores: one thread each avoids oversubscription.
    torch.set_num_threads(threads)
    limit = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=limit)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=limit)
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        # A rank that failed leaves at once, its group left standing: a peer blocked in a
        # collective with it is released only by this process's exit (which closes its
        # connections), and waiting for that peer here would wait out the whole
        # timeout. Counting itself done (without waiting) lets peers that did finish
        # stop waiting in _all_done.
        _all_done(store, world_size, 0.0)
        raise
    try:
        # Written under a temporary name and renamed, so a half-written file is never read.
        path = os.path.join(outdir, f"rank{rank}.pt")
        torch.save(result, path + ".tmp")
        os.replace(path + ".tmp", path)
    finally:
        _all_done(store, world_size, min(timeout, 30.0))
        dist.destroy_process_group()


def _all_done(store: dist.Store, world_size: int, seconds: float) -> None:
    """Wait, at most ``seconds``, until every rank has finished its work.

    A rank that tears its process group down while a peer is still talking to
    it can make gloo abort the peer ("terminate called without an active
    exception"). The rendezvous goes through the store, not a collective, so
    it works even after a collective of the group failed or timed out.
    """
    store.add(_DONE, 1)
    deadline = time.monotonic() + seconds
    while store.add(_DONE, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.005)


def spawn(
    fn: Callable[..., Any],
    nproc: int,
    args: Sequence[Any] = (),
    *,
    backend: str = "gloo",
    timeout: float = 120.0,
    threads: int = 1,
) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` in ``nproc`` processes and return their results by rank.

    Args:
        fn: a module-level function (the children import it by name).
        nproc: number of processes (the group's world size).
        args: extra arguments, pickled to every child.
        backend: ``"gloo"`` (CPU tensors, and CUDA ones) or ``"nccl"`` (CUDA).
        timeout: seconds before a collective fails and before the parent gives up.
        threads: ``torch.set_num_threads`` in each child.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a child raised (its
            traceback is in the message); the other children were terminated.
        TimeoutError: the children did not finish within ``timeout`` seconds;
            all of them were killed.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1 (got {nproc})")
    limit = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(HOST, 0, None, True, timeout=limit, wait_for_workers=False)
    outdir = tempfile.mkdtemp(prefix="normlib_spawn_")
    context = None
    try:
        context = mp.start_processes(
            _child,
            args=(nproc, store.port, backend, fn, tuple(args), outdir, threads, timeout),
            nprocs=nproc,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        # join() raises if a child failed, after terminating the others.
        while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{nproc} processes running {getattr(fn, '__name__', fn)} did not finish "
                    f"within {timeout:g} s; they were killed"
                )
        return [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(nproc)]
    finally:
        if context is not None:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
        del store
        shutil.rmtree(outdir, ignore_errors=True)
