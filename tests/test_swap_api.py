"""swap_norms with what wraps, copies, compiles and reports a model: code nobody here wrote.

accelerate's offload hooks (a forward set on the instance that calls
``module._old_forward``), a user's own ``forward`` on an instance, keyword
calls, ``copy.copy``/``deepcopy``/pickle, the garbage collector (a swapped
model must be freed by ``del`` alone), ``torch.jit.script``/``trace``, bad
arguments, and what the report says. On CPU a swapped module runs its class's
forward, so outputs are compared bit for bit; where the kernels matter they are
run through Triton's interpreter.
"""

import copy
import functools
import gc
import importlib
import io
import pickle
import warnings
import weakref

import pytest
import torch
from torch import nn

import normlib as nl
from normlib import ops
from normlib.testing.tolerance import close

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

N = 16


def _llama(seed=0):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=N, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _ids(seed=1):
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def _rms(n=N):
    mod = importlib.import_module("transformers.models.llama.modeling_llama")
    norm = mod.LlamaRMSNorm(n)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(n))
    return norm


@pytest.fixture
def kernels(kernels_on_cpu, monkeypatch):
    """Run the kernels on CPU tensors through Triton's interpreter, and count the calls that reach them."""
    kernels_on_cpu()
    calls = []
    fused = ops.dispatch.fused
    monkeypatch.setattr(ops.dispatch, "fused", lambda *a, **k: calls.append(a[0].shape) or fused(*a, **k))
    return calls


# ---- accelerate's hooks ---------------------------------------------------------------------------------


try:
    import accelerate
    import accelerate.hooks
except ImportError:  # a test dependency (the dev extra)
    accelerate = None
needs_accelerate = pytest.mark.skipif(accelerate is None, reason="needs accelerate")


@needs_accelerate
def test_cpu_offload_swapped_after_the_hooks_runs_inside_them():
    """cpu_offload keeps the weights on the meta device between calls; its hook loads them around the forward."""
    model, ref = _llama(), _llama()
    with torch.no_grad():
        expected = ref(_ids()).logits
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    norm = model.model.norm
    assert norm.weight.device.type == "meta" and "_hf_hook" in vars(norm)
    hook_forward = vars(norm)["forward"]
    report = nl.swap_norms(model)
    assert report.count == 5 and not report.left, str(report)
    assert vars(norm)["forward"] is hook_forward  # the hook stays the entry point ...
    assert vars(norm)["_old_forward"].__func__ is type(norm).forward  # ... and calls the swapped forward
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, expected)
    assert nl.unswap_norms(model) == 5
    assert vars(norm)["forward"] is hook_forward and vars(norm)["_old_forward"].__func__ is type(norm).forward
    assert type(norm).__name__ == "LlamaRMSNorm" and not hasattr(type(norm), "_normlib_kind")
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, expected)


@needs_accelerate
def test_hooks_added_after_the_swap_see_the_swapped_forward_and_unswap_restores_the_class_forward():
    model, ref = _llama(), _llama()
    with torch.no_grad():
        expected = ref(_ids()).logits
    nl.swap_norms(model)
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    norm = model.model.norm
    assert getattr(vars(norm)["_old_forward"].__func__, "_normlib_forward", False)
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, expected)
    nl.unswap_norms(model)
    original = importlib.import_module("transformers.models.llama.modeling_llama").LlamaRMSNorm.forward
    assert vars(norm)["_old_forward"].__func__ is original
    accelerate.hooks.remove_hook_from_module(model, recurse=True)
    with torch.no_grad():
        assert torch.equal(model(_ids()).logits, expected)


@needs_accelerate
def test_from_pretrained_with_disk_offload(tmp_path):
    """What the issue saw fail: ``from_pretrained(device_map=..., offload_folder=...)``, then swap_norms."""
    _llama().save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "disk", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    kwargs = dict(device_map=device_map, offload_folder=str(tmp_path / "offload"))
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model", **kwargs).eval()
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model", **kwargs).eval()
    assert model.model.norm.weight.device.type == "meta"
    with torch.no_grad():
        expected = plain(_ids()).logits
        report = nl.swap_norms(model)
        assert report.count == 5 and not report.left, str(report)
        assert torch.equal(model(_ids()).logits, expected)
        assert nl.unswap_norms(model) == 5
        assert torch.equal(model(_ids()).logits, expected)


