"""normlib.SyncBatchNorm: statistics over several processes (gloo on CPU; nccl on a GPU).

The multi-process checks run in few launches (starting a process that imports
torch costs seconds on a small CPU): each launch runs a list of jobs in every
process and returns their results, which the test compares with one process
running ``nl.BatchNorm*`` on the concatenated batch. Every launch goes through
``normlib.examples.launch.spawn``: a free port picked by the OS, a bounded
wait, children reaped even when one of them fails.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import normlib as nl
from normlib.distributed import SyncBatchNormFunction, _raise_if_mismatched, combine_moments, local_moments
from normlib.examples.launch import spawn
from normlib.testing.tolerance import close

TOL = {dtype: close(dtype) for dtype in (torch.float64, torch.float32)}
TIMEOUT = 240  # seconds for a whole launch; a healthy one takes a few


# ----------------------------------------------------------------------------
# Data shared by the workers and the single-process references
# ----------------------------------------------------------------------------


def _full_batch(case: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated batch of one step and its upstream gradient (float64, then cast)."""
    g = torch.Generator().manual_seed(1000 * case["seed"] + step)
    shape = (sum(case["sizes"]), case["C"]) + tuple(case["tail"])
    offset = torch.randn(1, case["C"], *([1] * len(case["tail"])), generator=g, dtype=torch.float64)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + case.get("offset", 1.0) * offset
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(case["dtype"]), dy.to(case["dtype"])


