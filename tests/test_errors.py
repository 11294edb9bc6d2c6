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


def test_momentum_and_num_features():
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\] \(got 1.5\)"):
        nl.BatchNorm1d(3, momentum=1.5)
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
