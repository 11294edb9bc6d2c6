"""Every bad input gets a TypeError/ValueError that names the argument."""

import pytest
import torch

import normlib as nl
import normlib.functional as F

x = torch.randn(4, 6)
img = torch.randn(2, 6, 3, 3)


@pytest.mark.parametrize(
    "bad",
    [torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool), torch.ones(2, 3, dtype=torch.complex64)],
    ids=["int", "bool", "complex"],
)
@pytest.mark.parametrize(
    "call",
    [
        lambda t: F.layer_norm(t, (3,)),
        lambda t: F.rms_norm(t, (3,)),
        lambda t: F.group_norm(t, 1),
        lambda t: F.batch_norm(t, None, None, training=True),
        lambda t: F.instance_norm(t.unsqueeze(-1).expand(2, 3, 4)),
        lambda t: nl.LayerNorm(3)(t),
        lambda t: nl.RMSNorm(3)(t),
        lambda t: nl.BatchNorm1d(3)(t),
        lambda t: nl.GroupNorm(1, 3)(t),
    ],
)
def test_non_float_input_is_a_type_error(bad, call):
    with pytest.raises(TypeError, match=r"input must be a floating-point tensor.*" + str(bad.dtype).split(".")[1]):
        call(bad)


def test_normalized_shape_mismatch():
    with pytest.raises(ValueError, match=r"normalized_shape=\[5\].*last 1 dimension.*\[4, 6\]"):
        F.layer_norm(x, (5,))
    with pytest.raises(ValueError, match=r"normalized_shape=\[4, 6, 1\]"):
        nl.LayerNorm((4, 6, 1))(x)
    with pytest.raises(ValueError, match="normalized_shape"):
        F.rms_norm(x, 7)
    with pytest.raises(TypeError, match="normalized_shape must be an int or a sequence"):
        nl.LayerNorm(2.5)
    with pytest.raises(ValueError, match="at least one dimension"):
        F.layer_norm(x, ())


def test_weight_and_bias_shapes():
    with pytest.raises(ValueError, match=r"weight must have shape \[6\] \(got \[5\]\)"):
        F.layer_norm(x, (6,), torch.ones(5))
    with pytest.raises(ValueError, match=r"bias must have shape \[6\]"):
        F.layer_norm(x, (6,), None, torch.ones(6, 1))
    with pytest.raises(ValueError, match=r"weight must have shape \[6\]"):
        F.rms_norm(x, (6,), torch.ones(3))
    with pytest.raises(ValueError, match=r"weight must have shape \[6\]"):
        F.batch_norm(img, None, None, torch.ones(5), training=True)
    with pytest.raises(ValueError, match=r"bias must have shape \[6\]"):
        F.group_norm(img, 2, None, torch.ones(2))
    with pytest.raises(TypeError, match="weight must be a floating-point tensor"):
        F.layer_norm(x, (6,), torch.ones(6, dtype=torch.long))
    with pytest.raises(ValueError, match=r"running_mean must have shape \[6\]"):
        F.batch_norm(img, torch.zeros(5), torch.ones(5))


def test_batch_norm_rank_and_channels():
    with pytest.raises(ValueError, match=r"BatchNorm2d expects 4D input \(got 3D input"):
        nl.BatchNorm2d(6)(torch.randn(2, 6, 3))
    with pytest.raises(ValueError, match=r"BatchNorm1d expects 2D or 3D input \(got 4D"):
        nl.BatchNorm1d(6)(img)
    with pytest.raises(ValueError, match=r"BatchNorm2d\(5\) expects 5 channels in dimension 1 \(got input of shape \[2, 6, 3, 3\]\)"):
        nl.BatchNorm2d(5)(img)
    with pytest.raises(ValueError, match=r"at least 2 dimensions \(got 1D"):
        F.batch_norm(torch.randn(5), None, None, training=True)
    with pytest.raises(ValueError, match=r"InstanceNorm2d expects 3D \(unbatched\) or 4D"):
        nl.InstanceNorm2d(6)(x)


