"""One routing decision per call: normlib.ops.routing.route, its rules, and what each path computes.

The modules run torch's own op on CPU wherever its statistics can be
trusted ("native"), and normlib's reference math everywhere else; both are
compared here with each other, forward and backward, and the check that
picks between them is tested on the inputs that break torch's statistics.
"""

import pytest
import torch
import torch.nn.functional as TF

import normlib as nl
import normlib.functional as F
from normlib import ops
from normlib.ops import native, routing
from normlib.testing.tolerance import close

F32 = torch.float32


# ---- the rules ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op,x,kw,path",
    [
        ("layer_norm", torch.randn(4, 8), {}, "native"),
        ("layer_norm", torch.randn(4, 2, 8), {"rows": False}, "native"),
        # torch's RMSNorm that returns its rstd (torch._fused_rms_norm), where this torch has one
        ("rms_norm", torch.randn(4, 8), {}, "native" if native.HAS_RMS_NORM else "reference"),
        ("rms_norm", torch.randn(4, 8), {"weight": torch.randn(8, dtype=torch.float64)}, "reference"),
        ("group_norm", torch.randn(4, 6, 5), {"rows": False}, "native"),
        ("batch_norm", torch.randn(4, 6, 5), {"rows": False}, "native"),
        ("instance_norm", torch.randn(4, 6, 5), {"rows": False}, "native"),
        ("layer_norm", torch.empty(4, 8, device="meta"), {}, "reference"),
        ("layer_norm", torch.randn(4, 8, dtype=torch.bfloat16), {}, "reference"),
        ("layer_norm", torch.randn(4, 8, dtype=torch.float64), {}, "native"),
    ],
)
def test_route_on_cpu(op, x, kw, path):
    assert ops.route(op, x, **kw) == path


def test_route_under_autocast_transforms_tracing_and_force():
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ops.route("layer_norm", x) == "reference"  # the reference follows torch's autocast policy
    seen = []
    torch.func.vmap(lambda r: seen.append(ops.route("layer_norm", r)) or r)(x)
    assert seen == ["reference"]
    seen.clear()
    torch.jit.trace(lambda t: seen.append(ops.route("layer_norm", t)) or t * 1, (x,), check_trace=False)
    assert seen == ["reference"]
    assert ops.route("layer_norm", x.bfloat16()) == "reference"  # torch sums bfloat16 gradients of γ in bfloat16
    with ops.force_path("reference"):
        assert ops.route("layer_norm", x) == "reference"
        with ops.force_path("native"):
            assert ops.route("group_norm", x, rows=False) == "native"
        assert ops.route("layer_norm", x) == "reference"  # nests: the outer block's path again
    assert routing.forced_path() is None


def test_route_reads_the_crossover_table(monkeypatch):
    x = torch.randn(64, 64)  # 4096 elements
    table = {"cpu": {"layer_norm": {"forward": [(0, "native"), (4096, "reference")], "backward": [(0, "reference")]}}}
    monkeypatch.setattr(routing, "_BANDS", routing._bands(table))
    assert ops.route("layer_norm", x) == "reference"  # 4096 >= 4096: the second band
    assert ops.route("layer_norm", x[:63]) == "native"
    assert ops.route("layer_norm", x.requires_grad_()) == "reference"  # a gradient is wanted: the backward bands
    assert routing.crossover_table() == {k: {o: {d: list(b) for d, b in v2.items()} for o, v2 in v.items()}
                                         for k, v in table.items()}


def test_the_committed_table_names_known_paths_and_its_provenance():
    import json

    data = json.loads(routing._TABLE_FILE.read_text())
    prov = data["provenance"]
    assert {"cpu_model", "torch", "date", "threads"} <= set(prov)
    for dev, table in routing.crossover_table().items():
        if dev != "cpu":  # a GPU's entry: measured there, with that device's provenance
            assert {"device", "torch", "triton", "date"} <= set(data["provenance_by_device"][dev])
        for op, dirs in table.items():
            assert op in routing.OPS and set(dirs) <= {"forward", "backward"}
            for bands in dirs.values():
                assert [b for b, _ in bands] == sorted(b for b, _ in bands) and bands[0][0] == 0
                assert {p for _, p in bands} <= ({"native", "reference"} if dev == "cpu" else {"native", "fused"})


