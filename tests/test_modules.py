"""Module behaviour: state_dicts, running statistics, repr, import hygiene."""

import inspect
import subprocess
import sys

import pytest
import torch

import normlib as nl
from normlib.testing.tolerance import close

# torch 2.13 gave BatchNorm, GroupNorm and InstanceNorm a ``bias`` argument
# (normlib has it on every torch); on older releases there is no torch twin to compare.
_TORCH_BIAS = pytest.mark.skipif(
    "bias" not in inspect.signature(torch.nn.GroupNorm.__init__).parameters,
    reason=f"torch {torch.__version__}'s BatchNorm/GroupNorm take no bias argument",
)

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
    pytest.param(lambda: nl.BatchNorm1d(4, bias=False), lambda: torch.nn.BatchNorm1d(4, bias=False), marks=_TORCH_BIAS),
    pytest.param(lambda: nl.GroupNorm(2, 4, bias=False), lambda: torch.nn.GroupNorm(2, 4, bias=False), marks=_TORCH_BIAS),
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
def test_repr_is_torchs_with_normlibs_name(ours, theirs):
    assert repr(ours()) == "normlib." + repr(theirs())


@pytest.mark.parametrize("ours,theirs", PAIRS)
def test_normlib_modules_are_instances_of_their_torch_namesakes(ours, theirs):
    a, b = ours(), theirs()
    assert isinstance(a, type(b)) and type(a) is not type(b)
    assert type(a).__module__.startswith("normlib.")


def test_a_version_1_batchnorm_checkpoint_loads_as_into_torch():
    """Checkpoints from before num_batches_tracked existed (state_dict version 1, key absent)."""
    torch.manual_seed(0)
    src = torch.nn.BatchNorm2d(4)
    src(torch.randn(8, 4, 3, 3))
    old = src.state_dict()
    del old["num_batches_tracked"]
    old._metadata = {"": {"version": 1}}  # as torch.save wrote it then
    for make in (lambda: torch.nn.BatchNorm2d(4), lambda: nl.BatchNorm2d(4)):
        m = make()
        m.num_batches_tracked.fill_(3)
        result = m.load_state_dict(old)  # strict: no missing key
        assert not result.missing_keys and not result.unexpected_keys
        assert m.num_batches_tracked.item() == 3  # kept, as torch keeps it
        assert torch.equal(m.running_mean, src.running_mean)
    # at version 2 (what state_dict() records now) the key is required, in both
    new = src.state_dict()
    del new["num_batches_tracked"]
    for m in (torch.nn.BatchNorm2d(4), nl.BatchNorm2d(4)):
        with pytest.raises(RuntimeError, match="Missing key.*num_batches_tracked"):
            m.load_state_dict(new)
    # an InstanceNorm checkpoint from before 0.4 (running stats saved though not tracked): torch's message
    legacy = {"running_mean": torch.zeros(4), "running_var": torch.ones(4)}
    for m in (torch.nn.InstanceNorm2d(4), nl.InstanceNorm2d(4)):
        with pytest.raises(RuntimeError, match="Unexpected running stats buffer"):
            m.load_state_dict(legacy)


def test_convert_sync_batchnorm_sees_normlib_batchnorm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(nl.BatchNorm2d(4), torch.nn.ReLU(), nl.BatchNorm1d(3, affine=False), nl.InstanceNorm2d(4))
    model[0](torch.randn(8, 4, 2, 2))
    weight = model[0].weight
    converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert type(converted[0]) is torch.nn.SyncBatchNorm and type(converted[2]) is torch.nn.SyncBatchNorm
    assert converted[0].weight is weight  # torch reuses the parameter objects
    assert torch.equal(converted[0].running_mean, model[0].running_mean)
    assert converted[0].num_batches_tracked.item() == 1
    assert type(converted[3]) is nl.InstanceNorm2d  # not a BatchNorm: left alone, as in torch


def test_hugging_face_trainer_exempts_normlib_norm_weights_from_weight_decay():
    pytest.importorskip("transformers")
    from transformers.trainer_pt_utils import get_parameter_names
    from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS

    def model(norm):
        return torch.nn.Sequential(torch.nn.Linear(4, 4), norm, torch.nn.Linear(4, 2))

    # the trainer's rule: no weight decay for parameters of ALL_LAYERNORM_LAYERS (and names with "bias", "norm", ...);
    # the names here ("1.weight") match no pattern, so only the type can exempt them
    decay = get_parameter_names(model(nl.LayerNorm(4)), ALL_LAYERNORM_LAYERS, [r"bias"])
    assert decay == get_parameter_names(model(torch.nn.LayerNorm(4)), ALL_LAYERNORM_LAYERS, [r"bias"])
    assert decay == ["0.weight", "2.weight"]