def test_batch_norm_training_needs_more_than_one_value_per_channel():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nl.BatchNorm1d(6)(torch.randn(1, 6))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        nl.BatchNorm2d(6)(torch.randn(1, 6, 1, 1))
    bn = nl.BatchNorm1d(6).eval()
    assert bn(torch.randn(1, 6)).shape == (1, 6)  # fine in eval
    with pytest.raises(ValueError, match="more than 1 spatial element"):
        nl.InstanceNorm1d(6)(torch.randn(2, 6, 1))
    with pytest.raises(ValueError, match="needs running_mean and running_var"):
        F.batch_norm(img, None, None, training=False)


@pytest.mark.parametrize("groups", [0, -2])
def test_group_norm_bad_groups(groups):
    with pytest.raises(ValueError, match=f"num_groups must be a positive int \\(got {groups}\\)"):
        nl.GroupNorm(groups, 6)
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        F.group_norm(img, groups)


def test_group_norm_channels_not_divisible():
    with pytest.raises(ValueError, match=r"num_channels must be divisible by num_groups \(got num_channels=6, num_groups=4\)"):
        nl.GroupNorm(4, 6)
    with pytest.raises(ValueError, match=r"num_groups must divide the number of channels: got num_groups=4 for input with 6 channels"):
        F.group_norm(img, 4)
    with pytest.raises(TypeError, match="num_groups must be a positive int"):
        nl.GroupNorm(2.0, 6)


@pytest.mark.parametrize(
    "make",
    [
        lambda e: nl.LayerNorm(6, eps=e),
        lambda e: nl.RMSNorm(6, eps=e),
        lambda e: nl.GroupNorm(2, 6, eps=e),
        lambda e: nl.BatchNorm1d(6, eps=e),
        lambda e: nl.BatchNorm2d(6, eps=e),
        lambda e: nl.InstanceNorm1d(6, eps=e),
        lambda e: nl.InstanceNorm2d(6, eps=e),
        lambda e: nl.TransformerBlock(8, 2, eps=e),
        lambda e: F.layer_norm(x, (6,), eps=e),
        lambda e: F.rms_norm(x, (6,), eps=e),
        lambda e: F.group_norm(img, 2, eps=e),
        lambda e: F.batch_norm(img, None, None, training=True, eps=e),
        lambda e: F.instance_norm(img, eps=e),
    ],
)
def test_negative_or_nan_eps(make):
    with pytest.raises(ValueError, match=r"eps must be a finite number >= 0 \(got -1e-05\)"):
        make(-1e-5)
    with pytest.raises(ValueError, match="eps must be a finite number"):
        make(float("nan"))
    with pytest.raises(TypeError, match="eps must be a real number"):
        make("1e-5")
    with pytest.raises(ValueError, match="eps must be a finite number >= 0 \\(got a number of about 401 digits\\)"):
        make(10**400)  # beyond float's range: a ValueError naming eps, not an OverflowError


def test_momentum_and_num_features():
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\] \(got 1.5\)"):
        nl.BatchNorm1d(3, momentum=1.5)
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\] \(got a number of about 401 digits\)"):
        nl.BatchNorm1d(3, momentum=10**400)
    for big in (10**5000, -(10**5000)):  # beyond what Python prints as a string (4300 digits)
        with pytest.raises(ValueError, match=r"\(got a number of about 5001 digits\)"):
            nl.BatchNorm1d(3, momentum=big)
        with pytest.raises(ValueError, match=r"eps must be a finite number >= 0 \(got a number of about 5001 digits\)"):
            nl.LayerNorm(3, eps=abs(big))
    with pytest.raises(ValueError, match=r"num_features must be a positive int \(got 0\)"):
        nl.BatchNorm2d(0)


