"""normlib.testing: the checkers pass correct implementations and catch wrong ones.

Each wrong implementation below is a mistake a reader could make; the checker
must fail it, and its message must name the case that caught it.
"""

import copy
import re

import pytest
import torch
import torch.nn.functional as F

import normlib as nl
from normlib import testing as T

# ln_unbiased's torch.var warns on one-element rows; that warning is the reader's, not ours
pytestmark = pytest.mark.filterwarnings(r"ignore:var\(\)")

# ------------------------------------------------------------------ LayerNorm


def _dims(ns):
    return tuple(range(-len(ns), 0))


def _affine(y, w, b):
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y


def _up(x):
    """float16/bfloat16 up-cast to float32 for the statistics (chapter 05d), other dtypes as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def ln_two_pass(x, ns, w, b, eps):
    """What a reader writes after the chapters: mean, mean of squared deviations, in float32 for 16-bit input."""
    d = _dims(ns)
    xf = _up(x)
    mean = xf.mean(d, keepdim=True)
    var = ((xf - mean) ** 2).mean(d, keepdim=True)
    return _affine((xf - mean) / torch.sqrt(var + eps), w, b).to(x.dtype)


def ln_llama_order(x, ns, w, b, eps):
    """Statistics in float32, x̂ rounded to the input's dtype before γ and β (Llama's and DeBERTa's order)."""
    d = _dims(ns)
    xf = _up(x)
    mean = xf.mean(d, keepdim=True)
    xhat = ((xf - mean) * torch.rsqrt(((xf - mean) ** 2).mean(d, keepdim=True) + eps)).to(x.dtype)
    return _affine(xhat, w, b)


def ln_in_dtype(x, ns, w, b, eps):
    """Chapter 05d's "no up-cast": the right formula, every step in the input's dtype."""
    d = _dims(ns)
    mean = x.mean(d, keepdim=True)
    var = ((x - mean) ** 2).mean(d, keepdim=True)
    return _affine((x - mean) / torch.sqrt(var + eps), w, b)


def ln_drops_bias_without_weight(x, ns, w, b, eps):
    y = ln_two_pass(x, ns, None, None, eps)
    return y if w is None else _affine(y, w, b)  # β forgotten whenever γ is None


def ln_cancellation(x, ns, w, b, eps):
    d = _dims(ns)
    mean = x.mean(d, keepdim=True)
    var = (x * x).mean(d, keepdim=True) - mean * mean  # E[x²] - E[x]²
    return _affine((x - mean) / torch.sqrt(var + eps), w, b)


def ln_cancellation_16(x, ns, w, b, eps):
    """The one-pass variance only in 16 bits (right in float32 and float64): chapter 05d's bfloat16 mistake."""
    return (ln_cancellation if x.dtype in (torch.float16, torch.bfloat16) else ln_two_pass)(x, ns, w, b, eps)


def ln_eps_in_half(x, ns, w, b, eps):
    """Statistics in float32, but ε added to the variance rounded to the input's dtype first."""
    d = _dims(ns)
    xf = _up(x)
    mean = xf.mean(d, keepdim=True)
    var = ((xf - mean) ** 2).mean(d, keepdim=True).to(x.dtype)
    return _affine((xf - mean) / torch.sqrt(var + eps).to(xf.dtype), w, b).to(x.dtype)


def ln_unbiased(x, ns, w, b, eps):
    d = _dims(ns)
    mean = x.mean(d, keepdim=True)
    var = x.var(d, keepdim=True)  # unbiased: divides by n - 1
    return _affine((x - mean) / torch.sqrt(var + eps), w, b)


def ln_last_dim_only(x, ns, w, b, eps):
    mean = x.mean(-1, keepdim=True)  # ignores normalized_shape
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return _affine((x - mean) / torch.sqrt(var + eps), w, b)


def ln_batch_axis(x, ns, w, b, eps):
    mean = x.mean(0, keepdim=True)  # over the batch: that is BatchNorm
    var = ((x - mean) ** 2).mean(0, keepdim=True)
    return _affine((x - mean) / torch.sqrt(var + eps), w, b)


def ln_no_eps(x, ns, w, b, eps):
    d = _dims(ns)
    mean = x.mean(d, keepdim=True)
    var = ((x - mean) ** 2).mean(d, keepdim=True)
    return _affine((x - mean) / torch.sqrt(var), w, b)