@pytest.mark.parametrize(
    "make, x",
    [
        (lambda: nl.LayerNorm(4), torch.randn(2, 4)),
        (lambda: nl.GroupNorm(2, 4), torch.randn(2, 4, 3)),
        (lambda: nl.BatchNorm1d(4), torch.randn(5, 4)),
        (lambda: nl.BatchNorm2d(4, affine=False), torch.randn(5, 4, 2, 2)),
        (lambda: nl.InstanceNorm2d(4, affine=True), torch.randn(2, 4, 3, 3)),
    ],
)
@pytest.mark.parametrize("train", [True, False])
def test_dtype_rule_is_torchs(make, x, train):
    """Parameters/buffers of the input's dtype, or float32 with half input; else a TypeError (torch: RuntimeError)."""
    for params, inp, ok in [
        (torch.float32, torch.float64, False),
        (torch.float64, torch.float32, False),
        (torch.bfloat16, torch.float32, False),
        (torch.float16, torch.bfloat16, False),
        (torch.float32, torch.bfloat16, True),
        (torch.float32, torch.float16, True),
        (torch.float64, torch.float64, True),
    ]:
        m = make().to(params).train(train)
        theirs = type(m).__mro__[[c.__module__.startswith("torch.") for c in type(m).__mro__].index(True)]
        t = theirs(*_torch_args(m)).to(params).train(train)
        t.load_state_dict(m.state_dict())
        xi = x.to(inp)
        if ok:
            y = m(xi)
            assert y.dtype == inp
            torch.testing.assert_close(y, t(xi), rtol=1e-2, atol=1e-2)
        else:
            with pytest.raises(RuntimeError):  # torch refuses ...
                t(xi)
            with pytest.raises(TypeError, match=rf"input has dtype {inp} but \w+ has dtype {params}"):
                m(xi)  # ... and so does normlib, saying why