def test_attention_shapes():
    with pytest.raises(ValueError, match=r"d_model must be divisible by n_head \(got d_model=10, n_head=3\)"):
        nl.MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match=r"d_model must be divisible by n_head"):
        nl.TransformerBlock(10, 4)
    attn = nl.MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"q must have shape \(B, T, d_model=8\) \(got \[2, 3, 6\]\)"):
        attn(torch.randn(2, 3, 6), torch.randn(2, 3, 8), torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match="k, v the length"):
        attn(torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(2, 5, 8))
    with pytest.raises(TypeError, match="k must be a floating-point tensor"):
        attn(torch.randn(2, 3, 8), torch.ones(2, 3, 8, dtype=torch.long), torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match='norm must be "layer" or "rms"'):
        nl.TransformerBlock(8, 2, norm="batch")


# ----------------------------------------------------------------------------
# Unusual and broken input, each answered as torch answers it or better
# ----------------------------------------------------------------------------


def test_parameters_left_on_the_meta_device_are_refused():
    """A model built under torch.device("meta") and only partly loaded: never compute without γ/β."""
    with torch.device("meta"):
        ln, gn, bn = nl.LayerNorm(6), nl.GroupNorm(2, 6), nl.BatchNorm1d(6)
    for call in (lambda: ln(x), lambda: gn(img), lambda: bn(x), lambda: F.layer_norm(x, (6,), ln.weight)):
        with pytest.raises(ValueError, match=r"(weight|running_mean) is on device meta but input is on cpu.*never loaded"):
            call()
    rm = torch.zeros(6, device="meta")
    with pytest.raises(ValueError, match="running_mean is on device meta"):
        F.batch_norm(x, rm, torch.ones(6))


def test_instance_norm_with_no_spatial_elements_leaves_the_running_statistics_alone():
    m, ref = nl.InstanceNorm1d(6, track_running_stats=True), torch.nn.InstanceNorm1d(6, track_running_stats=True)
    empty = torch.randn(2, 6, 0)
    assert m(empty).shape == ref(empty).shape == (2, 6, 0)
    assert torch.equal(m.running_mean, ref.running_mean) and torch.equal(m.running_var, ref.running_var)
    assert torch.isfinite(m.running_var).all()


def test_zero_channels_give_an_empty_result_as_in_torch():
    """An empty result, as torch up to 2.14 gives (2.15's group_norm refuses zero channels instead)."""
    for call_ours, call_torch in (
        (lambda t: F.instance_norm(t), torch.nn.functional.instance_norm),
        (lambda t: F.group_norm(t, 1), lambda t: torch.nn.functional.group_norm(t, 1)),
    ):
        t = torch.randn(2, 0, 5)
        assert call_ours(t).shape == (2, 0, 5)
        try:
            assert call_torch(t).shape == (2, 0, 5)
        except RuntimeError as e:  # newer torch: a clear refusal, also an answer
            assert "channels" in str(e)