def test_force_path_rejects_unknown_paths():
    with pytest.raises(ValueError, match="path must be one of"):
        with ops.force_path("triton"):
            pass


# ---- native and reference compute the same thing ---------------------------------------------------------


def _modules():
    return {
        "LayerNorm": (lambda: nl.LayerNorm(48), (6, 5, 48)),
        "LayerNorm2d-shape": (lambda: nl.LayerNorm((5, 48)), (6, 5, 48)),
        "GroupNorm": (lambda: nl.GroupNorm(4, 12), (6, 12, 7, 3)),
        "BatchNorm1d": (lambda: nl.BatchNorm1d(12), (16, 12, 5)),
        "BatchNorm2d": (lambda: nl.BatchNorm2d(12), (8, 12, 4, 4)),
        "BatchNorm2d-eval": (lambda: nl.BatchNorm2d(12).eval(), (8, 12, 4, 4)),
        "BatchNorm-no-stats": (lambda: nl.BatchNorm1d(12, track_running_stats=False, momentum=None), (16, 12)),
        "InstanceNorm1d": (lambda: nl.InstanceNorm1d(12, affine=True), (4, 12, 9)),
        "InstanceNorm2d": (lambda: nl.InstanceNorm2d(12), (4, 12, 5, 5)),
        "InstanceNorm-stats": (lambda: nl.InstanceNorm1d(12, track_running_stats=True), (4, 12, 9)),
    }


def _perturb(m):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in m.named_buffers():
            if b.is_floating_point():
                b.add_(0.2 * torch.rand(b.shape, generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(_modules()))
def test_native_equals_the_reference(name, dtype):
    make, shape = _modules()[name]
    results = {}
    for path in ("native", "reference"):
        torch.manual_seed(0)
        m = make()
        _perturb(m)
        m = m.to(dtype) if dtype != torch.bfloat16 else m  # bfloat16 input, float32 parameters (mixed)
        x = (torch.randn(shape, dtype=torch.float64) * 2 + 0.5).to(dtype).requires_grad_()
        dy = torch.randn(shape, dtype=torch.float64).to(dtype)
        with ops.force_path(path):
            y = m(x)
            y.backward(dy)
        results[path] = [y, x.grad] + [p.grad for p in m.parameters()] + [b for b in m.buffers()]
    tol = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-10, atol=1e-10),
           torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}[dtype]
    for a, b in zip(results["native"], results["reference"]):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


def test_add_layer_norm_native_equals_reference():
    x, r = torch.randn(6, 40, requires_grad=True), torch.randn(6, 40, requires_grad=True)
    w, b = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    out = {}
    for path in ("native", "reference"):
        with ops.force_path(path):
            y, res = ops.add_layer_norm(x, r, w, b)
        out[path] = [y, res] + list(torch.autograd.grad((y * y).sum() + res.sum(), (x, r, w, b)))
    for a, b_ in zip(out["native"], out["reference"]):
        torch.testing.assert_close(a, b_, **close(torch.float32))


def test_modules_match_torch_nn_on_the_native_path():
    """The native path is torch's op: torch.nn's own module gives the same numbers."""
    x = torch.randn(8, 12, 6, 6, requires_grad=True)
    pairs = [(nl.LayerNorm(6), torch.nn.LayerNorm(6)), (nl.GroupNorm(3, 12), torch.nn.GroupNorm(3, 12)),
             (nl.BatchNorm2d(12), torch.nn.BatchNorm2d(12))]
    for ours, theirs in pairs:
        theirs.load_state_dict(ours.state_dict())
        a, b = ours(x), theirs(x)
        assert torch.equal(a, b), type(ours).__name__
        ga = torch.autograd.grad(a.sum(), x)[0]
        gb = torch.autograd.grad(b.sum(), x)[0]
        assert torch.equal(ga, gb), type(ours).__name__
        for (n, p), q in zip(ours.named_buffers(), theirs.buffers()):
            assert torch.equal(p, q), n