def _slice(t: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t[start : start + sizes[rank]]


def _module_kwargs(case: dict) -> dict:
    return dict(
        eps=case.get("eps", 1e-5),
        momentum=case.get("momentum", 0.1),
        affine=case.get("affine", True),
        track_running_stats=case.get("track", True),
        dtype=case["dtype"],
    )


def _init_affine(m: nn.Module, case: dict) -> None:
    if m.weight is not None:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            m.weight.copy_(torch.rand(case["C"], generator=g, dtype=torch.float64) + 0.5)
            m.bias.copy_(torch.randn(case["C"], generator=g, dtype=torch.float64))


def _run_steps(m: nn.Module, case: dict, rank: int | None) -> dict:
    """Training steps (then one eval step); ``rank=None`` runs the whole batch in one process."""
    _init_affine(m, case)
    out = {"y": [], "dx": [], "dw": [], "db": []}
    for step in range(case["steps"]):
        x, dy = _full_batch(case, step)
        if rank is not None:
            x, dy = _slice(x, case["sizes"], rank), _slice(dy, case["sizes"], rank)
        x = x.clone().requires_grad_()
        if m.weight is not None:
            m.weight.grad = m.bias.grad = None
        y = m(x)
        y.backward(dy)
        out["y"].append(y.detach())
        out["dx"].append(x.grad)
        out["dw"].append(None if m.weight is None else m.weight.grad.clone())
        out["db"].append(None if m.bias is None else m.bias.grad.clone())
    m.eval()
    x, _ = _full_batch(case, case["steps"])
    out["eval"] = m(x if rank is None else _slice(x, case["sizes"], rank)).detach()
    out["state"] = {k: v.clone() for k, v in m.state_dict().items()}
    return out


def _reference_module(case: dict) -> nn.Module:
    ndim = 2 + len(case["tail"])
    cls = nl.BatchNorm2d if ndim == 4 else nl.BatchNorm1d
    return cls(case["C"], **_module_kwargs(case))


def _check_against_reference(results: list[dict], case: dict) -> None:
    """The ranks' results together equal one nl.BatchNorm on the concatenated batch."""
    ref = _run_steps(_reference_module(case), case, None)
    tol = TOL[case["dtype"]]
    for step in range(case["steps"]):
        for key in ("y", "dx"):
            got = torch.cat([r[key][step] for r in results])
            torch.testing.assert_close(got, ref[key][step], **tol, msg=lambda m: f"{key}, step {step}: {m}")
        for key in ("dw", "db"):  # each rank holds its share; a data-parallel wrapper sums them
            if ref[key][step] is None:
                assert all(r[key][step] is None for r in results)
                continue
            got = sum(r[key][step] for r in results)
            torch.testing.assert_close(got, ref[key][step], **tol, msg=lambda m: f"{key}, step {step}: {m}")
    # Running statistics: every rank holds those of the whole batch (unbiased variance, global count).
    for rank, r in enumerate(results):
        assert r["state"].keys() == ref["state"].keys()
        for k, v in ref["state"].items():
            if k == "num_batches_tracked":
                assert torch.equal(r["state"][k], v), (rank, k)
            else:
                torch.testing.assert_close(r["state"][k], v, **tol, msg=lambda m: f"rank {rank}, {k}: {m}")
    # Evaluation: each rank normalizes its own slice with the running statistics (no communication).
    torch.testing.assert_close(torch.cat([r["eval"] for r in results]), ref["eval"], **tol)


# ----------------------------------------------------------------------------
# Jobs: module-level functions that the spawned processes import by name
# ----------------------------------------------------------------------------


def job_compare(rank: int, world: int, case: dict) -> dict:
    m = nl.SyncBatchNorm(case["C"], **_module_kwargs(case))
    return _run_steps(m, case, rank)


def job_expect_error(rank: int, world: int, case: dict) -> str:
    """A case that must raise a ValueError on every rank (and not hang)."""
    C = case["C"][rank] if isinstance(case["C"], list) else case["C"]
    m = nl.SyncBatchNorm(C, dtype=torch.float64)
    x = torch.randn(case["sizes"][rank], C, *case["tail"], dtype=torch.float64)
    try:
        m(x)
    except ValueError as e:
        return str(e)
    return "no error"


def job_constant_channel(rank: int, world: int, case: dict) -> dict:
    """Every value 1e6 (float32) on every rank: exact mean, zero variance, output exactly the bias."""
    m = nl.SyncBatchNorm(3, momentum=1.0)
    with torch.no_grad():
        m.bias.copy_(torch.tensor([0.5, -1.0, 2.0]))
    x = torch.full((case["sizes"][rank], 3, 4, 4), 1e6)
    return {"y": m(x).detach(), "running_mean": m.running_mean.clone(), "running_var": m.running_var.clone()}


def job_small_groups(rank: int, world: int, case: dict) -> dict:
    """A group of one process falls back to BatchNorm; a process outside the group is refused."""
    solo = dist.new_group([0])  # every rank must call new_group
    out: dict = {}
    x = torch.randn(6, 3, 2, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        m = nl.SyncBatchNorm(3, process_group=solo, dtype=torch.float64)
        b = nl.BatchNorm2d(3, dtype=torch.float64)
        out["fallback"] = (m(x), b(x), m.running_var, b.running_var)
        # The autograd Function itself also works in a group of one (the sync path, one rank).
        xs, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        w = torch.rand(3, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(3, dtype=torch.float64, requires_grad=True)
        rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        ys = SyncBatchNormFunction.apply(xs, w, bias, rm, rv, 1e-5, 0.1, solo)
        (ys * x).sum().backward()
        gs = (xs.grad, w.grad.clone(), bias.grad.clone())
        w.grad = bias.grad = None
        yb = nl.functional.batch_norm(xb, None, None, w, bias, training=True)
        (yb * x).sum().backward()
        out["function"] = (ys.detach(), yb.detach(), gs, (xb.grad, w.grad, bias.grad), rm, rv)
    else:
        m = nl.SyncBatchNorm(3, process_group=solo, dtype=torch.float64)
        try:
            m(x)
            out["non_member"] = "no error"
        except ValueError as e:
            out["non_member"] = str(e)
    return out


class _SmallCNN(nn.Sequential):
    def __init__(self):
        super().__init__(
            nn.Conv2d(2, 6, 3, padding=1, bias=False),  # (N, 6, 6, 6)
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.Conv2d(6, 8, 3, stride=2, bias=False),  # (N, 8, 2, 2)
            nl.BatchNorm2d(8),  # normlib's layer is converted too
            nn.ReLU(),
            nn.Flatten(),  # (N, 32)
            nn.Linear(32, 3),
        )


def _cnn_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(n, 2, 6, 6, generator=g, dtype=torch.float64) * 2 + 1
    return x, torch.randint(0, 3, (n,), generator=g)


def _train_cnn(model: nn.Module, steps: int, per_rank: int, rank: int, world: int) -> None:
    params = list(model.parameters())
    bufs = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        x, y = _cnn_batch(step, per_rank * world)
        xs, ys = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        for p in params:
            p.grad = None
        nn.functional.cross_entropy(model(xs), ys).backward()
        with torch.no_grad():  # SGD with momentum, as torch.optim.SGD
            for p, b in zip(params, bufs):
                b.mul_(0.9).add_(p.grad)
                p.sub_(0.05 * b)


def job_ddp(rank: int, world: int, case: dict) -> dict:
    torch.manual_seed(0)
    model = _SmallCNN().double()
    model = nl.SyncBatchNorm.convert_sync_batchnorm(model)
    kinds = sorted({type(m).__name__ for m in model.modules() if "Norm" in type(m).__name__})
    # torch's own wrapper refuses every torch.nn.SyncBatchNorm on CPU (normlib's is one)...
    try:
        nn.parallel.DistributedDataParallel(model)
        torch_ddp = "accepted"
    except ValueError as e:
        torch_ddp = str(e)
    # ... normlib's subclass of it lets normlib's layer through.
    ddp = nl.distributed.DistributedDataParallel(model)
    _train_cnn(ddp, case["steps"], case["per_rank"], rank, world)
    return {"kinds": kinds, "state": {k: v.clone() for k, v in model.state_dict().items()}, "torch_ddp": torch_ddp}


def job_bad_input_on_one_rank(rank: int, world: int, case: dict) -> dict:
    """Rank 1's input is wrong at step 2; every rank raises at once; after catching, step 3 is right."""
    m = nl.SyncBatchNorm(3, dtype=torch.float64, timeout=case["timeout"])
    out: dict = {"errors": [], "elapsed": []}
    import time

    for step in range(1, 4):
        x = torch.randn(4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))
        if step == 2 and rank == 1:
            x = {"channels": torch.randn(4, 5, 5, dtype=torch.float64),
                 "dtype": x.float(), "dims": x[0, 0]}[case["bad"]]
        t0 = time.perf_counter()
        try:
            y = m(x)
            out[f"y{step}"] = y.detach()
        except Exception as e:  # noqa: BLE001  (the test inspects the type)
            out["errors"].append((step, type(e).__name__, str(e),
                                  isinstance(e, (ValueError, TypeError)) and isinstance(e, RuntimeError)))
        out["elapsed"].append(time.perf_counter() - t0)
    out["running_mean"] = m.running_mean.clone()
    out["num_batches_tracked"] = int(m.num_batches_tracked)
    return out


def job_one_rank_in_eval(rank: int, world: int, case: dict) -> dict:
    """Rank 1 runs the layer in eval() while rank 0 trains: rank 0 raises within the timeout, naming rank 1."""
    import time

    m = nl.SyncBatchNorm(3, dtype=torch.float64, timeout=case["timeout"])
    x = torch.randn(4, 3, 5, dtype=torch.float64)
    m(x)  # one synchronised step on both ranks
    if rank == 1:
        m.eval()
    t0 = time.perf_counter()
    try:
        m(x)
        result = "no error"
    except Exception as e:  # noqa: BLE001
        result = f"{type(e).__name__}: {e}"
    elapsed = time.perf_counter() - t0
    # Rank 1 stays until rank 0 has given up (leaving would close the connection rank 0
    # waits on). Not through the group: after a timeout it may still hold rank 0's
    # abandoned all_gather, so the store carries the signal.
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set("eval test done", "1")
    else:
        store.wait(["eval test done"])
    return {"result": result, "elapsed": elapsed}


def run_jobs(rank: int, world: int, jobs: list) -> dict:
    """Run ``jobs`` (name, function name, argument) in order; the results by name."""
    return {name: globals()[fn](rank, world, arg) for name, fn, arg in jobs}


def _launch(nproc: int, jobs: list) -> list[dict]:
    return spawn(run_jobs, nproc, (jobs,), timeout=TIMEOUT)


# ----------------------------------------------------------------------------
# Multi-process tests
# ----------------------------------------------------------------------------

F64, F32 = torch.float64, torch.float32
CASES_2 = {
    "equal f64": dict(sizes=[4, 4], C=3, tail=(5, 4), dtype=F64, steps=3, seed=1, offset=100.0),
    "unequal f32, far from zero": dict(sizes=[2, 7], C=5, tail=(3, 3), dtype=F32, steps=2, seed=2, offset=300.0),
}
CASES_3 = {
    "unequal, one empty f64": dict(sizes=[3, 0, 5], C=4, tail=(3, 3), dtype=F64, steps=3, seed=3),
    "unequal f64 (N, C, L), cumulative": dict(
        sizes=[1, 2, 4], C=3, tail=(6,), dtype=F64, steps=3, seed=4, momentum=None
    ),
    "equal f32 (N, C), no affine": dict(sizes=[3, 3, 3], C=6, tail=(), dtype=F32, steps=2, seed=5, affine=False),
    # Without running statistics, evaluation normalizes each rank's slice alone (as torch's
    # SyncBatchNorm does): one rank holds every sample here, so that equals the whole batch.
    "one rank holds everything f64, no running stats": dict(
        sizes=[0, 6, 0], C=2, tail=(2, 2), dtype=F64, steps=2, seed=6, track=False
    ),
}
DDP_CASE = dict(steps=3, per_rank=3)


def test_two_processes():
    """One launch of 2 processes (gloo): every check that needs two ranks."""
    jobs = [(f"compare {k}", "job_compare", c) for k, c in CASES_2.items()]
    jobs += [
        ("ddp", "job_ddp", DDP_CASE),
        ("constant", "job_constant_channel", dict(sizes=[3, 2])),
        ("groups", "job_small_groups", {}),
        ("mismatch", "job_expect_error", dict(C=[3, 4], sizes=[4, 4], tail=(2, 2))),
        ("one value", "job_expect_error", dict(C=2, sizes=[1, 0], tail=())),
    ]
    results = _launch(2, jobs)
    for name, case in CASES_2.items():
        _check_against_reference([r[f"compare {name}"] for r in results], case)
    _check_ddp(results)
    _check_constant_channel(results)
    _check_small_groups(results)
    for r in results:
        # Mismatched channel counts raise on every rank (after the header exchange), not hang.
        assert "disagree on the number of channels" in r["mismatch"], r["mismatch"]
        assert "{0: 3, 1: 4}" in r["mismatch"]
        # One value per channel in the whole group: no variance to estimate, on every rank.
        assert "more than 1 value per channel" in r["one value"], r["one value"]


def test_three_processes():
    """One launch of 3 processes (gloo): unequal and empty per-rank batches."""
    results = _launch(3, [(f"compare {k}", "job_compare", c) for k, c in CASES_3.items()])
    for name, case in CASES_3.items():
        _check_against_reference([r[f"compare {name}"] for r in results], case)


BAD_INPUT_TIMEOUT = 30.0  # SyncBatchNorm's own wait; a bad input must be answered long before it


def test_bad_input_on_one_rank_raises_on_every_rank_at_once():
    """Wrong channels / dtype / rank on rank 1: every rank raises at that step, none waits, step 3 is right."""
    jobs = [(bad, "job_bad_input_on_one_rank", dict(bad=bad, timeout=BAD_INPUT_TIMEOUT))
            for bad in ("channels", "dtype", "dims")]
    results = _launch(2, jobs)
    reasons = {"channels": "wrong number of channels", "dtype": "dtype", "dims": "fewer than 2 dimensions"}
    for bad, expected in reasons.items():
        r0, r1 = results[0][bad], results[1][bad]
        assert [e[0] for e in r0["errors"]] == [2] and [e[0] for e in r1["errors"]] == [2], (bad, r0, r1)
        # The bad rank raises its own error (naming its argument: a ValueError or TypeError that is a RuntimeError
        # too, normlib's argument errors), the other a SyncBatchNormError naming it.
        assert r1["errors"][0][1] in ("NormValueError", "NormTypeError") and r1["errors"][0][3], r1["errors"]
        assert r0["errors"][0][1] == "SyncBatchNormError" and "rank 1" in r0["errors"][0][2], r0["errors"]
        assert expected in r0["errors"][0][2] and "SyncBatchNorm" in r0["errors"][0][2]
        assert max(r0["elapsed"] + r1["elapsed"]) < BAD_INPUT_TIMEOUT / 2, "a rank waited for the timeout"
        # Both went on: step 3 is normalized with step 3's batches only, as one BatchNorm on their union.
        xs = [torch.randn(4, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(30 + k))
              for k in range(2)]
        ref = nl.functional.batch_norm(torch.cat(xs), None, None, training=True)
        torch.testing.assert_close(torch.cat([r0["y3"], r1["y3"]]), ref, **TOL[F64])
        assert r0["num_batches_tracked"] == r1["num_batches_tracked"] == 2  # the failed step is not counted


def test_a_rank_in_eval_mode_makes_the_others_raise_within_the_timeout():
    timeout = 3.0
    results = _launch(2, [("eval", "job_one_rank_in_eval", dict(timeout=timeout))])
    r0, r1 = results[0]["eval"], results[1]["eval"]
    assert r1["result"] == "no error"  # evaluation needs no other rank
    assert r0["result"].startswith("SyncBatchNormError"), r0["result"]
    assert timeout <= r0["elapsed"] < timeout + 20
    text = r0["result"]
    assert "SyncBatchNorm #" in text and f"waited {timeout:g} s" in text
    assert "rank 1: ran this layer in eval() mode after 1 synchronised steps" in text, text


def job_fail_on_rank_1(rank: int, world: int, case: dict) -> None:
    """Rank 1 raises; rank 0 waits in a collective that can never complete."""
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()


def test_a_failing_rank_is_reported_and_every_process_reaped():
    import multiprocessing

    # Whichever failure the parent sees first is re-raised: rank 1's own error, or rank 0's,
    # whose barrier gloo ends (with one of several messages) when rank 1's connection closes.
    # Either way nothing hangs.
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose|barrier"):
        spawn(run_jobs, 2, ([("fail", "job_fail_on_rank_1", {})],), timeout=TIMEOUT)
    assert multiprocessing.active_children() == []


def _check_ddp(results: list[dict]) -> None:
    """A few DDP steps of a converted CNN equal one process training on the full batch."""
    torch.manual_seed(0)
    model = _SmallCNN().double()
    _train_cnn(model, DDP_CASE["steps"], DDP_CASE["per_rank"] * 2, 0, 1)
    ref = model.state_dict()
    for rank, r in enumerate(results):
        assert r["ddp"]["kinds"] == ["SyncBatchNorm"]
        assert "only work with GPU modules" in r["ddp"]["torch_ddp"], r["ddp"]["torch_ddp"]
        assert r["ddp"]["state"].keys() == ref.keys()
        for k, v in ref.items():
            torch.testing.assert_close(r["ddp"]["state"][k], v, **TOL[F64], msg=lambda m: f"rank {rank}, {k}: {m}")


def _check_constant_channel(results: list[dict]) -> None:
    """A channel of constant 1e6 (float32) across ranks: output exactly the bias, variance exactly 0."""
    for r in results:
        c = r["constant"]
        assert torch.equal(c["y"], torch.tensor([0.5, -1.0, 2.0]).view(1, 3, 1, 1).expand_as(c["y"]))
        assert torch.equal(c["running_mean"], torch.full((3,), 1e6))
        assert torch.equal(c["running_var"], torch.zeros(3))


def _check_small_groups(results: list[dict]) -> None:
    """A group of one process falls back to BatchNorm (and the Function works there); non-members are refused."""
    r0, r1 = (r["groups"] for r in results)
    for a, b in zip(r0["fallback"][::2], r0["fallback"][1::2]):
        torch.testing.assert_close(a, b, **TOL[F64])
    ys, yb, gs, gb, rm, rv = r0["function"]
    torch.testing.assert_close(ys, yb, **TOL[F64])
    for a, b in zip(gs, gb):
        torch.testing.assert_close(a, b, **TOL[F64])
    assert "not a member" in r1["non_member"]


# ----------------------------------------------------------------------------
# One process: fallback, statistics combine, conversion, bad input
# ----------------------------------------------------------------------------


def test_without_process_group_it_is_batchnorm():
    assert not dist.is_initialized()
    for dtype in (F64, F32):
        s, b = nl.SyncBatchNorm(4, momentum=None, dtype=dtype), nl.BatchNorm2d(4, momentum=None, dtype=dtype)
        for step in range(3):
            x = torch.randn(5, 4, 3, 3, dtype=dtype) * 2 + step
            xs, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            ys, yb = s(xs), b(xb)
            torch.testing.assert_close(ys, yb, **TOL[dtype])
            ys.backward(x)
            yb.backward(x)
            for got, want in ((xs.grad, xb.grad), (s.weight.grad, b.weight.grad), (s.bias.grad, b.bias.grad)):
                torch.testing.assert_close(got, want, **TOL[dtype])
        for k, v in b.state_dict().items():
            torch.testing.assert_close(s.state_dict()[k], v, **TOL[dtype], msg=k)
        s.eval(), b.eval()
        x = torch.randn(2, 4, 3, 3, dtype=dtype)
        torch.testing.assert_close(s(x), b(x), **TOL[dtype])


def test_state_dict_matches_torch_sync_batchnorm_both_ways():
    ours, theirs = nl.SyncBatchNorm(5), nn.SyncBatchNorm(5)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    with torch.no_grad():
        for t in theirs.state_dict().values():
            t.add_(1)
    ours.load_state_dict(theirs.state_dict())
    for k, v in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v)
    nn.BatchNorm2d(5).load_state_dict(ours.state_dict())
    assert "SyncBatchNorm(5, eps=1e-05, momentum=0.1, affine=True" in repr(ours)


def test_combine_moments_equals_statistics_of_the_concatenation():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        sizes = torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        if sum(sizes) < 2:
            continue
        x = torch.randn(sum(sizes), 3, generator=g, dtype=F64) * 5 + 1e3
        parts = x.split(sizes)
        count = torch.tensor([float(len(p)) for p in parts], dtype=F64)
        mean = torch.stack([p.mean(0) if len(p) else torch.full((3,), float("nan"), dtype=F64) for p in parts])
        m2 = torch.stack([((p - p.mean(0)) ** 2).sum(0) if len(p) else torch.zeros(3, dtype=F64) for p in parts])
        n, mu, s = combine_moments(count, mean, m2)  # empty parts may carry any mean, even NaN
        assert n.item() == sum(sizes)
        torch.testing.assert_close(mu, x.mean(0), rtol=1e-13, atol=1e-12)
        torch.testing.assert_close(s / n, x.var(0, unbiased=False), rtol=1e-11, atol=1e-11)


def test_combine_moments_is_exact_on_constants_and_accurate_where_sums_of_squares_fail():
    count = torch.tensor([3.0, 0.0, 5.0, 7.0])
    mean = torch.full((4, 2), 1e6 + 0.125, dtype=F64)
    m2 = torch.zeros(4, 2, dtype=F64)
    n, mu, s = combine_moments(count, mean, m2)
    assert n.item() == 15 and torch.equal(mu, mean[0]) and torch.equal(s, torch.zeros(2))
    # float32 values 1e4 + 0.1 * noise in three parts: the merge keeps the variance (about 0.01)
    # to float32 accuracy; the sums of x and x² that one all_reduce could carry do not.
    x64 = 1e4 + 0.1 * torch.randn(60, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
    x = x64.float()
    parts = x.split([10, 20, 30])
    count = torch.tensor([10.0, 20.0, 30.0])
    stats = [local_moments(p) for p in parts]  # each in float32, sent as float64
    mean = torch.stack([mu for _, mu, _ in stats])
    m2 = torch.stack([m for _, _, m in stats])
    n, mu, s = combine_moments(count, mean, m2)
    truth = x.double().var(0, unbiased=False)
    torch.testing.assert_close(s / n, truth, rtol=1e-5, atol=0)
    naive = (x * x).sum(0) / 60 - (x.sum(0) / 60) ** 2  # E[x²] − E[x]² in float32
    assert ((naive.double() - truth).abs() > truth).all()  # wrong by more than 100 %


def test_convert_sync_batchnorm_keeps_parameters_and_statistics():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 1),
        nn.BatchNorm2d(4, momentum=0.3, eps=1e-3),
        nn.Sequential(nl.BatchNorm2d(4, affine=False), nn.BatchNorm3d(4, track_running_stats=False)),
        nl.BatchNorm1d(4, bias=False),
        nn.SyncBatchNorm(4),
        nn.GroupNorm(2, 4),
    )
    model[1](torch.randn(8, 4, 2, 2))  # non-trivial running statistics
    model[3].eval()
    olds = [model[1], model[2][0], model[2][1], model[3], model[4]]
    params = {id(p) for p in model.parameters()}
    buffers = [(m.running_mean, m.running_var, m.num_batches_tracked) for m in olds]
    out = nl.SyncBatchNorm.convert_sync_batchnorm(model)
    assert out is model
    news = [model[1], model[2][0], model[2][1], model[3], model[4]]
    assert all(type(m) is nl.SyncBatchNorm for m in news)
    assert type(model[5]) is nn.GroupNorm
    assert {id(p) for p in model.parameters()} == params
    for old, new, (rm, rv, nbt) in zip(olds, news, buffers):
        assert new.running_mean is rm and new.running_var is rv and new.num_batches_tracked is nbt
        assert (new.weight is old.weight) and (new.bias is old.bias)
        assert (new.eps, new.momentum, new.affine, new.training) == (old.eps, old.momentum, old.affine, old.training)
        assert new.track_running_stats == old.track_running_stats
    assert model[3].bias is None and model[3].weight is not None and not model[3].training
    # Converting a BatchNorm itself returns a new layer; a SyncBatchNorm is left alone.
    bn = nn.BatchNorm1d(3)
    sbn = nl.SyncBatchNorm.convert_sync_batchnorm(bn)
    assert type(sbn) is nl.SyncBatchNorm and sbn.weight is bn.weight
    assert nl.SyncBatchNorm.convert_sync_batchnorm(sbn) is sbn
    # Without a process group the converted model computes what the original did.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU())
    twin = copy.deepcopy(net)
    x = torch.randn(4, 2, 5, 5)
    nl.SyncBatchNorm.convert_sync_batchnorm(net)
    torch.testing.assert_close(net(x), twin(x))