HUGE = torch.tensor([[2e19, -2e19, 1e19, 0.0, 3e18, -5e18]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "op",
    [
        lambda t: F.layer_norm(t, (6,)),
        lambda t: F.rms_norm(t, (6,)),
        lambda t: F.group_norm(t.reshape(1, 6, 1), 2).reshape(1, 6),
        lambda t: F.batch_norm(t.reshape(6, 1), None, None, training=True).reshape(1, 6),
        lambda t: F.instance_norm(t.reshape(1, 1, 6)).reshape(1, 6),
        lambda t: nl.LayerNorm(6).to(t.dtype)(t),
        lambda t: nl.RMSNorm(6).to(t.dtype)(t),
    ],
    ids=["layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "LayerNorm", "RMSNorm"],
)
def test_rows_whose_squares_overflow_give_the_true_answer(op, dtype):
    """|x| ~ 2e19: x² overflows float32 (torch gives NaN or 0 here); normlib gives the float64 answer."""
    t = HUGE.to(dtype)
    got = op(t)
    want = op(t.double()).to(dtype)  # float64 does not overflow at 4e38
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    # and its gradient is finite too
    tg = t.float().clone().requires_grad_()
    op(tg.to(dtype)).float().sin().sum().backward()
    assert torch.isfinite(tg.grad).all()


def test_rows_holding_inf_stay_nan_as_in_torch():
    t = torch.tensor([[float("inf"), 1.0, 2.0, 3.0]])
    assert torch.isnan(F.layer_norm(t, (4,))).all() and torch.isnan(torch.nn.functional.layer_norm(t, (4,))).all()


def test_moments_refuses_dimensions_out_of_range():
    t = torch.randn(2, 3)
    with pytest.raises(IndexError, match=r"dims: dimension 2 is out of range for a 2-D tensor"):
        F.moments(t, (2,))
    with pytest.raises(IndexError, match="out of range"):
        F.moments(t, (-3,))
    with pytest.raises(ValueError, match="must not repeat"):
        F.moments(t, (1, -1))
    with pytest.raises(TypeError, match="dims must hold ints"):
        F.moments(t, (1.0,))
    torch.testing.assert_close(F.moments(t, -1)[2], t.var(-1, unbiased=False, keepdim=True))


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: F.layer_norm(x, (6,), torch.ones(6, dtype=torch.float64)), "weight"),
        (lambda: F.layer_norm(x, (6,), None, torch.ones(6, dtype=torch.float64)), "bias"),
        (lambda: F.group_norm(img, 2, torch.ones(6, dtype=torch.float64)), "weight"),
        (lambda: F.batch_norm(x, torch.zeros(6, dtype=torch.float64), torch.ones(6, dtype=torch.float64)), "running_mean"),
        (lambda: F.instance_norm(img, weight=torch.ones(6, dtype=torch.float16)), "weight"),
    ],
)
def test_functionals_refuse_what_the_modules_refuse(call, name):
    """A float64 parameter with float32 input: torch raises, normlib's modules raise, and so do its functionals."""
    with pytest.raises(TypeError, match=rf"input has dtype torch.float32 but {name} has dtype"):
        call()


def test_rms_norm_takes_any_weight_dtype_like_torch():
    w = torch.ones(6, dtype=torch.float64)
    assert F.rms_norm(x, (6,), w).dtype == torch.nn.functional.rms_norm(x, (6,), w).dtype == torch.float32


@pytest.mark.parametrize("make", [lambda: x.to_sparse(), lambda: torch.nested.nested_tensor([x, x[:2]])],
                         ids=["sparse", "nested"])
def test_sparse_and_nested_inputs_get_a_clear_type_error(make):
    t = make()
    for call in (lambda: F.layer_norm(t, (6,)), lambda: nl.LayerNorm(6)(t), lambda: F.rms_norm(t, (6,))):
        with pytest.raises(TypeError, match=r"input must be a (dense|regular)"):
            call()


