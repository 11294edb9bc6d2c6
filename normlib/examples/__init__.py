"""Runnable examples: ``python -m normlib.examples.<name> --help``.

* :mod:`normlib.examples.sync_bn`: data-parallel training of a small CNN with
  :class:`normlib.SyncBatchNorm` on CPU processes (gloo), checked against one
  process training on the whole batch; also runs under ``torchrun``.
* :mod:`normlib.examples.launch`: the small launcher it uses, ``spawn(fn,
  nproc, ...)``: processes on 127.0.0.1 with a free port, a bounded wait, and
  every child reaped.

Nothing here is imported by ``import normlib``.
"""