def test_convert_refuses_uninitialised_lazy_batchnorm():
    with pytest.raises(ValueError, match="lazy"):
        nl.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))


@pytest.mark.parametrize(
    "make, x, err, match",
    [
        (lambda: nl.SyncBatchNorm(3), torch.randn(3), ValueError, "at least 2 dimensions"),
        (lambda: nl.SyncBatchNorm(3), torch.randn(4, 5, 2), ValueError, r"expects 3 channels"),
        (lambda: nl.SyncBatchNorm(3), torch.ones(4, 3, dtype=torch.long), TypeError, "floating-point"),
        (lambda: nl.SyncBatchNorm(3), torch.ones(4, 3, dtype=torch.float64), TypeError, "dtype"),
    ],
)
def test_bad_input(make, x, err, match):
    with pytest.raises(err, match=match):
        make()(x)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        (dict(num_features=0), ValueError, "num_features"),
        (dict(num_features=3, eps=-1.0), ValueError, "eps"),
        (dict(num_features=3, momentum=2.0), ValueError, "momentum"),
    ],
)
def test_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        nl.SyncBatchNorm(**kwargs)


def test_devices_of_different_kinds_are_reported():
    with pytest.raises(ValueError, match="devices of different kinds"):
        _raise_if_mismatched([[4, 0], [4, 1]], rank=1)  # rank 0 on cpu, rank 1 on cuda


