"""Module behaviour: state_dicts, running statistics, repr, import hygiene."""

import subprocess
import sys

import pytest
import torch

import normlib as nl

PAIRS = [
    (lambda: nl.LayerNorm(5), lambda: torch.nn.LayerNorm(5)),
    (lambda: nl.LayerNorm((2, 5), bias=False), lambda: torch.nn.LayerNorm((2, 5), bias=False)),
    (lambda: nl.RMSNorm(5), lambda: torch.nn.RMSNorm(5)),
    (lambda: nl.GroupNorm(2, 4), lambda: torch.nn.GroupNorm(2, 4)),
    (lambda: nl.BatchNorm1d(4), lambda: torch.nn.BatchNorm1d(4)),
    (lambda: nl.BatchNorm2d(4, affine=False), lambda: torch.nn.BatchNorm2d(4, affine=False)),
    (lambda: nl.BatchNorm2d(4, track_running_stats=False), lambda: torch.nn.BatchNorm2d(4, track_running_stats=False)),
    (lambda: nl.InstanceNorm2d(4, affine=True, track_running_stats=True), lambda: torch.nn.InstanceNorm2d(4, affine=True, track_running_stats=True)),
    (lambda: nl.InstanceNorm1d(4), lambda: torch.nn.InstanceNorm1d(4)),
    (lambda: nl.BatchNorm1d(4, bias=False), lambda: torch.nn.BatchNorm1d(4, bias=False)),
    (lambda: nl.GroupNorm(2, 4, bias=False), lambda: torch.nn.GroupNorm(2, 4, bias=False)),
]


@pytest.mark.parametrize("ours,theirs", PAIRS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_state_dict_round_trips_both_ways(ours, theirs, mode):
    a, b = ours().train(mode == "train"), theirs().train(mode == "train")
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa.keys()) == list(sb.keys())
    for k in sa:
        assert sa[k].shape == sb[k].shape and sa[k].dtype == sb[k].dtype, k
    # perturb and load both directions with strict=True
    with torch.no_grad():
        for t in list(b.parameters()) + [t for n, t in b.named_buffers() if n != "num_batches_tracked"]:
            t.add_(torch.rand_like(t))
    a.load_state_dict(b.state_dict())
    for k, v in b.state_dict().items():
        assert torch.equal(a.state_dict()[k], v)
    c = theirs()
    c.load_state_dict(a.state_dict())
    for k, v in a.state_dict().items():
        assert torch.equal(c.state_dict()[k], v)


def test_running_statistics_follow_pytorch_convention():
    bn = nl.BatchNorm1d(3, momentum=0.25)
    batches = [torch.randn(5, 3) * (i + 1) + i for i in range(4)]
    rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    for x in batches:
        bn(x)
        xd = x.double()
        rm = 0.75 * rm + 0.25 * xd.mean(0)
        rv = 0.75 * rv + 0.25 * xd.var(0, unbiased=True)  # unbiased: divide by n - 1
    torch.testing.assert_close(bn.running_mean.double(), rm, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(bn.running_var.double(), rv, rtol=1e-6, atol=1e-6)
    assert bn.num_batches_tracked.item() == 4


def test_eval_does_not_update_and_uses_running_stats():
    bn = nl.BatchNorm1d(3)
    bn(torch.randn(8, 3))
    bn.eval()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    x = torch.randn(4, 3)
    with torch.enable_grad():
        y = bn(x)
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k
    torch.testing.assert_close(y, (x - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps))


def test_training_mode_is_self_training_not_grad_mode():
    bn = nl.BatchNorm1d(3)
    with torch.no_grad():
        bn(torch.randn(8, 3))  # training under no_grad still records statistics
    assert bn.num_batches_tracked.item() == 1
    assert not torch.equal(bn.running_mean, torch.zeros(3))


def test_track_running_stats_false_uses_batch_stats_in_eval():
    bn = nl.BatchNorm1d(3, track_running_stats=False).eval()
    assert bn.running_mean is None and bn.num_batches_tracked is None
    x = torch.randn(6, 3) * 4 + 2
    torch.testing.assert_close(bn(x), torch.nn.functional.batch_norm(x, None, None, training=True))


def test_reset_running_stats_and_parameters():
    bn = nl.BatchNorm2d(2)
    bn(torch.randn(4, 2, 3, 3) + 5)
    with torch.no_grad():
        bn.weight.mul_(3)
    bn.reset_running_stats()
    assert torch.equal(bn.running_mean, torch.zeros(2)) and torch.equal(bn.running_var, torch.ones(2))
    assert bn.num_batches_tracked.item() == 0
    assert not torch.equal(bn.weight, torch.ones(2))
    bn.reset_parameters()
    assert torch.equal(bn.weight, torch.ones(2)) and torch.equal(bn.bias, torch.zeros(2))


def test_empty_batch_in_training_keeps_running_stats_finite():
    bn = nl.BatchNorm1d(3)
    y = bn(torch.randn(0, 3))
    assert y.shape == (0, 3)
    assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()


def test_device_and_dtype_arguments():
    ln = nl.LayerNorm(4, dtype=torch.float64)
    assert ln.weight.dtype == torch.float64
    bn = nl.BatchNorm1d(4, dtype=torch.float16, device="cpu")
    assert bn.running_mean.dtype == torch.float16 and bn.num_batches_tracked.dtype == torch.long


@pytest.mark.parametrize("ours,theirs", PAIRS)
def test_repr_matches_torch(ours, theirs):
    assert repr(ours()) == repr(theirs())


def _run(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.splitlines(), out.stderr


def test_import_needs_no_triton_and_prints_nothing():
    code = (
        "import sys\n"
        "sys.modules['triton'] = None  # as if Triton were not installed\n"
        "import normlib as nl, torch\n"
        "print(nl.__version__, nl.ops.HAS_TRITON)\n"
        "x = torch.randn(2, 4)\n"
        "print(nl.LayerNorm(4)(x).shape, nl.ops.path_for(x))\n"
        "y, r = nl.ops.add_rms_norm(x, x)\n"
        "print(torch.allclose(y, nl.functional.rms_norm(2 * x, 4)))\n"
    )
    stdout, stderr = _run(code)
    assert stdout == [f"{nl.__version__} False", "torch.Size([2, 4]) reference", "True"]
    assert stderr == ""


def test_import_and_cpu_use_do_not_import_triton():
    stdout, stderr = _run(
        "import sys, torch, normlib as nl\n"
        "nl.TransformerBlock(8, 2)(torch.randn(1, 3, 8))\n"
        "print('triton' in sys.modules)\n"
    )
    assert stdout == ["False"] and stderr == ""