def test_public_helpers_name_their_argument():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        nl.ops.path_for([1.0, 2.0])
    with pytest.raises(TypeError, match="residual must be a torch.Tensor or None"):
        nl.ops.path_for(x, residual=3)
    from normlib.distributed import combine_moments, local_moments

    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        local_moments([1.0])
    with pytest.raises(ValueError, match=r"local_moments expects x of shape \(N, C, \*\)"):
        local_moments(torch.randn(5))
    with pytest.raises(ValueError, match="at least one part"):
        combine_moments(torch.zeros(0), torch.zeros(0, 3), torch.zeros(0, 3))
    with pytest.raises(ValueError, match="non-negative whole numbers"):
        combine_moments(torch.tensor([2.0, -1.0]), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(TypeError, match="count must be a torch.Tensor"):
        combine_moments([2, 3], torch.zeros(2, 3), torch.zeros(2, 3))
    # All counts zero: an empty union, no crash.
    n, mean, m2 = combine_moments(torch.zeros(2), torch.zeros(2, 3), torch.zeros(2, 3))
    assert n.item() == 0 and torch.equal(m2, torch.zeros(3))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: F.layer_norm_backward(torch.ones(2, 4), torch.ones(2, 5), torch.ones(2, 1), (4,)),
         r"xhat must have the shape of dy \[2, 4\]"),
        (lambda: F.layer_norm_backward(torch.ones(2, 4), torch.ones(2, 4), torch.ones(2), (4,)),
         r"rstd must have shape \[2, 1\]"),
        (lambda: F.layer_norm_backward(torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 1), (4,), torch.ones(3)),
         r"weight must have shape \[4\]"),
        (lambda: F.rms_norm_backward(torch.ones(2, 4), torch.ones(2, 4), torch.ones(2, 2), (4,)),
         r"rrms must have shape \[2, 1\]"),
        (lambda: F.batch_norm_backward(torch.ones(2, 3, 4), torch.ones(2, 3, 4), torch.ones(4)),
         r"rstd must have shape \[3\]"),
        (lambda: F.group_norm_backward(torch.ones(2, 6, 4), torch.ones(2, 6, 4), torch.ones(2, 3), 4),
         "num_groups must divide"),
        (lambda: F.group_norm_backward(torch.ones(2, 6, 4), torch.ones(2, 6, 4), torch.ones(2, 2), 3),
         r"rstd must hold N \* num_groups = 6"),
        (lambda: F.layer_norm_backward("dy", torch.ones(2, 4), torch.ones(2, 1), (4,)), "dy must be a torch.Tensor"),
    ],
)
def test_backward_functions_check_their_arguments(call, match):
    with pytest.raises((TypeError, ValueError), match=match):
        call()


def test_modules_name_bad_constructor_arguments():
    with pytest.raises(TypeError, match="dropout must be a number in"):
        nl.TransformerBlock(8, 2, dropout="a")
    with pytest.raises(TypeError, match="norm_first must be a bool"):
        nl.TransformerBlock(8, 2, norm_first="yes")
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
        nl.SyncBatchNorm(4, timeout=0)
    attn = nl.MultiHeadAttention(8, 2)
    q = torch.randn(2, 3, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="q has dtype torch.float64 but the module's weights have dtype torch.float32"):
        attn(q, q, q)


# ---- catchable as torch's errors are -------------------------------------------------------------------


def test_the_library_raises_its_argument_errors_as_both_kinds():
    """Every ValueError/TypeError normlib's library code raises is a NormValueError/NormTypeError: a subclass of
    RuntimeError too, so that code written for torch (which raises RuntimeError for many of the same calls)
    catches it. The command-line tools and the examples keep Python's own."""
    import pathlib
    import re

    root = pathlib.Path(nl.__file__).parent
    plain = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("benchmark/", "examples/")) or rel in ("_cli.py", "errors.py"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"raise (ValueError|TypeError)\(", line):
                plain.append(f"{rel}:{i}: {line.strip()}")
    assert not plain, "\n".join(plain)


@pytest.mark.parametrize("call", [
    lambda: F.layer_norm(torch.randn(2, 3), (4,)),
    lambda: F.group_norm(img, 4),
    lambda: nl.LayerNorm(4)(torch.randn(2, 3)),
    lambda: nl.BatchNorm1d(3)(torch.randn(2, 3, 4, 5)),
    lambda: nl.RMSNorm(4, eps=-1.0),
    lambda: nl.GroupNorm(2.0, 6),
    lambda: nl.ops.add_rms_norm(torch.randn(2, 4), torch.randn(2, 5)),
    lambda: nl.ops.force_path("gpu"),
    lambda: nl.TransformerBlock(10, 4),
    lambda: nl.testing.check_layer_norm(None),
    lambda: nl.swap_norms("not a model"),
], ids=lambda c: "")
def test_a_bad_call_is_caught_by_except_runtime_error(call):
    with pytest.raises(RuntimeError) as caught:
        call()
    assert isinstance(caught.value, (ValueError, TypeError)) and type(caught.value).__module__ == "normlib.errors"