# ----------------------------------------------------------------------------
# CUDA (skipped without a GPU): nccl, gloo with CUDA tensors, mixed device kinds
# ----------------------------------------------------------------------------


def job_cuda_function(rank: int, world: int, case: dict) -> dict:
    """nccl, one process: the sync path (Function called directly) equals BatchNorm on the GPU."""
    torch.cuda.set_device(0)
    group = dist.group.WORLD
    x = torch.randn(6, 4, 5, 5, dtype=torch.float64, device="cuda", generator=None) * 3 + 10
    xs, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.rand(4, dtype=torch.float64, device="cuda", requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, device="cuda", requires_grad=True)
    ys = SyncBatchNormFunction.apply(xs, w, b, None, None, 1e-5, 0.1, group)
    (ys * x).sum().backward()
    gs = [t.clone() for t in (xs.grad, w.grad, b.grad)]
    w.grad = b.grad = None
    yb = nl.functional.batch_norm(xb, None, None, w, b, training=True)
    (yb * x).sum().backward()
    return {"y": (ys.cpu(), yb.cpu()), "grads": [(a.cpu(), c.cpu()) for a, c in zip(gs, (xb.grad, w.grad, b.grad))]}


def job_cuda_compare(rank: int, world: int, case: dict) -> dict:
    """gloo with CUDA tensors: the same comparison as on CPU."""
    m = nl.SyncBatchNorm(case["C"], **_module_kwargs(case)).cuda()
    _init_affine(m, case)
    out = {"y": [], "dx": [], "dw": [], "db": []}
    for step in range(case["steps"]):
        x, dy = (_slice(t, case["sizes"], rank).cuda() for t in _full_batch(case, step))
        x = x.clone().requires_grad_()
        m.weight.grad = m.bias.grad = None
        y = m(x)
        y.backward(dy)
        for k, v in (("y", y.detach()), ("dx", x.grad), ("dw", m.weight.grad), ("db", m.bias.grad)):
            out[k].append(v.detach().cpu().clone())
    m.eval()
    x, _ = _full_batch(case, case["steps"])
    out["eval"] = m(_slice(x, case["sizes"], rank).cuda()).detach().cpu()
    out["state"] = {k: v.cpu().clone() for k, v in m.state_dict().items()}
    return out