def _torch_args(m):
    if isinstance(m, torch.nn.LayerNorm):
        return (m.normalized_shape,)
    if isinstance(m, torch.nn.GroupNorm):
        return (m.num_groups, m.num_channels)
    return (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's own RMSNorm says so
def test_rms_norm_accepts_any_weight_dtype_as_torch_does():
    x = torch.randn(3, 4)
    for params, inp in [(torch.float32, torch.float64), (torch.float64, torch.float32), (torch.float16, torch.bfloat16)]:
        ours, theirs = nl.RMSNorm(4).to(params), torch.nn.RMSNorm(4).to(params)
        y = ours(x.to(inp))
        assert y.dtype == theirs(x.to(inp)).dtype == inp


def test_norms_without_parameters_take_any_float_dtype():
    m = nl.InstanceNorm2d(4).to(torch.float16)  # no parameters, no buffers
    assert m(torch.randn(2, 4, 3, 3, dtype=torch.float64)).dtype == torch.float64


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
    assert stdout == [f"{nl.__version__} False", "torch.Size([2, 4]) native", "True"]
    assert stderr == ""


def test_import_and_cpu_use_do_not_import_triton():
    stdout, stderr = _run(
        "import sys, torch, normlib as nl\n"
        "nl.TransformerBlock(8, 2)(torch.randn(1, 3, 8))\n"
        "print('triton' in sys.modules)\n"
    )
    assert stdout == ["False"] and stderr == ""


def test_packaging_metadata():
    """py.typed ships with the package; the licence is an SPDX string (setuptools deprecates the table form)."""
    import importlib.resources
    import pathlib
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    assert (importlib.resources.files("normlib") / "py.typed").is_file()
    meta = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "MIT"
    assert not any(c.startswith("License ::") for c in meta["project"]["classifiers"])
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["normlib"]


@pytest.mark.parametrize("cls", [nl.LayerNorm, nl.RMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_norm_module_adds_a_residual_as_add_norm_does(cls, dtype):
    """``norm(x, residual=r)`` is ``(norm(x + r), x + r)``: the same numbers as the two steps, gradients
    through both outputs, the sum in the residual's dtype."""
    torch.manual_seed(0)
    m = cls(16).to(dtype)
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    r = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    y, s = m(x, residual=r)
    s_ref = (x.detach() + r.detach())
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    torch.testing.assert_close(y, m(s_ref), rtol=0, atol=0)
    (y.float().sum() + s.float().square().sum()).backward()
    x2, r2 = x.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
    s2 = x2 + r2
    (m(s2).float().sum() + s2.float().square().sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad, **close(dtype, kappa=4))
    torch.testing.assert_close(r.grad, r2.grad, **close(dtype, kappa=4))


def test_a_residual_needs_a_norm_over_the_last_dimension_and_a_matching_tensor():
    m = nl.LayerNorm((4, 8))
    with pytest.raises(ValueError, match="normalized_shape must be"):
        m(torch.randn(2, 4, 8), residual=torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="residual must have the shape"):
        nl.LayerNorm(8)(torch.randn(2, 8), residual=torch.randn(3, 8))
    with pytest.raises(TypeError, match="residual must be a torch.Tensor"):
        nl.RMSNorm(8)(torch.randn(2, 8), residual=[1.0])


@pytest.mark.parametrize("make, shape", [
    (lambda: nl.LayerNorm(5), (2, 3, 5)), (lambda: nl.RMSNorm(5), (2, 3, 5)), (lambda: nl.GroupNorm(2, 4), (2, 4, 5)),
    (lambda: nl.BatchNorm1d(4), (3, 4, 5)), (lambda: nl.BatchNorm2d(4), (2, 4, 3, 3)),
    (lambda: nl.InstanceNorm1d(4), (2, 4, 5)), (lambda: nl.InstanceNorm1d(4, affine=True, track_running_stats=True),
                                                  (2, 4, 5)),
    (lambda: nl.InstanceNorm2d(4, affine=True), (2, 4, 3, 3)),
], ids=["LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "InstanceNorm1d",
        "InstanceNorm1d-tracked", "InstanceNorm2d"])
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_torch_jit_trace_of_every_module(make, shape):
    """torch.jit.trace records every module, in training and evaluation (InstanceNorm raised
    "unordered_map::at": its Function was handed a traced size)."""
    for training in (True, False):
        module = make().train(training)
        traced = torch.jit.trace(module, torch.randn(shape), check_trace=False)
        x = torch.randn(shape)
        torch.testing.assert_close(traced(x), make().train(training)(x))


@pytest.mark.parametrize("cls, shape", [(nl.InstanceNorm1d, (2, 3, 5)), (nl.InstanceNorm2d, (2, 3, 4, 4))])
def test_instance_norm_state_dict_stays_torchs(cls, shape):
    """With a momentum, torch's InstanceNorm counts no batches: nor does normlib's (its state_dict differed)."""
    torch_cls = getattr(torch.nn, cls.__name__)
    ours, theirs = cls(3, affine=True, track_running_stats=True), torch_cls(3, affine=True, track_running_stats=True)
    for _ in range(3):
        x = torch.randn(shape)
        ours(x), theirs(x)
    for (k, a), (k2, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(a, b, **close(torch.float32)) if a.is_floating_point() else torch.testing.assert_close(a, b)


def test_instance_norm_without_parameters_takes_any_channel_count_with_torchs_warning():
    """affine=False, no running statistics: num_features is not used; torch warns and normalizes, so does normlib."""
    x = torch.randn(2, 4, 5)
    with pytest.warns(UserWarning, match="does not match num_features") as ours:
        y = nl.InstanceNorm1d(3)(x)
    with pytest.warns(UserWarning, match="does not match num_features") as theirs:
        want = torch.nn.InstanceNorm1d(3)(x)
    assert str(ours[0].message) == str(theirs[0].message)
    torch.testing.assert_close(y, want, **close(torch.float32))
    with pytest.raises(ValueError, match="expects 3 channels"):
        nl.InstanceNorm1d(3, affine=True)(x)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_torch_jit_trace_with_shapes_taken_from_the_input():
    """Under torch.jit.trace x.shape's sizes are traced values: a normalized_shape built from them, the residual
    entries and a TransformerBlock trace (they raised "normalized_shape must hold non-negative ints")."""
    x = torch.randn(3, 8)
    calls = [lambda a: nl.ops.rms_norm(a), lambda a: nl.functional.layer_norm(a, a.shape[-1:]),
             lambda a: nl.ops.add_layer_norm(a, 2 * a)[0], lambda a: nl.RMSNorm(8)(a, residual=a)[0]]
    for fn in calls:
        traced = torch.jit.trace(fn, (x,), check_trace=False)
        x2 = torch.randn(3, 8)
        torch.testing.assert_close(traced(x2), fn(x2))
    block = nl.TransformerBlock(8, 2).eval()
    traced = torch.jit.trace(block, (x[None],), check_trace=False)
    torch.testing.assert_close(traced(x[None]), block(x[None]))
