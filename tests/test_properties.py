"""Property tests on exact identities of normalization (hypothesis)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import normlib as nl
import normlib.functional as F
from normlib.testing.tolerance import close

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def rows(draw, min_n=2, max_n=40):
    m = draw(st.integers(1, 6))
    n = draw(st.integers(min_n, max_n))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, n, generator=g, dtype=torch.float64)


@SETTINGS
@given(rows(), st.floats(-1e3, 1e3), st.floats(1e-2, 1e2))
def test_layer_norm_shift_and_scale_invariant(x, shift, scale):
    # LN(a*x + c) with eps*a^2 == LN(x) with eps, exactly in real arithmetic.
    eps = 1e-5
    n = x.shape[-1]
    lhs = F.layer_norm(scale * x + shift, (n,), eps=eps * scale**2)
    rhs = F.layer_norm(x, (n,), eps=eps)
    torch.testing.assert_close(lhs, rhs, rtol=1e-9, atol=1e-9 * (1 + abs(shift) / scale))


@SETTINGS
@given(rows(), st.floats(1e-2, 1e2))
def test_rms_norm_scale_invariant(x, scale):
    n = x.shape[-1]
    torch.testing.assert_close(
        F.rms_norm(scale * x, (n,), eps=1e-6 * scale**2), F.rms_norm(x, (n,), eps=1e-6), rtol=1e-10, atol=1e-12
    )


@SETTINGS
@given(rows())
def test_rms_norm_equals_layer_norm_on_zero_mean_rows(x):
    x = x - x.mean(-1, keepdim=True)
    n = x.shape[-1]
    torch.testing.assert_close(F.rms_norm(x, (n,), eps=1e-5), F.layer_norm(x, (n,), eps=1e-5), rtol=1e-10, atol=1e-12)


@st.composite
def images(draw):
    n = draw(st.integers(1, 4))
    groups = draw(st.integers(1, 4))
    per_group = draw(st.integers(1, 3))
    hw = draw(st.tuples(st.integers(1, 5), st.integers(2, 5)))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, groups * per_group, *hw, generator=g, dtype=torch.float64), groups


@SETTINGS
@given(images())
def test_group_norm_one_group_is_layer_norm_over_chw(data):
    x, _ = data
    torch.testing.assert_close(F.group_norm(x, 1), F.layer_norm(x, x.shape[1:]), rtol=1e-12, atol=1e-12)


@SETTINGS
@given(images())
def test_group_norm_c_groups_is_instance_norm(data):
    x, _ = data
    torch.testing.assert_close(F.group_norm(x, x.shape[1]), F.instance_norm(x), rtol=1e-12, atol=1e-12)


@SETTINGS
@given(images())
def test_group_norm_is_layer_norm_of_each_group(data):
    x, G = data
    N, C = x.shape[:2]
    grouped = x.reshape(N, G, -1)
    expect = F.layer_norm(grouped, grouped.shape[-1:]).reshape(x.shape)
    torch.testing.assert_close(F.group_norm(x, G), expect, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(rows(), st.integers(0, 5))
def test_a_row_alone_equals_the_same_row_in_a_batch(x, i):
    i = i % x.shape[0]
    n = x.shape[-1]
    for fn in (lambda t: F.layer_norm(t, (n,)), lambda t: F.rms_norm(t, (n,))):
        assert torch.equal(fn(x)[i], fn(x[i : i + 1])[0])


@SETTINGS
@given(rows(min_n=1, max_n=8))
def test_batch_norm_is_layer_norm_of_the_transpose(x):
    # BN over the batch of (N, C) == LN over each column: the students x subjects table
    if x.shape[0] < 2:
        x = torch.cat([x, x + 1])
    bn = F.batch_norm(x, None, None, training=True)
    ln = F.layer_norm(x.T, (x.shape[0],)).T
    torch.testing.assert_close(bn, ln, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(st.lists(st.floats(-10, 10), min_size=2, max_size=6), st.integers(1, 8))
def test_cumulative_average_with_momentum_none(means, batch):
    # momentum=None: after k batches the running mean is the plain average of the k batch means
    bn = nl.BatchNorm1d(1, momentum=None)
    for m in means:
        bn(torch.full((2 * batch, 1), m) + torch.tensor([[-1.0], [1.0]]).repeat(batch, 1))
    expect = torch.tensor(means, dtype=torch.float64).mean()
    torch.testing.assert_close(bn.running_mean.double(), expect.reshape(1), **close(torch.float32))
