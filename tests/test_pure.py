"""normlib.pure, the book's formulas on lists (what the live cells run in the browser), against
normlib.functional and torch in float64, on the articles' worked examples, and on bad input."""

import ast
import importlib.util
import inspect
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as TF

import normlib as nl
import normlib.functional as F
from normlib import pure
from normlib.testing.tolerance import close

# Both sides compute in float64 with sums of at most a few hundred terms; normlib.pure's sums are
# correctly rounded and it rounds a few more times on the way (divide, scale, shift), so the
# one rule's bound with four roundings holds (normlib.testing.tolerance).
TOL = close(torch.float64, roundings=4)


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _close(got, expected, **tol):
    torch.testing.assert_close(_t(got), expected.to(torch.float64), **(tol or TOL))


def _randn(*shape, scale=1.0, shift=0.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale + shift).tolist()


@pytest.mark.parametrize("shape", [(7,), (3, 13), (2, 3, 5), (4, 1), (2, 100)])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_matches_normlib(shape, affine):
    x = _randn(*shape, scale=3.0, shift=2.0)
    n = shape[-1]
    w, b = (_randn(n), _randn(n)) if affine else (None, None)
    expected = F.layer_norm(_t(x), (n,), None if w is None else _t(w), None if b is None else _t(b), 1e-5)
    _close(pure.layer_norm(x, w, b, eps=1e-5), expected)
    torch.testing.assert_close(expected, TF.layer_norm(_t(x), (n,), None if w is None else _t(w),
                                                       None if b is None else _t(b), 1e-5), **TOL)


@pytest.mark.parametrize("eps", [None, 0.0, 1e-6, 0.5])
@pytest.mark.parametrize("affine", [False, True])
def test_rms_norm_matches_normlib(eps, affine):
    x = _randn(3, 4, 24, scale=2.0, shift=0.5)
    w = _randn(24) if affine else None
    expected = F.rms_norm(_t(x), (24,), None if w is None else _t(w), eps)
    _close(pure.rms_norm(x, w, eps=eps), expected)


@pytest.mark.parametrize("shape", [(8, 3), (4, 5, 6), (2, 3, 4, 5)])
@pytest.mark.parametrize("affine", [False, True])
def test_batch_norm_matches_normlib_in_training_and_evaluation(shape, affine):
    C = shape[1]
    w, b = (_randn(C), _randn(C)) if affine else (None, None)
    rm, rv = [0.0] * C, [1.0] * C
    rm_t, rv_t = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    wt, bt = (None, None) if w is None else (_t(w), _t(b))
    for step in range(4):  # the running statistics follow normlib's over several batches
        x = _randn(*shape, scale=2.0, shift=step)
        _close(pure.batch_norm(x, rm, rv, w, b, training=True, momentum=0.3),
               F.batch_norm(_t(x), rm_t, rv_t, wt, bt, training=True, momentum=0.3))
        _close(rm, rm_t)
        _close(rv, rv_t)
    x = _randn(*shape)
    _close(pure.batch_norm(x, rm, rv, w, b, training=False), F.batch_norm(_t(x), rm_t, rv_t, wt, bt, training=False))


@pytest.mark.parametrize("momentum", [0.1, None, 1.0])
@pytest.mark.parametrize("track", [True, False])
def test_the_batch_norm_layer_matches_normlib_and_torch(momentum, track):
    ours = pure.BatchNorm(3, momentum=momentum, track_running_stats=track)
    layers = (nl.BatchNorm1d(3, momentum=momentum, track_running_stats=track).double(),
              torch.nn.BatchNorm1d(3, momentum=momentum, track_running_stats=track).double())
    for step in range(5):  # training: batch statistics, recorded
        x = _randn(6, 3, 2, scale=1.5, shift=step)
        got = ours(x)
        for layer in layers:
            _close(got, layer(_t(x)).detach())
    for layer in layers:
        if track:
            _close(ours.running_mean, layer.running_mean)
            _close(ours.running_var, layer.running_var)
            assert ours.num_batches_tracked == layer.num_batches_tracked.item() == 5
        else:
            assert ours.running_mean is ours.running_var is layer.running_mean is None
    ours.eval()
    x = _randn(4, 3, 2)
    for layer in layers:  # evaluation: the running statistics (batch ones without them), nothing recorded
        _close(ours(x), layer.eval()(_t(x)).detach())
    assert ours.num_batches_tracked == (5 if track else 0)