# ---- where torch's statistics cannot be trusted, the reference answers ------------------------------------


def _exact(fn, *args):
    return fn(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])


ADVERSARIAL = {
    "offset": lambda s: 1e4 + 1e-3 * torch.randn(s),  # |mean| / sigma = 1e7: torch loses every digit
    "constant": lambda s: torch.full(s, 3e5 + 0.25),  # must come out as exactly beta
    "huge": lambda s: 1e20 * torch.randn(s),  # squares overflow float32
}


@pytest.mark.parametrize("kind", list(ADVERSARIAL))
def test_untrusted_statistics_fall_back_to_the_reference(kind):
    torch.manual_seed(1)
    x3 = ADVERSARIAL[kind]((4, 6, 32))
    cases = [
        (nl.LayerNorm(32), lambda t: TF.layer_norm(t, (32,))),
        (nl.GroupNorm(2, 6, affine=False), lambda t: TF.group_norm(t, 2)),
        (nl.BatchNorm1d(6, affine=False), lambda t: TF.batch_norm(t, None, None, training=True)),
        (nl.InstanceNorm1d(6), lambda t: TF.instance_norm(t)),
    ]
    for m, exact in cases:
        y = m(x3)
        with ops.force_path("reference"):
            ref = type(m)(*_ctor_args(m))(x3)
        assert torch.equal(y, ref), type(m).__name__  # the reference's answer, bit for bit
        truth = exact(x3.double()).float()
        if kind == "constant":
            assert torch.equal(y, torch.zeros_like(y)), type(m).__name__
        else:
            torch.testing.assert_close(y, truth, rtol=1e-4, atol=1e-4, msg=type(m).__name__)


def _ctor_args(m):
    if isinstance(m, nl.LayerNorm):
        return (m.normalized_shape,)
    if isinstance(m, nl.GroupNorm):
        return (m.num_groups, m.num_channels, m.eps, m.affine)
    return (m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats)


def test_torch_alone_is_wrong_on_those_inputs():
    """The premise of the check: torch's single-pass statistics fail exactly there (else the check costs for nothing)."""
    torch.manual_seed(1)
    x = ADVERSARIAL["offset"]((4, 32))
    assert (TF.layer_norm(x, (32,)) - _exact(TF.layer_norm, x, (32,))).abs().max() > 1e-2
    b = ADVERSARIAL["offset"]((64, 4))  # (a constant channel fools torch's vectorized BatchNorm only, not its scalar one)
    assert (TF.batch_norm(b, None, None, training=True) - _exact(TF.batch_norm, b, None, None, None, None, True)).abs().max() > 1e-2
    h = ADVERSARIAL["huge"]((4, 6, 32))
    assert not torch.isfinite(TF.group_norm(h, 2)).all() or TF.group_norm(h, 2).abs().max() == 0  # zeros or NaN


def test_a_rejected_batch_updates_the_running_statistics_once():
    torch.manual_seed(2)
    x = ADVERSARIAL["offset"]((16, 6))
    a, b = nl.BatchNorm1d(6), nl.BatchNorm1d(6)
    a(x)  # native rejected, reference recomputed
    with ops.force_path("reference"):
        b(x)
    for (n, p), q in zip(a.named_buffers(), b.buffers()):
        assert torch.equal(p, q), n
    assert int(a.num_batches_tracked) == 1


def test_nan_and_inf_inputs_give_nan_as_torch():
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    x[2, 3] = float("inf")
    y = nl.LayerNorm(8)(x)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all() and torch.isfinite(y[0]).all()