def job_mixed_devices(rank: int, world: int, case: dict) -> str:
    device = "cuda" if rank == 0 else "cpu"
    m = nl.SyncBatchNorm(3).to(device)
    try:
        m(torch.randn(4, 3, 2, 2, device=device))
    except ValueError as e:
        return str(e)
    return "no error"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.cuda
def test_nccl_function_on_one_gpu():
    (r,) = spawn(run_jobs, 1, ([("f", "job_cuda_function", {})],), backend="nccl", timeout=TIMEOUT)
    ys, yb = r["f"]["y"]
    torch.testing.assert_close(ys, yb, **TOL[F64])
    for a, b in r["f"]["grads"]:
        torch.testing.assert_close(a, b, **TOL[F64])


@cuda
@pytest.mark.cuda
def test_gloo_with_cuda_tensors_and_mixed_devices():
    case = dict(sizes=[3, 0, 5], C=4, tail=(3, 3), dtype=F64, steps=2, seed=3)
    jobs = [("compare", "job_cuda_compare", case), ("mixed", "job_mixed_devices", {})]
    # Three processes on one GPU: gloo allows that (nccl refuses two ranks on one device).
    results = spawn(run_jobs, 3, (jobs,), timeout=TIMEOUT)
    _check_against_reference([r["compare"] for r in results], case)
    for r in results:
        assert "devices of different kinds" in r["mixed"], r["mixed"]