def ln_eps_outside(x, ns, w, b, eps):
    d = _dims(ns)
    mean = x.mean(d, keepdim=True)
    var = ((x - mean) ** 2).mean(d, keepdim=True)
    return _affine((x - mean) / (torch.sqrt(var) + eps), w, b)


def ln_fixed_eps(x, ns, w, b, eps):
    return ln_two_pass(x, ns, w, b, 1e-5)


def ln_ignores_weight(x, ns, w, b, eps):
    return ln_two_pass(x, ns, None, b, eps)


def ln_ignores_bias(x, ns, w, b, eps):
    return ln_two_pass(x, ns, w, None, eps)


def ln_needs_weight(x, ns, w, b, eps):
    return ln_two_pass(x, ns, w, b, eps) * 1.0 if w.dim() else None  # AttributeError on weight=None


def ln_in_place(x, ns, w, b, eps):
    d = _dims(ns)
    with torch.no_grad():
        x -= x.mean(d, keepdim=True)
    var = (x**2).mean(d, keepdim=True)
    return _affine(x / torch.sqrt(var + eps), w, b)


def ln_view(x, ns, w, b, eps):
    if len(ns) != 1:
        return F.layer_norm(x, ns, w, b, eps)
    rows = x.view(-1, x.shape[-1])  # fails on a non-contiguous input
    return F.layer_norm(rows, ns, w, b, eps).view(x.shape)


def ln_float32_out(x, ns, w, b, eps):
    return F.layer_norm(x.float(), ns, None if w is None else w.float(), None if b is None else b.float(), eps)


class _WrongBackward(torch.autograd.Function):
    """Right forward, backward that forgets the two mean terms: dx = γ·dy·rstd."""

    @staticmethod
    def forward(ctx, x, w, b, eps):
        mean = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, mean, rstd, w)
        return (x - mean) * rstd * w + b

    @staticmethod
    def backward(ctx, dy):
        x, mean, rstd, w = ctx.saved_tensors
        xhat = (x - mean) * rstd
        dims = tuple(range(dy.dim() - 1))
        return dy * w * rstd, (dy * xhat).sum(dims), dy.sum(dims), None


def ln_wrong_backward(x, ns, w, b, eps):
    if len(ns) != 1 or w is None or b is None:
        return F.layer_norm(x, ns, w, b, eps)
    return _WrongBackward.apply(x, w, b, eps)


def ln_detached(x, ns, w, b, eps):
    return F.layer_norm(x, ns, w, b, eps).detach()


@pytest.mark.parametrize("fn", [F.layer_norm, nl.functional.layer_norm, ln_two_pass, ln_llama_order],
                         ids=lambda f: f.__name__)
def test_layer_norm_passes_correct_implementations(fn):
    report = T.check_layer_norm(fn)
    assert report.passed and report.failures == []
    assert len(report.cases) >= 30
    assert {c.name.rsplit(", ", 1)[1] for c in report.cases} == {"float32", "float64", "bfloat16", "float16"}
    assert str(report).startswith(f"check_layer_norm({fn.__name__}): {len(report.cases)} cases, all passed")


@pytest.mark.parametrize(
    "fn, case",
    [
        (ln_cancellation, "large offset, float32"),
        (ln_unbiased, "rows of 7, float32"),
        (ln_last_dim_only, "4-D input normalized over its last two dimensions, float32"),
        (ln_batch_axis, "rows of 7, float32"),
        (ln_no_eps, "rows of 7, float32"),  # eps = 1e-5 changes a variance of about 1 by far more than rounding
        (ln_eps_outside, "rows of 7, float32"),
        (ln_fixed_eps, "eps = 0.1, float32"),
        (ln_ignores_weight, "rows of 7, float32"),
        (ln_ignores_bias, "rows of 7, float32"),
        (ln_needs_weight, "weight and bias None, float32"),
        (ln_in_place, "rows of 7, float32"),
        (ln_view, "non-contiguous input, float32"),
        (ln_float32_out, "rows of 7, float64"),
        (ln_wrong_backward, "rows of 7, float32"),
        (ln_drops_bias_without_weight, "bias only (weight None), float32"),
        (ln_in_dtype, "mean 100 times the spread, bfloat16"),
        (ln_cancellation_16, "mean 100 times the spread, bfloat16"),
        (ln_eps_in_half, "values beyond 256, float16"),  # the variance of values ~300 overflows float16 too
    ],
    ids=lambda v: getattr(v, "__name__", "case"),
)
def test_layer_norm_catches_wrong_implementations(fn, case):
    report = T.check_layer_norm(fn, raise_on_failure=False)
    assert not report.passed
    assert report.failures[0].name == case, str(report)
    with pytest.raises(AssertionError, match=f"check_layer_norm\\({fn.__name__}\\) failed case"):
        T.check_layer_norm(fn)