@needs_accelerate
@pytest.mark.interpreter
def test_through_the_kernels_inside_accelerates_hook(kernels):
    """The hook loads the offloaded γ before the swapped forward runs: the kernels get real weights."""
    norm, ref = _rms(), None
    ref = copy.deepcopy(norm)
    accelerate.cpu_offload(norm, execution_device=torch.device("cpu"))
    assert norm.weight.device.type == "meta"
    nl.swap_norms(norm)
    x = torch.randn(3, 5, N)
    y = norm(x)
    assert kernels == [x.shape]  # the kernels ran, inside the hook
    torch.testing.assert_close(y, ref(x), **close(torch.float32))
    assert norm.weight.device.type == "meta"  # and the hook offloaded γ again


# ---- a user's own forward on the instance ----------------------------------------------------------------


def test_a_forward_set_on_the_instance_keeps_running_and_stays():
    norm = nn.LayerNorm(N)
    seen = []
    inner = norm.forward

    def wrapper(x):
        seen.append(x.shape)
        return inner(x) * 2

    norm.forward = wrapper
    model = nn.Sequential(nn.Linear(N, N), norm)
    x = torch.randn(2, N)
    expected = model(x)
    with pytest.warns(UserWarning, match="left 1 norm-like module"):
        report = nl.swap_norms(model)
    assert report.count == 0
    (why,) = [w for _, w in report.left.values()]
    assert "wrapper" in why and "swap the norms before wrapping" in why
    assert vars(norm)["forward"] is wrapper
    assert torch.equal(model(x), expected) and len(seen) == 2
    assert nl.unswap_norms(model) == 0 and vars(norm)["forward"] is wrapper
    assert torch.equal(model(x), expected) and len(seen) == 3


@pytest.mark.interpreter
def test_a_wrapper_added_after_the_swap_runs_around_the_kernels_and_survives_unswap(kernels):
    norm = _rms()
    ref = copy.deepcopy(norm)
    nl.swap_norms(norm)
    seen = []
    inner = norm.forward
    norm.forward = functools.wraps(inner)(lambda x: seen.append(1) or inner(x))
    x = torch.randn(2, 3, N)
    torch.testing.assert_close(norm(x), ref(x), **close(torch.float32))
    assert seen == [1] and len(kernels) == 1
    wrapper = vars(norm)["forward"]
    assert nl.unswap_norms(norm) == 1 and vars(norm)["forward"] is wrapper
    assert torch.equal(norm(x), ref(x))  # the wrapper's bound swapped forward now runs the class's forward
    assert seen == [1, 1] and len(kernels) == 1


def test_the_class_forward_bound_on_the_instance_is_rebound_and_restored():
    """After accelerate's remove_hook_from_module the instance holds its class's bound forward: that one is swapped."""
    norm = _rms()
    bound = norm.forward
    norm.forward = bound
    report = nl.swap_norms(norm)
    assert report.count == 1 and vars(norm)["forward"].__func__ is type(norm).forward
    x = torch.randn(2, N)
    assert torch.equal(norm(x), bound(x))
    nl.unswap_norms(norm)
    assert vars(norm)["forward"] is bound  # the very object that was there


def test_a_class_that_refuses_subclasses_is_left_alone_with_the_reason():
    llama = importlib.import_module("transformers.models.llama.modeling_llama")

    class Sealed(llama.LlamaRMSNorm):
        def __init_subclass__(cls, **kwargs):
            raise TypeError("Sealed cannot be subclassed")

    with pytest.warns(UserWarning, match="cannot give it a swapped class"):
        report = nl.swap_norms(nn.Sequential(Sealed(4)))
    assert report.count == 0 and type(report) is nl.SwapReport


# ---- calls, copies, the garbage collector ------------------------------------------------------------------


def test_keyword_calls():
    ln, rms = nn.LayerNorm(8), _rms(8)
    ref_ln, ref_rms = copy.deepcopy(ln), copy.deepcopy(rms)
    nl.swap_norms(nn.Sequential(ln, rms))
    x = torch.randn(2, 8)
    assert torch.equal(ln(input=x), ref_ln(x)) and torch.equal(rms(hidden_states=x), ref_rms(x))
    with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
        ln(x=x)  # as the original: its forward's argument is called `input`