def test_trusted_is_the_documented_rule():
    m = torch.tensor([[0.0], [1.0], [-3.0]])
    r = torch.tensor([[1.0], [2.0], [1.0]])
    assert native.trusted(m, r)  # |m| r = 0, 2, 3
    assert not native.trusted(m, torch.tensor([[1.0], [5.0], [1.0]]))  # 5 > TRUST
    assert not native.trusted(m, torch.tensor([[0.0], [1.0], [1.0]]))  # rstd 0: an overflowed variance
    assert not native.trusted(m, torch.tensor([[float("nan")], [1.0], [1.0]]))
    assert native.trusted(torch.empty(0, 1), torch.empty(0, 1))


# ---- the reference the book shows stays what the functional API computes ----------------------------------


def test_functional_is_always_the_reference():
    x = ADVERSARIAL["offset"]((4, 32))
    assert torch.equal(F.layer_norm(x, (32,)), nl.LayerNorm(32, elementwise_affine=False)(x))
    with ops.force_path("native"):  # the functional API is the book's math: no route
        y = F.layer_norm(torch.randn(4, 8), (8,))
    assert y.shape == (4, 8)


def test_the_plans_written_out_rule_is_native_takes(monkeypatch):
    """plan() writes _native_takes out for speed: over a grid of CPU calls, with no crossover table, it
    takes torch's op exactly where _native_takes says."""
    monkeypatch.setattr(routing, "_BANDS", {})
    dtypes = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    for op in routing.OPS:
        for dt in dtypes:
            for shape in ((4, 8), (0, 8), (3, 0)):
                x = torch.randn(shape, dtype=dt)
                for residual in (None, torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float16)):
                    for weight in (None, torch.randn(shape[-1], dtype=dt), torch.randn(shape[-1], dtype=torch.float64)):
                        expected = "native" if routing._native_takes(op, x, residual, weight) else "reference"
                        assert routing.plan(op, x, residual, weight) == expected, (op, dt, shape, residual, weight)


def test_a_plan_names_the_way_into_the_kernels(monkeypatch):
    """Inside force_path("fused") with the interpreter: the kernels directly without a gradient, through the
    autograd Function with one; route() reports both as "fused"."""
    monkeypatch.setattr(routing, "HAS_TRITON", True)
    monkeypatch.setattr(routing, "_interpreter_on", lambda: True)
    x, w = torch.randn(4, 8), torch.randn(8, requires_grad=True)
    with ops.force_path("fused"):
        assert routing.plan("layer_norm", x) == routing.FUSED
        assert routing.plan("layer_norm", x, weight=w) == routing.FUSED_GRAD
        assert routing.plan("layer_norm", x, grad=True) == routing.FUSED_GRAD
        with torch.no_grad():
            assert routing.plan("layer_norm", x, weight=w) == routing.FUSED
        assert ops.route("layer_norm", x, weight=w) == "fused"


# Every process-wide setting of normlib: (name, the block that sets it, the getter, a value, another value,
# the value outside every block)
SETTINGS = [
    ("force_path", ops.force_path, routing.forced_path, "reference", "native", None),
    ("use_compile_mode", ops.use_compile_mode, ops.compile_mode, "kernels", "reference", "reference"),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s[0])
def test_blocks_of_two_threads_may_end_in_any_order(setting):
    """Blocks that interleave across threads (A enters, B enters, A exits, B exits) leave the setting as it
    was afterwards; while any is open the innermost open one holds. (A saved-and-restored global, as before,
    ended pinned to A's value.)"""
    import threading

    _, block, get, first, second, outside = setting
    order = []
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a():
        with block(first):
            a_in.set()
            b_in.wait(10)
            order.append(("a exits", get()))
        a_out.set()

    def b():
        a_in.wait(10)
        with block(second):
            b_in.set()
            a_out.wait(10)
            order.append(("b sees after a exits", get()))

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert order == [("a exits", second), ("b sees after a exits", second)]
    assert get() == outside
    with block(first):
        with block(second):
            assert get() == second
        assert get() == first
    assert get() == outside