def test_layer_norm_messages_are_plain_words():
    with pytest.raises(AssertionError) as e:
        T.check_layer_norm(ln_cancellation)
    msg = str(e.value)
    assert "large offset, float32" in msg
    assert "1e4 + N(0, 1) values" in msg  # which input
    assert "expected" in msg and "got" in msg and ("off by" in msg or "non-finite" in msg)  # what, and by how much
    assert "E[x²] - E[x]²" in msg  # what the case is for
    report = T.check_layer_norm(ln_unbiased, raise_on_failure=False)
    first = report.failures[0].message
    assert "the output differs at" in first and "allowed:" in first
    report = T.check_layer_norm(ln_wrong_backward, raise_on_failure=False)
    assert "the gradient with respect to x" in report.failures[0].message
    report = T.check_layer_norm(ln_in_place, raise_on_failure=False)
    assert any("modified its argument x in place" in c.message for c in report.failures)
    report = T.check_layer_norm(ln_view, raise_on_failure=False)
    assert "raised RuntimeError" in report.failures[0].message
    assert "(in ln_view: rows = x.view(-1, x.shape[-1])" in report.failures[0].message  # the reader's line


def test_detached_output_passes_forward_only_with_a_note():
    report = T.check_layer_norm(ln_detached)
    assert report.passed
    assert any("does not require grad" in n for n in report.notes)
    assert any("forward only" in c.note for c in report.cases)


def test_reports_are_deterministic_and_leave_the_global_rng_alone():
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = str(T.check_layer_norm(ln_unbiased, raise_on_failure=False))
    assert torch.equal(torch.get_rng_state(), state)
    b = str(T.check_layer_norm(ln_unbiased, raise_on_failure=False))
    assert a == b
    assert "0x" not in str(T.check_layer_norm(F.layer_norm))  # no addresses in a passing report


def test_dtypes_option():
    report = T.check_layer_norm(F.layer_norm, dtypes=[torch.float64])
    assert all(c.name.endswith("float64") for c in report.cases)
    report = T.check_layer_norm(F.layer_norm, dtypes=(torch.float16,))
    assert report.passed and all(c.name.endswith("float16") for c in report.cases)
    assert all(c.note == "" for c in report.cases)  # 16-bit cases are forward only, and say nothing of gradients
    with pytest.raises(ValueError, match="dtypes"):
        T.check_layer_norm(F.layer_norm, dtypes=[torch.int64])


# ------------------------------------------------------------------ RMSNorm


def rms_plain(x, ns, w, eps):
    xf = _up(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(_dims(ns), keepdim=True) + eps)
    return (y if w is None else y * w).to(x.dtype)


def rms_in_dtype(x, ns, w, eps):
    """Chapter 05d's float16 RMSNorm: squares in the input's dtype overflow from |x| = 256."""
    y = x * torch.rsqrt(x.pow(2).mean(_dims(ns), keepdim=True) + eps)
    return y if w is None else y * w


def rms_subtracts_mean(x, ns, w, eps):
    return F.layer_norm(x, ns, w, None, eps)


def rms_eps_outside(x, ns, w, eps):
    y = x / (x.pow(2).mean(_dims(ns), keepdim=True).sqrt() + eps)
    return y if w is None else y * w


def rms_no_eps(x, ns, w, eps):
    y = x / x.pow(2).mean(_dims(ns), keepdim=True).sqrt()
    return y if w is None else y * w


def rms_ignores_weight(x, ns, w, eps):
    return rms_plain(x, ns, None, eps)


def rms_sum_not_mean(x, ns, w, eps):
    y = x * torch.rsqrt(x.pow(2).sum(_dims(ns), keepdim=True) + eps)
    return y if w is None else y * w


