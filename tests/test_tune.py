"""The launch-configuration search of ``normlib.benchmark.tune``, exercised on CPU through the interpreter.

On a GPU it times real kernels; here a wall-clock timer stands in, and what is
tested is the machinery: every variant is checked against the default
configuration's output, an output the kernel did not write is caught, and the
search returns the default and a best configuration.
"""

import os
import time

import pytest
import torch

from normlib import ops

pytestmark = [
    pytest.mark.interpreter,
    pytest.mark.skipif(not ops.HAS_TRITON, reason="Triton is not installed"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"),
]


def _wall(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_search_checks_and_times_variants(op, direction, monkeypatch):
    from normlib.ops import _kernels as K
    from normlib.benchmark import tune

    monkeypatch.setattr(tune, "_candidates", lambda d, key, cfg, N: {"num_warps": [1, 2], "rows": [1, 2],
                                                                     "programs_per_sm": [1, 4], "num_stages": [1, 2]}[key])
    case = tune.Case(op, "fp32", 6, 40, device="cpu")
    recs = tune.search(case, K, direction, log=lambda s: None, timer=_wall)
    assert all(r["correct"] for r in recs)
    assert sum(r["default"] for r in recs) == 1 and sum(r["best"] for r in recs) == 1
    assert {r["direction"] for r in recs} == {direction}


def test_search_catches_an_unwritten_output(monkeypatch):
    from normlib.ops import _kernels as K
    from normlib.benchmark import tune

    real = K.norm_fwd

    def skips_last_row(x, residual, weight, bias, eps, is_rms, config=None):
        if not config or config.get("rows") != 2:
            return real(x, residual, weight, bias, eps, is_rms, config=config)
        y, res, mean, rstd = real(x[:-1], residual, weight, bias, eps, is_rms, config=config)
        out = torch.full((x.shape[0], x.shape[1]), float("nan"))
        out[:-1] = y
        return out, res, torch.cat([mean, mean[:1]]), torch.cat([rstd, rstd[:1]])

    monkeypatch.setattr(K, "norm_fwd", skips_last_row)
    monkeypatch.setattr(tune, "_candidates", lambda d, key, cfg, N: {"num_warps": [1], "rows": [1, 2]}[key])
    recs = tune.search(tune.Case("layer_norm", "fp32", 5, 16, device="cpu"), K, "fwd", log=lambda s: None, timer=_wall)
    wrong = [r for r in recs if not r["correct"]]
    assert [r["config"]["rows"] for r in wrong] == [2]
    assert not any(r["best"] for r in wrong)