@pytest.mark.parametrize("shape,groups", [((2, 6), 3), ((3, 6, 5), 1), ((3, 6, 5), 2), ((2, 4, 3, 5), 4),
                                          ((2, 4, 3, 5), 2)])
@pytest.mark.parametrize("affine", [False, True])
def test_group_norm_matches_normlib(shape, groups, affine):
    C = shape[1]
    x = _randn(*shape, scale=2.0, shift=-1.0)
    w, b = (_randn(C), _randn(C)) if affine else (None, None)
    wt, bt = (None, None) if w is None else (_t(w), _t(b))
    _close(pure.group_norm(x, groups, w, b), F.group_norm(_t(x), groups, wt, bt))
    if len(shape) > 2:  # InstanceNorm needs positions to normalize over
        _close(pure.instance_norm(x, w, b), F.instance_norm(_t(x), None, None, wt, bt))


def test_softmax_and_attention_match_torch():
    q, k, v = _randn(5, 8), _randn(7, 8), _randn(7, 3)
    scores = _t(q) @ _t(k).T / math.sqrt(8)  # (T, S)
    _close(pure.softmax(scores.tolist()), torch.softmax(scores, -1))
    mask = (torch.rand(5, 7) > 0.3) | torch.eye(5, 7, dtype=torch.bool)  # every query sees a key
    for m in (None, mask):
        out, weights = pure.attention(q, k, v, None if m is None else (~m).tolist())  # True: hidden
        expected = TF.scaled_dot_product_attention(_t(q), _t(k), _t(v), attn_mask=m)
        _close(out, expected)
        _close(weights, torch.softmax(scores.masked_fill(~m, -math.inf) if m is not None else scores, -1))
    # a query with every key masked attends to nothing, as in normlib's MultiHeadAttention
    hide = [[True, True], [False, True]]  # query 0 may look at no key, query 1 at key 0 only
    out, weights = pure.attention([[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]], [[1.0, 2.0], [3.0, 4.0]], hide)
    assert weights == [[0.0, 0.0], [1.0, 0.0]] and out == [[0.0, 0.0], [1.0, 2.0]]
    mha = nl.MultiHeadAttention(2, 1).double()
    with torch.no_grad():
        for proj in (mha.w_q, mha.w_k, mha.w_v, mha.w_o):
            proj.weight.copy_(torch.eye(2))
            proj.bias.zero_()
    x = _t([[[1.0, 0.0], [0.0, 1.0]]])
    kv = _t([[[1.0, 2.0], [3.0, 4.0]]])
    _close(out, mha(x, x, kv, attn_mask=torch.tensor(hide))[0].detach())  # keys x, values kv
    _close(pure.matmul(q, pure.transpose(k)), _t(q) @ _t(k).T)


# The worked examples of the articles that the chapters reproduce.

def test_article_002_tokens_become_minus_one_and_one():
    """Article 002 (chapter 06): LayerNorm of [[1, 3], [5, 7], [9, 11]] gives [-1, 1] for each token."""
    x = [[1, 3], [5, 7], [9, 11]]
    assert pure.layer_norm(x, eps=0.0) == [[-1.0, 1.0]] * 3
    r = 1 / math.sqrt(1 + 1e-12)  # each row's variance is 1
    _close(pure.layer_norm(x, eps=1e-12), _t([[-r, r]] * 3))
    _close(pure.layer_norm(x, eps=1e-12), F.layer_norm(_t(x), (2,), eps=1e-12))