def test_set_compile_mode_is_the_base_under_the_blocks():
    with ops.use_compile_mode("kernels"):
        old = ops.set_compile_mode("kernels")
        assert ops.compile_mode() == "kernels"
        ops.set_compile_mode(old)
        assert ops.compile_mode() == "kernels"  # the block's, until it ends
    assert ops.compile_mode() == old == "reference"


def test_threads_classifying_one_class_at_once_get_the_same_answer():
    """swap_norms in several threads on models of a class never seen before: every thread swaps it, and the
    answer that stays in the cache is the right one (a placeholder of one thread's recursion used to be read
    by the others as "cannot tell", and cached for the process)."""
    import threading

    from torch import nn

    for trial in range(5):
        cls = type(f"FreshLayerNorm{trial}", (nn.LayerNorm,), {})
        models = [nn.Sequential(cls(8)) for _ in range(4)]
        start, counts = threading.Barrier(len(models)), []

        def swap(m):
            start.wait(10)
            counts.append(nl.swap_norms(m, warn=False).count)

        threads = [threading.Thread(target=swap, args=(m,)) for m in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert counts == [1, 1, 1, 1], (trial, counts)
        assert nl.interop.classify(cls)[0] == "layer_norm"


def test_threads_swapping_the_same_class_share_one_swapped_class(monkeypatch):
    """Swapped subclasses are made once per (class, binding), also when threads swap at the same moment
    (making one is slowed down here, so that the threads do meet inside it)."""
    import threading
    import time

    from torch import nn

    from normlib.interop import swap

    making = swap._forward_for

    def slowly(*args):
        time.sleep(0.05)
        return making(*args)

    monkeypatch.setattr(swap, "_forward_for", slowly)
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class ScratchNorm(LlamaRMSNorm):  # Llama's forward, in a class no other test has swapped
        pass

    models = [nn.Sequential(ScratchNorm(8), ScratchNorm(8)) for _ in range(8)]
    start = threading.Barrier(len(models))

    def swap(m):
        start.wait(10)
        nl.swap_norms(m, warn=False)

    threads = [threading.Thread(target=swap, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    kinds = {type(layer) for m in models for layer in m}
    assert len(kinds) == 1 and next(iter(kinds)) is not ScratchNorm, kinds
    assert transformers is not None


@pytest.mark.parametrize("add", ["add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.float64, torch.float32)])
def test_add_norm_with_a_residual_of_another_dtype_answers_on_every_path(add, dtypes):
    """float32 x with a float64 residual (or the reverse), γ/β in x's dtype: the route may not decide
    whether a valid call succeeds; every path answers as the reference does."""
    xd, rd = dtypes
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(4, 8, generator=g, dtype=xd), torch.randn(4, 8, generator=g, dtype=rd)
    w, b = torch.randn(8, generator=g, dtype=xd), torch.randn(8, generator=g, dtype=xd)
    args = (x, r, w, b) if add == "add_layer_norm" else (x, r, w)
    with ops.force_path("reference"):
        want = getattr(ops, add)(*args)
    for path in (None, "native", "reference"):
        with ops.force_path(path) if path else torch.no_grad():
            got = getattr(ops, add)(*args)
        for a, e in zip(got, want):
            assert a.dtype == e.dtype
            torch.testing.assert_close(a, e, **close(xd))


def test_threads_swapping_one_model_swap_each_module_once():
    """swap_norms on the same model from several threads: each module is swapped once (a module could be
    swapped by two threads, its class nested, and one unswap_norms left it swapped), and unswap_norms undoes it."""
    import threading

    from torch import nn

    for trial in range(10):
        cls = type(f"SharedModelLayerNorm{trial}", (nn.LayerNorm,), {})
        model = nn.Sequential(*[cls(16) for _ in range(40)])
        start, counts = threading.Barrier(4), []

        def swap():
            start.wait(10)
            counts.append(nl.swap_norms(model, warn=False))

        threads = [threading.Thread(target=swap) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sum(sum(r.swapped.values()) for r in counts) == 40, trial
        assert nl.unswap_norms(model) == 40
        assert all(type(m) is cls for m in model), trial