@pytest.mark.interpreter
def test_keyword_calls_reach_the_kernels(kernels):
    ln, rms = nn.LayerNorm(8), _rms(8)
    ref_ln, ref_rms = copy.deepcopy(ln), copy.deepcopy(rms)
    nl.swap_norms(nn.Sequential(ln, rms))
    x = torch.randn(2, 8)
    torch.testing.assert_close(ln(input=x), ref_ln(x), **close(torch.float32))
    torch.testing.assert_close(rms(hidden_states=x), ref_rms(x), **close(torch.float32))
    assert len(kernels) == 2


@pytest.mark.interpreter
def test_copy_copy_computes_with_the_copys_own_parameters(kernels):
    norm = _rms()
    nl.swap_norms(norm)
    shallow = copy.copy(norm)
    assert type(shallow) is type(norm)
    shallow._parameters = {"weight": nn.Parameter(torch.full((N,), 3.0))}  # the copy gets a γ of its own
    x = torch.randn(2, N)
    expected = 3.0 * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    torch.testing.assert_close(shallow(x), expected, **close(torch.float32))
    torch.testing.assert_close(norm(x), expected / 3.0 * norm.weight, **close(torch.float32))
    assert len(kernels) == 2


def test_copies_and_pickles_stay_swapped_and_independent():
    model = _llama()
    nl.swap_norms(model)
    swapped = type(model.model.norm)
    pickles = [pickle.loads(pickle.dumps(model, protocol=p)) for p in range(pickle.HIGHEST_PROTOCOL + 1)]  # 0 and 1 too
    for other in (copy.deepcopy(model), *pickles, torch.load(_saved(model), weights_only=False)):
        assert type(other.model.norm) is swapped and other.model.norm is not model.model.norm
        assert other.model.norm.weight is not model.model.norm.weight
        with torch.no_grad():
            assert torch.equal(other(_ids()).logits, model(_ids()).logits)
    shallow = copy.copy(model.model.norm)
    assert type(shallow) is swapped and shallow.weight is model.model.norm.weight  # copy.copy shares, as in torch


def _saved(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return buf


def test_no_reference_cycle_keeps_a_swapped_model_alive():
    """``del model`` frees it at once (reference counting), swapped or not: no gc.collect() needed."""
    gc.collect()
    gc.disable()
    try:
        model = _llama()
        nl.swap_norms(model)
        with torch.no_grad():
            model(_ids())
        refs = [weakref.ref(model), weakref.ref(model.model.norm), weakref.ref(model.model.norm.weight)]
        del model
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()


def test_half_state_dict_and_training_after_the_swap():
    model, ref = _llama(), _llama()
    nl.swap_norms(model)
    model.half()
    ref.half()
    assert model.model.norm.weight.dtype == torch.float16 and list(model.state_dict()) == list(ref.state_dict())
    fresh = _llama(seed=5)
    nl.swap_norms(fresh)
    fresh.load_state_dict(_llama().state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(_ids()).logits, _llama()(_ids()).logits)


# ---- TorchScript ---------------------------------------------------------------------------------------


def _scriptable():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(N, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), nn.RMSNorm(N, eps=1e-6),
                         _rms()).eval()


def test_torch_jit_script_of_a_swapped_model_compiles_the_original_forward():
    model, ref = _scriptable(), _scriptable()
    ref[2].load_state_dict(model[2].state_dict())
    report = nl.swap_norms(model)
    assert report.count == 4
    x = torch.randn(2, 5, N)
    scripted = torch.jit.script(model)
    expected = torch.jit.script(ref)(x)
    assert torch.equal(scripted(x), expected) and torch.equal(model(x), expected)
    loaded = torch.jit.load(_saved_script(scripted))
    assert torch.equal(loaded(x), expected)
    assert type(model[1]) is not nn.RMSNorm  # scripting left the eager model swapped


def _saved_script(scripted):
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    return buf


def _traceable():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N, N), nn.LayerNorm(N), nn.GELU(), nn.RMSNorm(N, eps=1e-6), _rms()).eval()