def test_chapter_05_grades_by_column_and_by_row():
    """Chapter 05's students and subjects: BatchNorm standardizes the columns, LayerNorm the rows."""
    grades = [[90, 80, 70], [60, 50, 40]]
    assert pure.batch_norm(grades, training=True, eps=0.0) == [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]
    s = math.sqrt(1.5)
    _close(pure.layer_norm(grades, eps=0.0), _t([[s, 0.0, -s]] * 2))


def test_chapter_03_a_batch_of_two_carries_one_bit_per_feature():
    """Chapter 03's exercise: with two samples BatchNorm gives ±1 whatever the values, unless the two are
    within about √ε of each other (then ±δ/2 / √(δ²/4 + ε))."""
    _close(pure.batch_norm([[1.0, 10.0], [3.0, -10.0]], training=True), _t([[-1.0, 1.0], [1.0, -1.0]]),
           rtol=0, atol=1e-4)
    y2 = pure.batch_norm([[1.0, 10.0], [1.001, -10.0]], training=True)
    expected = 5e-4 / math.sqrt(2.5e-7 + 1e-5)  # ≈ 0.156
    _close([row[0] for row in y2], _t([-expected, expected]), rtol=1e-9, atol=0)
    _close(y2, torch.nn.BatchNorm1d(2).double()(_t([[1.0, 10.0], [1.001, -10.0]])).detach())


def test_chapter_05_momentum_one_keeps_the_last_batch():
    bn = pure.BatchNorm(1, momentum=1.0)
    bn([[1.0], [2.0], [4.0], [7.0]])
    assert bn.running_mean == [3.5] and bn.running_var == [7.0]  # the unbiased variance, 21 / 3


def test_one_sample_in_training_is_refused_as_torch_refuses_it():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        pure.BatchNorm(3)([[3.0, -1.0, 7.0]])
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        torch.nn.BatchNorm1d(3)(torch.tensor([[3.0, -1.0, 7.0]]))
    # in evaluation one sample is fine: the running statistics normalize it
    assert pure.BatchNorm(3).eval()([[3.0, -1.0, 7.0]]) == [[3.0 / math.sqrt(1 + 1e-5), -1.0 / math.sqrt(1 + 1e-5),
                                                              7.0 / math.sqrt(1 + 1e-5)]]


def test_softmax_is_not_scale_invariant_as_layer_norm_is():
    """Chapter 06: softmax([1, 3]) differs from softmax([2, 6]); LayerNorm gives both the same row."""
    _close(pure.softmax([1.0, 3.0]), torch.softmax(_t([1.0, 3.0]), -1))
    assert pure.softmax([1.0, 3.0]) != pure.softmax([2.0, 6.0])
    assert pure.layer_norm([1.0, 3.0], eps=0.0) == pure.layer_norm([2.0, 6.0], eps=0.0)


# Bad input: a clear error that names the argument, never a plausible wrong number.