@pytest.mark.parametrize("fn", [F.rms_norm, nl.functional.rms_norm, rms_plain], ids=lambda f: f.__name__)
def test_rms_norm_passes_correct_implementations(fn):
    assert T.check_rms_norm(fn).passed


@pytest.mark.parametrize(
    "fn, case",
    [
        (rms_subtracts_mean, "rows of 7, float32"),
        (rms_eps_outside, "one element per row, float32"),  # x / (|x| + eps) against x / sqrt(x² + eps)
        (rms_no_eps, "one element per row, float32"),
        (rms_ignores_weight, "rows of 7, float32"),
        (rms_sum_not_mean, "rows of 7, float32"),
        (rms_in_dtype, "values beyond 256, float16"),
    ],
    ids=lambda v: getattr(v, "__name__", "case"),
)
def test_rms_norm_catches_wrong_implementations(fn, case):
    report = T.check_rms_norm(fn, raise_on_failure=False)
    assert not report.passed and report.failures[0].name == case, str(report)


# ------------------------------------------------------------------ GroupNorm


def gn_reshape(x, G, w, b, eps, up=True):
    N, C = x.shape[:2]
    xg = (_up(x) if up else x).reshape(N, G, -1)
    mean = xg.mean(-1, keepdim=True)
    var = xg.var(-1, unbiased=False, keepdim=True)
    y = ((xg - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    shape = (1, C) + (1,) * (x.dim() - 2)
    if w is not None:
        y = y * w.reshape(shape)
    if b is not None:
        y = y + b.reshape(shape)
    return y.to(x.dtype)


def gn_in_dtype(x, G, w, b, eps):
    return gn_reshape(x, G, w, b, eps, up=False)


def gn_drops_bias_without_weight(x, G, w, b, eps):
    return gn_reshape(x, G, w, None if w is None else b, eps)


def gn_per_channel(x, G, w, b, eps):
    return gn_reshape(x, x.shape[1], w, b, eps)  # InstanceNorm, whatever G says


def gn_interleaved(x, G, w, b, eps):
    N, C = x.shape[:2]
    # channels c, c + G, c + 2G, ... in one group instead of consecutive ones
    xt = x.reshape(N, C // G, G, -1).transpose(1, 2)
    return gn_reshape(xt.reshape(x.shape), G, None, None, eps).reshape(N, G, C // G, -1).transpose(1, 2).reshape(
        x.shape
    ) * (1 if w is None else w.reshape((1, C) + (1,) * (x.dim() - 2))) + (0 if b is None else b.reshape((1, C) + (1,) * (x.dim() - 2)))


def gn_unbiased(x, G, w, b, eps):
    N, C = x.shape[:2]
    xg = x.reshape(N, G, -1)
    y = ((xg - xg.mean(-1, keepdim=True)) / torch.sqrt(xg.var(-1, keepdim=True) + eps)).reshape(x.shape)
    shape = (1, C) + (1,) * (x.dim() - 2)
    return y * (1 if w is None else w.reshape(shape)) + (0 if b is None else b.reshape(shape))


def gn_view(x, G, w, b, eps):
    x.view(x.shape[0], G, -1)  # fails on channels_last
    return F.group_norm(x, G, w, b, eps)


@pytest.mark.parametrize("fn", [nl.functional.group_norm, gn_reshape], ids=lambda f: f.__name__)
def test_group_norm_passes_correct_implementations(fn):
    assert T.check_group_norm(fn).passed


def test_group_norm_reports_torchs_own_backward_failure_with_bias_but_no_weight():
    """torch's F.group_norm computes every case but one: its backward raises when β is given without γ
    ("tensor does not have a device", torch 2.13 on CPU). The checker says exactly that, and nothing else."""
    report = T.check_group_norm(F.group_norm, raise_on_failure=False)
    if report.passed:
        pytest.skip("this torch's group_norm backward takes a bias without a weight")
    assert [c.name for c in report.failures] == ["bias only (weight None), float32", "bias only (weight None), float64"]
    assert all("backward through your implementation raised RuntimeError" in c.message for c in report.failures)


@pytest.mark.parametrize(
    "fn, case",
    [
        (gn_per_channel, "3-D input, 3 groups of 2 channels, float32"),
        (gn_interleaved, "3-D input, 3 groups of 2 channels, float32"),
        (gn_unbiased, "3-D input, 3 groups of 2 channels, float32"),
        (gn_view, "channels_last input, float32"),
        (gn_drops_bias_without_weight, "bias only (weight None), float32"),
        (gn_in_dtype, "mean 100 times the spread, bfloat16"),
    ],
    ids=lambda v: getattr(v, "__name__", "case"),
)
def test_group_norm_catches_wrong_implementations(fn, case):
    report = T.check_group_norm(fn, raise_on_failure=False)
    assert not report.passed and report.failures[0].name == case, str(report)


# ------------------------------------------------------------------ BatchNorm


class ScratchBatchNorm(torch.nn.Module):
    """A correct BatchNorm written from the chapter: buffers, unbiased running variance, torch's momentum."""

    unbiased_running_var = True
    keras_momentum = False
    batch_stats_in_eval = False
    update_running = True
    no_grad_update = True
    use_momentum_attr = True
    eps_in_sqrt = True
    cancellation = False
    stat_dims = None

    def __init__(self, num_features, eps=1e-5, momentum=0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = torch.nn.Parameter(torch.ones(num_features))
        self.bias = torch.nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x):
        dims = self.stat_dims or [0] + list(range(2, x.dim()))
        shape = (1, -1) + (1,) * (x.dim() - 2)
        if self.training or self.batch_stats_in_eval:
            mean = x.mean(dims, keepdim=True)
            if self.cancellation:
                var = (x * x).mean(dims, keepdim=True) - mean * mean
            else:
                var = ((x - mean) ** 2).mean(dims, keepdim=True)
            if self.training and self.update_running:
                n = x.numel() // x.shape[1]
                m = self.momentum if self.use_momentum_attr else 0.1
                batch_var = var * n / (n - 1) if self.unbiased_running_var else var
                if self.keras_momentum:
                    m = 1 - m
                if self.no_grad_update:
                    with torch.no_grad():
                        self.running_mean.mul_(1 - m).add_(m * mean.reshape(-1))
                        self.running_var.mul_(1 - m).add_(m * batch_var.reshape(-1))
                else:
                    self.running_mean = (1 - m) * self.running_mean + m * mean.reshape(-1)
                    self.running_var = (1 - m) * self.running_var + m * batch_var.reshape(-1)
        else:
            mean, var = self.running_mean.reshape(shape), self.running_var.reshape(shape)
        denom = torch.sqrt(var + self.eps) if self.eps_in_sqrt else torch.sqrt(var)
        return (x - mean) / denom * self.weight.reshape(shape) + self.bias.reshape(shape)


def _variant(name, **attrs):
    return type(name, (ScratchBatchNorm,), attrs)


class PlainAttributesBatchNorm(ScratchBatchNorm):
    """Running statistics as plain attributes, not buffers: .to(float64) leaves them float32."""

    def __init__(self, num_features):
        super().__init__(num_features)
        rm, rv = self.running_mean, self.running_var
        del self._buffers["running_mean"], self._buffers["running_var"]
        self.running_mean, self.running_var = rm, rv


class NotAModule:
    def __init__(self, num_features):
        self.weight = torch.ones(num_features)
        self.bias = torch.zeros(num_features)
        self.running_mean = torch.zeros(num_features)
        self.running_var = torch.ones(num_features)

    def __call__(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True)


@pytest.mark.parametrize(
    "cls, layouts",
    [(torch.nn.BatchNorm1d, 2), (torch.nn.BatchNorm2d, 1), (nl.BatchNorm1d, 2), (nl.BatchNorm2d, 1), (ScratchBatchNorm, 3)],
    ids=lambda v: getattr(v, "__module__", "")[:5] + "." + getattr(v, "__name__", str(v)),
)
def test_batch_norm_passes_correct_implementations(cls, layouts):
    report = T.check_batch_norm(cls)
    assert report.passed
    tested = {c.name.split(",")[0] for c in report.cases}
    assert len(tested) == layouts, tested
    assert any("momentum = 0.5" in c.name for c in report.cases)
    assert any("float64" in c.name for c in report.cases)


def test_batch_norm_momentum_none_is_a_cumulative_average():
    assert T.check_batch_norm(lambda c: torch.nn.BatchNorm1d(c, momentum=None), ndims=(2,)).passed


@pytest.mark.parametrize(
    "cls, case, words",
    [
        (_variant("NeverUpdates", update_running=False), "2-D, float32: training step 1", "running_mean afterwards"),
        (_variant("BatchInEval", batch_stats_in_eval=True), "2-D, float32: evaluation, then training again", "evaluation"),
        (_variant("BiasedRunningVar", unbiased_running_var=False), "2-D, float32: training step 1", "unbiased"),
        (_variant("KerasMomentum", keras_momentum=True), "2-D, float32: training step 1", "running_mean"),
        (_variant("HardCodedMomentum", use_momentum_attr=False), "2-D, float32: momentum = 0.5", "momentum 0.5"),
        (_variant("GraphInBuffers", no_grad_update=False), "2-D, float32: training step 1", "requires grad"),
        (_variant("NoEps", eps_in_sqrt=False), "2-D, float32: training step 2", "the output"),
        (_variant("Cancellation", cancellation=True), "2-D, float32: large offset", "large offset"),
        (_variant("WrongAxis", stat_dims=[0, 1]), "2-D, float32: training step 1", "the output"),
        (PlainAttributesBatchNorm, "2-D, float64: initial weight, bias and running statistics", "register_buffer"),
        (NotAModule, "2-D, float32: initial weight, bias and running statistics", "torch.nn.Module"),
    ],
    ids=lambda v: getattr(v, "__name__", "case") if isinstance(v, type) else "case",
)
def test_batch_norm_catches_wrong_implementations(cls, case, words):
    report = T.check_batch_norm(cls, raise_on_failure=False)
    assert not report.passed
    first = report.failures[0]
    assert first.name == case, str(report)
    assert words in first.message, first.message
    with pytest.raises(AssertionError, match="check_batch_norm"):
        T.check_batch_norm(cls)


class WrongSecondStep(ScratchBatchNorm):
    """Right on the first training batch, off by 1% from the second on."""

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        y = super().forward(x)
        return y * 1.01 if self.training and self.calls >= 2 else y


def test_batch_norm_skips_the_cases_carried_on_from_a_failed_one():
    report = T.check_batch_norm(WrongSecondStep, ndims=(2,), raise_on_failure=False)
    status = {c.name: "skip" if c.skipped else c.passed for c in report.cases}
    assert status["2-D, float32: training step 1"] is True
    assert status["2-D, float32: training step 2"] is False
    assert status["2-D, float32: training step 3"] == "skip"
    assert status["2-D, float32: evaluation, then training again"] == "skip"
    assert status["2-D, float32: eps = 0.1"] is True  # a fresh module: runs whatever came before
    skipped = [c for c in report.cases if c.skipped]
    assert "training steps before it failed" in skipped[1].message
    assert "skip 2-D, float32: training step 3" in str(report)
    with pytest.raises(AssertionError, match="failed case 3 of .*training step 2"):  # the failure, not a skip
        T.check_batch_norm(WrongSecondStep, ndims=(2,))


def test_batch_norm_report_follows_the_case_table():
    from normlib.testing.batch_norm import _BN_CASES

    report = T.check_batch_norm(torch.nn.BatchNorm1d, ndims=(3,))
    expected = [
        f"3-D, {str(dtype)[6:]}: {case.name}"
        for dtype in (torch.float32, torch.float64)
        for case in _BN_CASES
        if dtype in case.dtypes
    ]
    assert [c.name for c in report.cases] == expected


def test_batch_norm_layout_options():
    # a module for (N, C) only, told so: only 2-D runs, no notes
    report = T.check_batch_norm(ScratchBatchNorm, ndims=(2,))
    assert report.passed and {c.name.split(",")[0] for c in report.cases} == {"2-D"}
    # torch's BatchNorm1d refuses 4-D input: left out with a note, not failed
    report = T.check_batch_norm(torch.nn.BatchNorm1d)
    assert any("4-D input (N, C, H, W) not tested" in n for n in report.notes)
    # asked for a layout it refuses: fails, and says what the module raised
    report = T.check_batch_norm(torch.nn.BatchNorm1d, ndims=(4,), raise_on_failure=False)
    assert not report.passed and "raised ValueError" in report.failures[0].message
    with pytest.raises(ValueError, match="ndims"):
        T.check_batch_norm(ScratchBatchNorm, ndims=(5,))


def test_checkers_do_not_change_the_module_class_state():
    before = copy.deepcopy(torch.nn.BatchNorm1d(3).state_dict())
    T.check_batch_norm(torch.nn.BatchNorm1d)
    after = torch.nn.BatchNorm1d(3).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_exported_from_the_package():
    assert nl.testing is T
    assert {"check_layer_norm", "check_rms_norm", "check_group_norm", "check_batch_norm"} <= set(T.__all__)


@pytest.mark.parametrize("checker", ["check_layer_norm", "check_rms_norm", "check_group_norm"])
def test_a_checker_refuses_to_check_nothing_or_a_malformed_dtypes(checker):
    """An empty ``dtypes`` would run no case and report "all passed"; a single dtype or a string is not a
    sequence of them. Both are refused up front, naming the argument."""
    import torch.nn.functional as TF

    import normlib.testing as T

    fn = {"check_layer_norm": TF.layer_norm, "check_rms_norm": TF.rms_norm, "check_group_norm": TF.group_norm}[checker]
    with pytest.raises(ValueError, match="dtypes must name at least one dtype"):
        getattr(T, checker)(fn, dtypes=[])
    for bad in (torch.float32, "float32", {torch.float32}):
        with pytest.raises(TypeError, match="dtypes must be a list or tuple"):
            getattr(T, checker)(fn, dtypes=bad)


def test_check_batch_norm_refuses_empty_or_malformed_ndims():
    import normlib.testing as T

    with pytest.raises(ValueError, match="ndims must name at least one layout"):
        T.check_batch_norm(torch.nn.BatchNorm1d, ndims=[])
    for bad in (2, "2", {2}):
        with pytest.raises(TypeError, match="ndims must be a list or tuple"):
            T.check_batch_norm(torch.nn.BatchNorm1d, ndims=bad)


# ------------------------------------------------------------------ margins


class _Margins:
    """Records, per case, the largest |got - expected| / allowed of every comparison a checker makes."""

    def __init__(self, monkeypatch):
        from normlib.testing import _cases, _report, batch_norm

        self.worst: dict = {}
        self.case = None
        compare = _report._compare
        margins = self

        class Case(_report.CaseResult):
            def __init__(self, name, *args, **kwargs):
                super().__init__(name, *args, **kwargs)
                margins.case = name
                margins.worst.setdefault(name, 0.0)

        def spy(got, expected, what, dtype, allowed):
            if isinstance(got, torch.Tensor) and got.shape == expected.shape:
                g, e = got.detach().double().reshape(-1), expected.detach().double().reshape(-1)
                limit = torch.as_tensor(allowed[0], dtype=torch.float64).expand(expected.shape).reshape(-1)
                r = ((g - e).abs() / limit).nan_to_num(nan=float("inf")).max().item() if g.numel() else 0.0
                self.worst[self.case] = max(self.worst[self.case], r)
            return compare(got, expected, what, dtype, allowed)

        for module in (_cases, batch_norm):
            monkeypatch.setattr(module, "_compare", spy)
            monkeypatch.setattr(module, "CaseResult", Case)


CORRECT = [
    (T.check_layer_norm, F.layer_norm), (T.check_layer_norm, nl.functional.layer_norm),
    (T.check_layer_norm, ln_two_pass), (T.check_layer_norm, ln_llama_order),
    (T.check_rms_norm, F.rms_norm), (T.check_rms_norm, nl.functional.rms_norm), (T.check_rms_norm, rms_plain),
    (T.check_group_norm, nl.functional.group_norm), (T.check_group_norm, gn_reshape),
    (T.check_batch_norm, torch.nn.BatchNorm1d), (T.check_batch_norm, nl.BatchNorm2d), (T.check_batch_norm, ScratchBatchNorm),
]


@pytest.mark.parametrize("checker, fn", CORRECT, ids=lambda v: getattr(v, "__name__", str(v)))
def test_correct_implementations_pass_with_a_wide_margin(checker, fn, monkeypatch):
    """A correct implementation's worst element stays below a quarter of what is allowed, in every case:
    another CPU's summation order (a few units of rounding) cannot turn a pass into a failure."""
    margins = _Margins(monkeypatch)
    assert checker(fn).passed
    assert margins.worst and max(margins.worst.values()) <= 0.25, sorted(margins.worst.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.parametrize(
    "checker, fn, case",
    [
        (T.check_layer_norm, ln_in_dtype, "mean 100 times the spread, bfloat16"),
        (T.check_layer_norm, ln_in_dtype, "mean 100 times the spread, float16"),
        (T.check_layer_norm, ln_cancellation_16, "mean 100 times the spread, bfloat16"),
        (T.check_layer_norm, ln_cancellation, "large offset, float32"),
        (T.check_group_norm, gn_in_dtype, "mean 100 times the spread, bfloat16"),
        (T.check_group_norm, gn_in_dtype, "mean 100 times the spread, float16"),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_low_precision_mistakes_fail_by_a_wide_margin(checker, fn, case, monkeypatch):
    """Chapter 05d's mistakes are off by many times what rounding allows (or non-finite), not by a hair."""
    margins = _Margins(monkeypatch)
    report = checker(fn, raise_on_failure=False)
    assert case in {c.name for c in report.failures}
    assert margins.worst[case] >= 4, margins.worst[case]


def test_batch_norm_in_16_bits_on_request():
    """``dtypes`` adds chapter 05d's cases in bfloat16 and float16 (forward only): normlib's BatchNorm keeps its
    statistics in float32 and passes; a BatchNorm computed in the input's dtype fails on a batch far from zero."""
    half = (torch.bfloat16, torch.float16)
    report = T.check_batch_norm(nl.BatchNorm1d, ndims=(3,), dtypes=half)
    assert report.passed and {c.name for c in report.cases} == {
        "3-D, bfloat16: mean 100 times the spread", "3-D, float16: mean 100 times the spread",
        "3-D, float16: values beyond 256"}
    report = T.check_batch_norm(ScratchBatchNorm, ndims=(3,), dtypes=half, raise_on_failure=False)
    assert "3-D, bfloat16: mean 100 times the spread" in {c.name for c in report.failures}
    assert len(T.check_batch_norm(torch.nn.BatchNorm1d, ndims=(2,)).cases) == len(
        T.check_batch_norm(torch.nn.BatchNorm1d, ndims=(2,), dtypes=(torch.float32, torch.float64)).cases)
    with pytest.raises(ValueError, match="dtypes must name at least one dtype"):
        T.check_batch_norm(nl.BatchNorm1d, dtypes=())
    with pytest.raises(TypeError, match="dtypes must be a list or tuple"):
        T.check_batch_norm(nl.BatchNorm1d, dtypes=torch.float16)


@pytest.mark.parametrize("call, error, words", [
    (lambda: T.check_layer_norm(F.layer_norm, gradients=None), TypeError, "gradients must be True or False"),
    (lambda: T.check_layer_norm(F.layer_norm, gradients="yes"), TypeError, "gradients must be True or False"),
    (lambda: T.check_rms_norm(F.rms_norm, raise_on_failure=None), TypeError, "raise_on_failure must be True or False"),
    (lambda: T.check_group_norm(None), TypeError, "fn must be your implementation, a callable"),
    (lambda: T.check_layer_norm(3), TypeError, "fn must be your implementation, a callable"),
    (lambda: T.check_layer_norm(F.layer_norm, dtypes=[torch.float32, torch.float32]), ValueError, "twice"),
    (lambda: T.check_batch_norm(torch.nn.BatchNorm1d, ndims=(2.0,)), ValueError, "ints 2, 3 and 4 (got 2.0)"),
    (lambda: T.check_batch_norm(torch.nn.BatchNorm1d, ndims=("2",)), ValueError, "(got '2')"),
    (lambda: T.check_batch_norm(torch.nn.BatchNorm1d(3)), TypeError, "cls must be your class"),
    (lambda: T.check_batch_norm(torch.nn.BatchNorm1d, ndims=(2, 2)), ValueError, "names a layout twice"),
    (lambda: T.check_batch_norm(torch.nn.BatchNorm1d, gradients=1), TypeError, "gradients must be True or False"),
], ids=lambda v: "" if callable(v) else str(v))
def test_checker_options_are_refused_by_name(call, error, words):
    """A malformed argument of the checker itself is one clear error, never a report of every case failed."""
    with pytest.raises(error, match=re.escape(words)):
        call()


def test_a_numpy_eps_or_momentum_is_a_number():
    import numpy as np

    class NumpyHyper(torch.nn.BatchNorm1d):
        def __init__(self, n):
            super().__init__(n)
            self.eps, self.momentum = np.float32(1e-5), np.float64(0.1)

    assert T.check_batch_norm(NumpyHyper, ndims=(2,)).passed