def test_a_scripted_or_traced_model_is_reported_with_a_warning_that_says_why():
    model = _traceable()
    x = torch.randn(2, 5, N)
    for compiled in (torch.jit.script(model), torch.jit.trace(model, x)):
        with pytest.warns(UserWarning, match="cannot swap a TorchScript module"):
            report = nl.swap_norms(compiled)
        assert report.count == 0 and len(report.left) == 1
        ((name, (n, why)),) = report.left.items()
        assert "Sequential" in name and "TorchScript" in why and "eager model" in why
    inside = nn.Sequential(nn.LayerNorm(N), torch.jit.script(nn.LayerNorm(N)))
    with pytest.warns(UserWarning, match="TorchScript"):
        report = nl.swap_norms(inside)
    assert report.count == 1 and sum(n for n, _ in report.left.values()) == 1


def test_torch_jit_trace_of_a_swapped_model():
    model, ref = _traceable(), _traceable()
    ref[4].load_state_dict(model[4].state_dict())
    nl.swap_norms(model)
    x = torch.randn(2, 5, N)
    traced = torch.jit.trace(model, x)
    assert torch.equal(traced(x), ref(x))


# ---- bad arguments ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call, match", [
    (lambda: nl.swap_norms(42), r"model must be a torch.nn.Module \(got int\)"),
    (lambda: nl.swap_norms([nn.LayerNorm(4)]), r"model must be a torch.nn.Module \(got list\)"),
    (lambda: nl.swap_norms(nn.LayerNorm(4), warn="yes"), r"warn must be True or False \(got 'yes'\)"),
    (lambda: nl.swap_norms(nn.LayerNorm(4), warn=None), r"warn must be True or False \(got None\)"),
    (lambda: nl.unswap_norms(42), r"model must be a torch.nn.Module \(got int\)"),
    (lambda: nl.unswap_norms(None), r"model must be a torch.nn.Module \(got NoneType\)"),
    (lambda: nl.interop.recognise("LayerNorm"), r"module must be a torch.nn.Module \(got str\)"),
    (lambda: nl.interop.classify(nn.LayerNorm(4)), r"cls must be a torch.nn.Module subclass"),
    (lambda: nl.interop.classify(int), r"cls must be a torch.nn.Module subclass"),
])
def test_bad_arguments_name_what_was_expected(call, match):
    with pytest.raises(TypeError, match=match):
        call()


@pytest.mark.parametrize("kwargs, match", [
    (dict(swapped=[1]), "swapped must map class names to counts"),
    (dict(already={"x": "many"}), "already must map class names to counts"),
    (dict(kinds={"x": 1}), "kinds must map class names to kind names"),
    (dict(left={"x": 3}), r"left must map class names to \(count, reason\) pairs"),
])
def test_a_report_built_by_hand_checks_its_fields(kwargs, match):
    with pytest.raises(TypeError, match=match):
        nl.SwapReport(**kwargs)


def test_swap_norms_takes_warn_by_keyword_only():
    with pytest.raises(TypeError):
        nl.swap_norms(nn.LayerNorm(4), False)


# ---- the report --------------------------------------------------------------------------------------------


def test_containers_are_not_listed_and_their_norms_are_swapped():
    """StableLM's q/k LayerNorm per head holds one nn.LayerNorm per head: those are swapped, the holder is no norm."""
    cfg = transformers.StableLmConfig(vocab_size=64, hidden_size=N, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=32, qk_layernorm=True)
    try:
        model = transformers.StableLmForCausalLM(cfg).eval()
    except AttributeError as e:  # transformers 4.x: its _init_weights zeroes the bias the q/k norms lack
        if transformers.__version__.startswith("4."):
            pytest.skip(f"transformers {transformers.__version__} cannot build StableLM with qk_layernorm: {e}")
        raise
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing norm-like is left alone, so no warning
        report = nl.swap_norms(model)
    assert not report.left, str(report)
    per_head = model.model.layers[0].self_attn.q_layernorm
    assert type(per_head).__name__ == "StableLmLayerNormPerHead" and not hasattr(type(per_head), "_normlib_kind")
    assert all(hasattr(type(n), "_normlib_kind") for n in per_head.norms)