@pytest.mark.parametrize("call,error,words", [
    (lambda: pure.layer_norm([[1, 2], [3]]), ValueError, "x is not rectangular"),
    (lambda: pure.layer_norm([[1, "2"]]), TypeError, "x[0][1] must be a number"),
    (lambda: pure.layer_norm([[1, True]]), TypeError, "x[0][1] must be a number"),
    (lambda: pure.layer_norm([[1, 2], [3, [4]]]), ValueError, "x[1] is not rectangular"),
    (lambda: pure.layer_norm([]), ValueError, "x has no values"),
    (lambda: pure.layer_norm(3.0), ValueError, "x must have at least 1 dimension"),
    (lambda: pure.layer_norm([1, 2], eps=-1e-5), ValueError, "eps must be a finite number >= 0"),
    (lambda: pure.layer_norm([1, 2], eps="1e-5"), TypeError, "eps must be a real number"),
    (lambda: pure.layer_norm([1, 2], weight=[1, 2, 3]), ValueError, "weight must hold 2 numbers"),
    (lambda: pure.rms_norm([1, 2], eps=math.nan), ValueError, "eps must be a finite number"),
    (lambda: pure.batch_norm([1, 2], training=True), ValueError, "x must have at least 2 dimension"),
    (lambda: pure.batch_norm([[1, 2], [3, 4]]), ValueError, "evaluation (training=False) needs running_mean"),
    (lambda: pure.batch_norm([[1, 2], [3, 4]], [0.0], [1.0], training=True), ValueError, "running_mean must be"),
    (lambda: pure.batch_norm([[1, 2], [3, 4]], training=1), TypeError, "training must be True or False"),
    (lambda: pure.batch_norm([[1, 2], [3, 4]], training=True, momentum=2), ValueError, "momentum must be"),
    (lambda: pure.BatchNorm(0), ValueError, "num_features must be a positive int"),
    (lambda: pure.BatchNorm(2)([[1, 2, 3], [4, 5, 6]]), ValueError, "weight must hold 3 numbers"),
    (lambda: pure.group_norm([[1, 2, 3]], 2), ValueError, "num_groups=2 must divide the number of channels C=3"),
    (lambda: pure.group_norm([[1, 2, 3]], 0), ValueError, "num_groups must be a positive int"),
    (lambda: pure.instance_norm([[1, 2, 3]]), ValueError, "x must have at least 3 dimension"),
    (lambda: pure.attention([[1.0]], [[1.0, 2.0]], [[1.0]]), ValueError, "do not fit"),
    (lambda: pure.attention([[1.0]], [[1.0]], [[1.0]], [[1]]), ValueError, "attn_mask must be 1 rows of 1 booleans"),
    (lambda: pure.attention([[1.0]], [[1.0]], [[1.0]], [True]), ValueError, "attn_mask must be 1 rows"),
    (lambda: pure.matmul([[1, 2]], [[1, 2]]), ValueError, "a @ b needs"),
])
def test_bad_input_gets_an_error_naming_the_argument(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert words in str(info.value), str(info.value)


# What lets the module run in the reader's browser and print the same numbers there.

SOURCE = Path(pure.__file__)
ROOT = Path(__file__).resolve().parents[1]


def test_the_module_needs_only_the_standard_library(tmp_path):
    """It runs in a Python with nothing installed (no site-packages, so no torch), in a normlib package that
    holds only it and normlib.errors, as the book's live cells install it in the browser (book/_ext/live_cells.py)."""
    spec = importlib.util.spec_from_file_location("_live_cells", ROOT / "book" / "_ext" / "live_cells.py")
    live_cells = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(live_cells)
    package = tmp_path / "normlib"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in live_cells.MODULES:
        source = (SOURCE.parent / name).read_text(encoding="utf-8")
        tree = ast.parse(source)
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) and n.module and not n.level}
        assert imported <= set(sys.stdlib_module_names) | {"__future__"}, (name, imported)
        (package / name).write_text(source, encoding="utf-8")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from normlib import pure; "
            "print(pure.layer_norm([[1, 3], [5, 7], [9, 11]], eps=0.0))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[-1.0, 1.0], [-1.0, 1.0], [-1.0, 1.0]]"


def test_no_sum_and_no_power_that_could_round_differently_in_another_python():
    """Built-in sum() of floats rounds differently since Python 3.12 (compensated), and ** goes through
    the C library's pow: the module uses math.fsum and d * d, so the browser's Python 3.14 and the
    notebook's print the same floats."""
    tree = ast.parse(SOURCE.read_text(encoding="utf-8"))
    sums = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "sum"]
    powers = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow)]
    assert not sums and not powers, (sums, powers)


def test_every_public_function_has_a_docstring():
    for name in pure.__all__:
        assert inspect.getdoc(getattr(pure, name)), name