# ----------------------------------------------------------------------------
# The example script's one-process pieces (its multi-process run is the chapter's)
# ----------------------------------------------------------------------------


def test_example_per_device_batchnorm_is_batchnorm_per_slice():
    from normlib.examples import sync_bn as ex

    x, _ = ex.make_data(12, seed=3, dtype=F64)
    assert x.shape == (12, 1, 8, 8) and torch.equal(x, ex.make_data(12, seed=3, dtype=F64)[0])
    model = ex.make_model(seed=0, dtype=F64)
    per_device = ex.convert_per_device(copy.deepcopy(model), devices=3)
    assert sum(isinstance(m, ex.PerDeviceBatchNorm2d) for m in per_device.modules()) == 2
    bn, pd = model[1], per_device[1]
    h = model[0](x)
    got = pd(h)
    # Each slice of 4 samples normalized alone; running statistics from slice 0 only (DDP's broadcast).
    want = torch.cat([nn.functional.batch_norm(s, None, None, bn.weight, bn.bias, training=True) for s in h.chunk(3)])
    torch.testing.assert_close(got, want, **TOL[F64])
    ref = nn.BatchNorm2d(16, dtype=F64)
    ref(h[:4])
    torch.testing.assert_close(pd.running_var, ref.running_var, **TOL[F64])
    # One device: plain BatchNorm, training and running statistics alike.
    one = ex.convert_per_device(copy.deepcopy(model), devices=1)
    torch.testing.assert_close(one(x), model(x), **TOL[F64])
    torch.testing.assert_close(one[4].running_mean, model[4].running_mean, **TOL[F64])