def test_a_partial_swap_warns_and_lists_what_it_left():
    vitdet = importlib.import_module("transformers.models.vitdet.modeling_vitdet")
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), vitdet.VitDetLayerNorm(4))
    with pytest.warns(UserWarning, match=r"left 1 norm-like module\(s\) alone") as w:
        report = nl.swap_norms(model)
    assert report.count == 1 and list(report.left) == ["transformers.models.vitdet.modeling_vitdet.VitDetLayerNorm"]
    assert "swapped     1 x torch.nn.modules.normalization.LayerNorm (layer_norm)" in str(w[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nl.swap_norms(model, warn=False)  # the report only


def test_gated_rms_norms_are_left_alone_with_a_reason_that_says_gated():
    mamba2 = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    try:
        gated = mamba2.MambaRMSNormGated(N, group_size=N)
    except TypeError:  # transformers 4.x: no groups
        gated = mamba2.MambaRMSNormGated(N)
    with pytest.warns(UserWarning, match="gated"):
        report = nl.swap_norms(nn.Sequential(gated))
    ((why_count, why),) = report.left.values()
    assert why.startswith("gated RMSNorm") and "runs unchanged" in why
    kind, why = nl.interop.recognise(gated)
    assert kind is None and "gated" in why


def test_the_report_of_a_model_swapped_fully_is_unchanged_in_form():
    """The book and a chapter print this report: its text for a fully swapped model stays as it was."""
    report = nl.swap_norms(_llama())
    assert str(report) == ("swap_norms: 5 norm module(s) swapped\n"
                           "  swapped     5 x transformers.models.llama.modeling_llama.LlamaRMSNorm (llama_rms_norm)")


# ---- what worked with the instance forward and must keep working with the swapped class -----------------


def test_generate_save_pretrained_and_gradient_checkpointing(tmp_path):
    model, ref = _llama(), _llama()
    nl.swap_norms(model)
    ids = _ids()[:, :4]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), ref.generate(ids, **kwargs))
    model.save_pretrained(tmp_path / "m")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert not hasattr(type(loaded.model.norm), "_normlib_kind")  # a fresh model, not swapped
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, ref(_ids()).logits)
    losses = []
    for m in (model, ref):
        m.train()
        m.gradient_checkpointing_enable()
        loss = m(_ids(), labels=_ids()).loss
        loss.backward()
        losses.append((loss.detach(), [p.grad for p in m.parameters()]))
    assert torch.equal(losses[0][0], losses[1][0])
    assert all(torch.equal(a, b) for a, b in zip(losses[0][1], losses[1][1]))


def test_torch_export_of_a_swapped_model():
    model, ref = _traceable(), _traceable()
    ref[4].load_state_dict(model[4].state_dict())
    nl.swap_norms(model)
    x = torch.randn(2, 5, N)
    exported = torch.export.export(model, (x,))
    assert torch.equal(exported.module()(x), ref(x))


def test_the_report_says_every_reason_one_class_was_left_alone(monkeypatch):
    """Modules of one class left alone for different reasons: the report gives each reason with its count,
    not the last one seen for all of them."""
    from normlib import interop

    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.LayerNorm(4), torch.nn.LayerNorm(4))
    reasons = iter(["reason A", "reason B", "reason A"])
    monkeypatch.setattr(interop.recognition, "_verdict", lambda module: interop.Verdict.left(next(reasons))
                        if isinstance(module, torch.nn.LayerNorm) else interop.Verdict("unknown", "not a norm"))
    report = nl.swap_norms(model, warn=False)
    (count, why), = [v for k, v in report.left.items() if k.endswith("LayerNorm")]
    assert count == 3 and why == "2 of them: reason A; 1 of them: reason B", why


def test_a_verdict_says_what_a_swap_makes_of_a_module():
    """One object between recognition and the swap (``interop.Verdict``), not reasons compared as strings."""
    from normlib import interop

    class MyNorm(torch.nn.Module):  # named like a norm, computing none of the kinds
        def forward(self, x):
            return x / x.abs().max()

    cases = {
        torch.nn.LayerNorm(4): ("swap", "layer_norm"),
        torch.nn.BatchNorm2d(4): ("left", None),
        nl.LayerNorm(4): ("normlib", None),
        torch.nn.Linear(4, 4): ("unknown", None),
        MyNorm(): ("unknown", None),
    }
    for module, (status, kind) in cases.items():
        v = interop.recognition._verdict(module)
        assert (v.status, v.binding.kind if v.binding else None) == (status, kind), type(module)
        assert v.reason
    report = nl.swap_norms(torch.nn.Sequential(*cases), warn=False)
    listed = {k.rsplit(".", 1)[-1] for k in report.left}
    assert listed == {"BatchNorm2d", "MyNorm"}  # left alone with a reason, or a leaf named like a norm
