"""swap_norms on the models people use: what it swaps, and that nothing else changes.

Models come from ``transformers`` configs (tiny, random weights, no download):
BERT, GPT-2, Llama, Qwen2, Mistral, Gemma, T5 and ConvNeXt. timm cannot be
installed beside the pinned CPU torch (it needs torchvision), so its norms are
tested through faithful copies of their forward (``tests/_timm_norm_copy.py``)
installed as ``timm.layers.norm``.

On CPU a swapped module runs its class's own forward, so everything is
compared bit for bit; the fused kernels are then run through Triton's
interpreter (standing in for CUDA) and compared to rounding.
"""

import ast
import copy
import importlib
import importlib.util
import linecache
import os
import pickle
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import normlib as nl
from normlib import ops
from normlib.testing.tolerance import close

from _helpers import assert_no_worse

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

L = 2  # layers
V = 64  # vocabulary
SMALL = dict(vocab_size=V, hidden_size=16, num_hidden_layers=L, num_attention_heads=2, intermediate_size=32,
             max_position_embeddings=32)
DECODER = dict(SMALL, num_key_value_heads=1)


@dataclass
class Spec:
    config: str
    model: str
    kwargs: dict
    norms: int  # how many norm modules the model has, from its architecture
    kind: str  # what normlib must recognise them as
    shared: tuple  # two norm modules (dotted paths) that the sharing test ties together
    loss: str = "causal"


SPECS = {
    # BERT: embeddings LayerNorm, two per layer, one in the masked-LM head
    "bert": Spec("BertConfig", "BertForMaskedLM", SMALL, 2 * L + 2, "layer_norm",
                 ("bert.encoder.layer.0.output.LayerNorm", "bert.encoder.layer.1.output.LayerNorm"), "masked"),
    # GPT-2: ln_1 and ln_2 per block, ln_f
    "gpt2": Spec("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=16, n_layer=L, n_head=2, n_positions=32,
                                                       bos_token_id=0, eos_token_id=0),
                 2 * L + 1, "layer_norm", ("transformer.h.0.ln_1", "transformer.h.1.ln_1")),
    # decoder-only RMSNorm models: input and post-attention norm per layer, final norm
    "llama": Spec("LlamaConfig", "LlamaForCausalLM", DECODER, 2 * L + 1, "llama_rms_norm",
                  ("model.layers.0.input_layernorm", "model.layers.1.input_layernorm")),
    "qwen2": Spec("Qwen2Config", "Qwen2ForCausalLM", DECODER, 2 * L + 1, "llama_rms_norm",
                  ("model.layers.0.input_layernorm", "model.layers.1.input_layernorm")),
    "mistral": Spec("MistralConfig", "MistralForCausalLM", DECODER, 2 * L + 1, "llama_rms_norm",
                    ("model.layers.0.input_layernorm", "model.layers.1.input_layernorm")),
    "gemma": Spec("GemmaConfig", "GemmaForCausalLM", dict(DECODER, head_dim=8), 2 * L + 1, "gemma_rms_norm",
                  ("model.layers.0.input_layernorm", "model.layers.1.input_layernorm")),
    # T5: encoder 2 per block + final, decoder 3 per block + final
    "t5": Spec("T5Config", "T5ForConditionalGeneration", dict(vocab_size=V, d_model=16, d_kv=8, d_ff=32, num_layers=L,
                                                               num_heads=2, decoder_start_token_id=0),
               5 * L + 2, "t5_layer_norm", ("encoder.block.0.layer.0.layer_norm", "encoder.block.1.layer.0.layer_norm"),
               "seq2seq"),
}
DTYPES = [torch.float32, torch.bfloat16]


def build(name: str, dtype=torch.float32, seed: int = 0) -> nn.Module:
    """A tiny model with random weights, its norms' γ/β perturbed too (Gemma's γ starts at 0, others at 1)."""
    spec = SPECS[name]
    config = getattr(transformers, spec.config)(**spec.kwargs, attn_implementation="eager")
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model)(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 8), generator=g)
    return dict(input_ids=ids, labels=ids)


def run(model, inputs, seed=2):
    torch.manual_seed(seed)  # dropout draws the same masks in both models
    return model(**inputs)


def _get(model, path):
    return model.get_submodule(path)


def _set(model, path, module):
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


# ---- every norm of every model, and nothing else changes ------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SPECS))
def test_every_norm_is_swapped_and_eval_outputs_are_bitwise_equal(name, dtype):
    spec = SPECS[name]
    original = build(name, dtype).eval()
    model = copy.deepcopy(original)
    modules, state = list(model.modules()), model.state_dict()
    report = nl.swap_norms(model)
    assert report.count == sum(report.swapped.values()) == spec.norms, str(report)
    assert set(report.kinds.values()) == {spec.kind} and not report.left, str(report)
    assert list(model.modules()) == modules  # in place: the same module objects
    after = model.state_dict()
    assert list(after) == list(state) and all(after[k] is state[k] or after[k].data_ptr() == state[k].data_ptr()
                                              for k in state)  # the same tensors
    inputs = batch()
    with torch.no_grad():
        a, b = run(original, inputs), run(model, inputs)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SPECS))
def test_training_is_unchanged(name, dtype):
    """One AdamW step: same loss and updated parameters, bit for bit; frozen stays frozen,
    shared stays shared, hooks fire, and the optimizer built before the swap trains the norms."""
    spec = SPECS[name]
    models = []
    for swap in (False, True):
        model = build(name, dtype).train()
        _set(model, spec.shared[1], _get(model, spec.shared[0]))  # one norm, two parents
        frozen = _get(model, spec.shared[0]).weight
        frozen.requires_grad_(False)  # e.g. adapter fine-tuning: norms frozen
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        calls = []
        hooked = _get(model, spec.shared[0])
        hooked.register_forward_pre_hook(lambda m, args: calls.append("pre"))
        hooked.register_forward_hook(lambda m, args, out: calls.append(out.dtype))
        if swap:
            report = nl.swap_norms(model)
            assert report.count == spec.norms - 1  # the shared one counts once
            assert _get(model, spec.shared[1]) is hooked and _get(model, spec.shared[0]).weight is frozen
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        loss = run(model, batch()).loss
        loss.backward()
        opt.step()
        models.append((model, loss.detach(), calls, before, frozen))
    (ref, ref_loss, ref_calls, _, _), (model, loss, calls, before, frozen) = models
    assert torch.equal(loss, ref_loss)
    assert calls == ref_calls and len(calls) == 4  # both hooks, at both places the shared norm sits
    assert not frozen.requires_grad and frozen.grad is None and torch.equal(frozen, before[spec.shared[0] + ".weight"])
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), n
    trained = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    norm_weights = [f"{n}.weight" for n, m in model.named_modules() if getattr(m, "_normlib_kind", None)]
    assert set(norm_weights) - {spec.shared[0] + ".weight"} <= set(trained)  # the pre-swap optimizer trained them


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SPECS))
def test_fused_path_agrees_to_rounding(kernels_on_cpu, name, dtype):
    """Through the kernels: outputs, loss and gradients no further from float64 than the original's are.

    Gradients are compared in float32 only: the interpreter stores float32 values into bfloat16 by truncating
    instead of rounding to nearest (``../shared/TOOLCHAIN.md``), which doubles the error of every bfloat16 store;
    across T5's layers one weight gradient came out 0.016 from float64 against the original's 0.002. On a GPU
    the kernels round, and the bfloat16 gradients are checked there (``test_on_a_gpu_...``).
    """
    original = build(name, dtype).eval()
    model = copy.deepcopy(original)
    exact = copy.deepcopy(original).double()  # the same (rounded) weights, in float64
    nl.swap_norms(model)
    kernels_on_cpu()
    inputs = batch()
    outs = [run(m, inputs) for m in (model, original, exact)]
    for o in outs:
        o.loss.backward()
    (ours, theirs, ref) = outs
    assert_no_worse(ours.logits.detach(), theirs.logits.detach(), ref.logits.detach(), dtype, "logits")
    assert_no_worse(ours.loss.detach(), theirs.loss.detach(), ref.loss.detach(), dtype, "loss")
    if dtype != torch.float32:
        return
    for (n, p), q, r in zip(model.named_parameters(), original.parameters(), exact.parameters()):
        if q.grad is None:  # a parameter this forward does not use
            assert p.grad is None, n
            continue
        assert_no_worse(p.grad, q.grad, r.grad, dtype, f"grad of {n}")


@pytest.mark.parametrize("name", ["llama", "gemma", "t5", "bert"])
def test_compile_fullgraph_of_a_swapped_model(name):
    """Compiled, a swapped model computes what the compiled original does, bit for bit (gradients too).

    Compared with the compiled original rather than with eager mode: in transformers 4.x compiling T5 changes the
    gradient of its relative-attention bias by itself, swapped or not.
    """
    torch._dynamo.reset()
    original = build(name).eval()
    model = copy.deepcopy(original)
    nl.swap_norms(model)
    inputs = batch()
    if SPECS[name].loss == "seq2seq":
        inputs = dict(inputs, decoder_input_ids=inputs.pop("labels"))
    else:
        inputs.pop("labels")  # transformers' loss function logs a warning, which dynamo cannot trace
    eager = original(**inputs).logits
    try:
        a = torch.compile(original, fullgraph=True, backend="eager")(**inputs).logits
    except torch._dynamo.exc.Unsupported as e:  # nothing to compare the swapped model with
        pytest.skip(f"the original {name} model does not compile with fullgraph=True on torch {torch.__version__}: "
                    f"{str(e).splitlines()[0]}")
    b = torch.compile(model, fullgraph=True, backend="eager")(**inputs).logits
    assert torch.equal(a, b) and torch.equal(b, eager)
    original.zero_grad()
    a.sum().backward()
    b.sum().backward()
    for (n, p), q in zip(model.named_parameters(), original.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_swap_is_idempotent_reversible_and_keeps_the_model_picklable():
    model = build("llama").eval()
    inputs = batch()
    with torch.no_grad():
        before = run(model, inputs).logits
    llama_rms_norm = type(model.model.norm)
    first = nl.swap_norms(model)
    again = nl.swap_norms(model)  # idempotent
    assert sum(again.swapped.values()) == 0 and again.count == first.count == 5 and "already" in str(again)
    swapped = type(model.model.norm)
    assert swapped is not llama_rms_norm and isinstance(model.model.norm, llama_rms_norm)
    assert swapped.__name__ == "LlamaRMSNorm" and repr(model.model.norm) == repr(build("llama").model.norm)
    clone = pickle.loads(pickle.dumps(model))  # torch.save pickles the swapped class by its original
    deep = copy.deepcopy(model)
    for m in (clone, deep):
        assert nl.swap_norms(m).already  # still swapped
        assert type(m.model.norm) is swapped
        with torch.no_grad():
            assert torch.equal(run(m, inputs).logits, before)
    assert nl.unswap_norms(model) == 5 and type(model.model.norm) is llama_rms_norm
    assert "forward" not in vars(model.model.norm)
    with torch.no_grad():
        assert torch.equal(run(model, inputs).logits, before)
    assert nl.swap_norms(model).count == 5


# ---- vision: channels-first LayerNorm ----------------------------------------------------------------


def _convnext(dtype=torch.float32):
    cfg = transformers.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3,
                                      image_size=16, patch_size=2)
    torch.manual_seed(0)
    model = transformers.ConvNextForImageClassification(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_convnext_channels_first_and_last(kernels_on_cpu, dtype):
    original = _convnext(dtype).eval()
    model = copy.deepcopy(original)
    report = nl.swap_norms(model)
    # embeddings (channels first), one downsampling norm per later stage (channels first),
    # one per block (channels last), the head's torch.nn.LayerNorm
    cnl = "transformers.models.convnext.modeling_convnext.ConvNextLayerNorm"
    assert report.swapped[cnl] == 1 + 1 + 2 and report.count == 5 and not report.left
    assert report.kinds[cnl] == "channels_first_layer_norm, layer_norm"
    kinds = {n: m._normlib_kind for n, m in model.named_modules() if hasattr(m, "_normlib_kind")}
    assert kinds["convnext.embeddings.layernorm"] == "channels_first_layer_norm"
    assert kinds["convnext.encoder.stages.0.layers.0.layernorm"] == "layer_norm"
    torch.manual_seed(3)
    x = torch.randn(2, 3, 16, 16).to(dtype)
    with torch.no_grad():
        assert torch.equal(model(x).logits, original(x).logits)
    # through the kernels: the same layout (a permuted view) and the same numbers to rounding
    kernels_on_cpu()
    norm, ref_norm = model.convnext.embeddings.layernorm, original.convnext.embeddings.layernorm
    h = torch.randn(2, 8, 5, 6).to(dtype) * 3 + 1
    exact = copy.deepcopy(ref_norm).double()
    y, y_ref = norm(h), ref_norm(h)
    assert y.shape == y_ref.shape and y.stride() == y_ref.stride() and y.dtype == y_ref.dtype
    assert_no_worse(y.detach(), y_ref.detach(), exact(h.double()).detach(), dtype, "channels-first output")
    with torch.no_grad():
        assert_no_worse(model(x).logits, original(x).logits, copy.deepcopy(original).double()(x.double()).logits,
                        dtype, "logits")


def test_eomt_layernorm2d_is_recognised():
    eomt = importlib.import_module("transformers.models.eomt.modeling_eomt")
    norm = eomt.EomtLayerNorm2d(8)
    kind, why = nl.interop.recognise(norm)
    assert kind.name == "channels_first_layer_norm" and "EomtLayerNorm2d" in why


@pytest.fixture
def timm_norm(monkeypatch):
    """tests/_timm_norm_copy.py as timm.layers.norm (the anchor normlib looks for when timm is imported)."""
    fake = importlib.import_module("_timm_norm_copy")
    monkeypatch.setitem(sys.modules, "timm.layers.norm", fake)
    return fake


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_timm_layer_norm_and_layer_norm_2d(kernels_on_cpu, timm_norm, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(timm_norm.LayerNorm2d(8), nn.Conv2d(8, 8, 1), timm_norm.LayerNorm2d(8)).to(dtype)
    head = timm_norm.LayerNorm(8).to(dtype)
    with torch.no_grad():
        for p in list(model.parameters()) + list(head.parameters()):
            p.add_(0.1 * torch.randn_like(p))
    original, original_head = copy.deepcopy(model), copy.deepcopy(head)
    report = nl.swap_norms(model)
    assert report.swapped == {"_timm_norm_copy.LayerNorm2d": 2}
    assert report.kinds == {"_timm_norm_copy.LayerNorm2d": "channels_first_layer_norm"}
    assert nl.swap_norms(head).kinds == {"_timm_norm_copy.LayerNorm": "layer_norm"}
    x = torch.randn(2, 8, 4, 5).to(dtype) * 2 + 1
    assert torch.equal(model(x), original(x)) and torch.equal(head(x.transpose(1, 3)), original_head(x.transpose(1, 3)))
    kernels_on_cpu()
    y, y_ref = model(x), original(x)
    assert y.stride() == y_ref.stride()
    exact = copy.deepcopy(original).double()
    assert_no_worse(y.detach(), y_ref.detach(), exact(x.double()).detach(), dtype, "LayerNorm2d")
    h = x.transpose(1, 3)
    assert_no_worse(head(h).detach(), original_head(h).detach(), copy.deepcopy(original_head).double()(h.double()).detach(),
                    dtype, "LayerNorm")


def test_timm_fast_norm_mode_is_left_alone(timm_norm):
    norm = timm_norm.LayerNorm2d(8)
    norm._fast_norm = True  # timm's set_fast_norm(): apex or autocast-dtype math, another rounding order
    report = nl.swap_norms(nn.Sequential(norm), warn=False)
    assert report.count == 0 and "fast-norm" in report.left["_timm_norm_copy.LayerNorm2d"][1]


# ---- recognition: by what a module computes -----------------------------------------------------


LLAMA_LIKE = '''
class Copy(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A docstring of its own, and other comments: the code is what counts."""
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)  # the mean square
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)
'''


def _define(source, **globals_):
    """Class ``Copy`` from ``source``, run in a module of its own whose globals are ``globals_``."""
    source = textwrap.dedent(source)
    filename = f"<normlib-test-copy-{len(linecache.cache)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # so inspect finds the source
    namespace = dict(globals_, __name__="somewhere_else")
    exec(compile(source, filename, "exec"), namespace)
    return namespace["Copy"]


class _NotTorch:
    """A module-like object whose names shadow torch's: same code, other meaning."""

    Tensor, ones = torch.Tensor, staticmethod(torch.ones)
    float32 = torch.float64
    rsqrt = staticmethod(torch.sqrt)


def test_a_copy_of_llamas_forward_is_recognised_but_only_with_the_same_globals():
    importlib.import_module("transformers.models.llama.modeling_llama")
    copy_cls = _define(LLAMA_LIKE, torch=torch, nn=nn)
    kind, why = nl.interop.recognise(copy_cls(8))
    assert kind.name == "llama_rms_norm" and "LlamaRMSNorm" in why
    lookalike = _define(LLAMA_LIKE, torch=_NotTorch, nn=nn)
    kind, why = nl.interop.recognise(lookalike(8))
    assert kind is None and "none of the norms normlib fuses" in why


def test_gemmas_forward_with_another_norm_method_is_not_gemma():
    gemma = importlib.import_module("transformers.models.gemma.modeling_gemma")

    class Subclass(gemma.GemmaRMSNorm):  # inherits forward and _norm: Gemma
        pass

    class OtherNorm(gemma.GemmaRMSNorm):  # same forward, but the _norm it calls differs
        def _norm(self, x):
            return x / x.abs().amax(-1, keepdim=True)

    assert nl.interop.recognise(Subclass(8))[0].name == "gemma_rms_norm"
    assert nl.interop.recognise(OtherNorm(8))[0] is None


LLAMA_RENAMED = '''
class Copy(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, h):  # other names, other annotations, other layout: the same computation
        dt: torch.dtype = h.dtype
        h = h.to(
            torch.float32
        )
        v = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(v + self.variance_epsilon)
        return self.weight * h.to(dt)
'''

# Look-alikes: each differs from a kind's forward in one detail that changes what it computes (or might).
LOOKALIKES = {
    # Llama's forward, but γ multiplies before the cast: that is float32_rms_norm's order, not Llama's
    "gamma before the cast": (LLAMA_LIKE.replace("return self.weight * hidden_states.to(input_dtype)",
                                                 "return (self.weight * hidden_states).to(input_dtype)"),
                              "float32_rms_norm"),
    # statistics in the input's own dtype: no kind rounds like that
    "no up-cast": (LLAMA_LIKE.replace("        hidden_states = hidden_states.to(torch.float32)\n", ""), None),
    # another attribute for γ: the module's own `scale`, which the kernels would not be handed
    "other attribute": (LLAMA_LIKE.replace("self.weight * hidden_states", "self.scale * hidden_states")
                        .replace("self.weight = nn.Parameter", "self.scale = nn.Parameter"), None),
    # ε added twice
    "other constant": (LLAMA_LIKE.replace("variance + self.variance_epsilon",
                                          "variance + 2 * self.variance_epsilon"), None),
    # the mean over another dimension
    "other dimension": (LLAMA_LIKE.replace("mean(-1, keepdim=True)", "mean(-2, keepdim=True)"), None),
}


def test_recognition_ignores_annotations_names_and_layout():
    importlib.import_module("transformers.models.llama.modeling_llama")
    kind, why = nl.interop.recognise(_define(LLAMA_RENAMED, torch=torch, nn=nn)(8))
    assert kind.name == "llama_rms_norm" and "LlamaRMSNorm" in why


@pytest.mark.parametrize("name", list(LOOKALIKES))
def test_lookalikes_are_not_taken_for_what_they_resemble(name):
    for mod in ("llama", "olmo2"):
        importlib.import_module(f"transformers.models.{mod}.modeling_{mod}")
    source, expected = LOOKALIKES[name]
    kind, why = nl.interop.recognise(_define(source, torch=torch, nn=nn)(8))
    assert (kind.name if kind else None) == expected, why


def test_a_recognised_forward_without_the_attributes_it_reads_is_left_alone():
    llama = importlib.import_module("transformers.models.llama.modeling_llama")
    norm = llama.LlamaRMSNorm(8)
    del norm.variance_epsilon
    report = nl.swap_norms(nn.Sequential(norm), warn=False)
    ((_, why),) = report.left.values()
    assert report.count == 0 and "no attribute variance_epsilon" in why


def test_nemotrons_and_debertas_lookalikes():
    nemotron = importlib.import_module("transformers.models.nemotron.modeling_nemotron")
    deberta = importlib.import_module("transformers.models.deberta.modeling_deberta")

    class TwoP(nemotron.NemotronLayerNorm1P):  # 2 + γ: not Nemotron's 1 + γ
        def forward(self, input):
            return nemotron.F.layer_norm(input, self.normalized_shape, self.weight + 2.0, self.bias, self.eps)

    class NoRound(deberta.DebertaLayerNorm):  # DeBERTa without the cast of x̂: another rounding order
        def forward(self, hidden_states):
            hidden_states = hidden_states.float()
            mean = hidden_states.mean(-1, keepdim=True)
            variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
            hidden_states = (hidden_states - mean) / torch.sqrt(variance + self.variance_epsilon)
            return self.weight * hidden_states + self.bias

    assert nl.interop.recognise(nemotron.NemotronLayerNorm1P(8))[0].name == "layer_norm_1p"
    assert nl.interop.recognise(TwoP(8))[0] is None
    assert nl.interop.recognise(deberta.DebertaLayerNorm(8))[0].name == "deberta_layer_norm"
    assert nl.interop.recognise(NoRound(8))[0] is None


def test_convnexts_forward_over_another_parent_is_not_layer_norm():
    convnext = importlib.import_module("transformers.models.convnext.modeling_convnext")

    class Scaled(nn.LayerNorm):
        def forward(self, x):
            return 2 * super().forward(x)

    class Copy(Scaled):  # ConvNeXt's forward, but its super().forward is Scaled's
        forward = convnext.ConvNextLayerNorm.forward

        def __init__(self, n):
            super().__init__(n)
            self.data_format = "channels_first"

    kind, why = nl.interop.recognise(Copy(8))
    assert kind is None, why


def test_unknown_and_unsupported_norms_are_left_alone_and_reported():
    vitdet = importlib.import_module("transformers.models.vitdet.modeling_vitdet")

    class MyNorm(nn.Module):
        def forward(self, x):
            return x / x.norm(dim=-1, keepdim=True)

    class LN(nn.LayerNorm):
        def forward(self, x):  # its own forward: normlib cannot know what it computes
            return super().forward(x) * 2

    model = nn.Sequential(MyNorm(), LN(4), vitdet.VitDetLayerNorm(4), nn.BatchNorm2d(4), nn.GroupNorm(2, 4))
    with pytest.warns(UserWarning, match="left 5 norm-like module"):
        report = nl.swap_norms(model)
    assert report.count == 0
    left = {name.rsplit(".", 1)[-1]: why for name, (n, why) in report.left.items()}
    unknown = ("its forward computes none of the norms normlib fuses (normlib.interop.KINDS); it runs unchanged "
               "(if it is a standard norm, please report it)")
    no_kernel = ("normlib has no fused kernel for BatchNorm, GroupNorm, InstanceNorm or LocalResponseNorm, so it runs "
                 "unchanged")
    assert left == {
        "MyNorm": unknown,
        "LN": "subclass of torch.nn.LayerNorm with a forward of its own, which normlib does not know; it runs unchanged",
        "VitDetLayerNorm": unknown,  # statistics in the input's dtype: the kernels cannot round so
        "BatchNorm2d": no_kernel,
        "GroupNorm": no_kernel,
    }
    assert "own forward" in str(report) or "of its own" in str(report)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        nl.swap_norms("not a model")


def test_torch_norms_in_a_torch_model():
    """torch.nn.LayerNorm/RMSNorm, in an encoder and on their own (the test this file grew from)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)
    model = nn.Sequential(
        nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        nn.RMSNorm(16, eps=1e-6),
        nn.LayerNorm(16, bias=False),
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(3, 7, 16)
    before = model(x)
    report = nl.swap_norms(model)
    assert report.count == 6 and report.kinds == {"torch.nn.modules.normalization.LayerNorm": "layer_norm",
                                                   "torch.nn.modules.normalization.RMSNorm": "rms_norm"}
    assert torch.equal(model(x), before)
    # normlib's own modules are normlib's already: not swapped, not reported
    assert nl.swap_norms(nn.Sequential(nl.LayerNorm(4), nl.RMSNorm(4)), warn=False).count == 0


@pytest.mark.interpreter
def test_torch_norms_through_the_kernels(kernels_on_cpu):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16), nn.RMSNorm(16, eps=1e-6))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    original = copy.deepcopy(model)
    nl.swap_norms(model)
    kernels_on_cpu()
    x = torch.randn(3, 7, 16) * 4 + 2
    torch.testing.assert_close(model(x), original(x), **close(torch.float32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not ops.HAS_TRITON, reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="set TRITON_INTERPRET=0 to run compiled kernels")
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_on_a_gpu_llama_style_bf16_logits_are_bitwise_equal(name):
    """The Llama rounding order, reproduced by the kernels (book/data/interop_check.json)."""
    original = build(name, torch.bfloat16).cuda().eval()
    model = copy.deepcopy(original)
    nl.swap_norms(model)
    inputs = {k: v.cuda() for k, v in batch().items()}
    with torch.no_grad():
        assert torch.equal(run(model, inputs).logits, run(original, inputs).logits)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not ops.HAS_TRITON, reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="set TRITON_INTERPRET=0 to run compiled kernels")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SPECS))
def test_on_a_gpu_outputs_and_gradients_agree_to_rounding(name, dtype):
    original = build(name, dtype).cuda().eval()
    model = copy.deepcopy(original)
    exact = copy.deepcopy(original).double()
    nl.swap_norms(model)
    inputs = {k: v.cuda() for k, v in batch().items()}
    outs = [run(m, inputs) for m in (model, original, exact)]
    for o in outs:
        o.loss.backward()
    ours, theirs, ref = outs
    assert_no_worse(ours.logits.detach(), theirs.logits.detach(), ref.logits.detach(), dtype, "logits")
    for (n, p), q, r in zip(model.named_parameters(), original.parameters(), exact.parameters()):
        if q.grad is None:  # a parameter this forward does not use
            assert p.grad is None, n
            continue
        assert_no_worse(p.grad, q.grad, r.grad, dtype, f"grad of {n}")


def test_a_family_is_recognised_when_only_its_own_modeling_file_is_loaded():
    """A Qwen2 model loads Qwen2's modeling file, not Llama's (the anchor of its kind)."""
    code = textwrap.dedent('''
        import sys, torch, transformers, normlib as nl
        from transformers.models.qwen2 import modeling_qwen2
        cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, intermediate_size=32)
        model = modeling_qwen2.Qwen2ForCausalLM(cfg)
        print("llama loaded before:", "transformers.models.llama.modeling_llama" in sys.modules)
        before = set(sys.modules)
        print(nl.swap_norms(model).count)
        print(sorted(m for m in set(sys.modules) - before if ".modeling_" in m))
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["llama loaded before: False", "5",
                                          "['transformers.models.llama.modeling_llama']"]
    # the other anchors (Cohere, Nemotron, Mamba2, ...) were read from their files, not imported (finding a file
    # imports its package, a lazy module that loads nothing)


def test_a_copy_of_a_norm_in_a_users_file_is_recognised_without_its_library_imported(tmp_path):
    """A user's model file with LlamaRMSNorm pasted in (renamed), in a process that never imported transformers:
    recognised from the installed file, which is imported only once the copy has its syntax tree."""
    source = open(nl.interop.recognition._anchor_file("transformers.models.llama.modeling_llama"), encoding="utf-8").read()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "LlamaRMSNorm")
    pasted = ast.get_source_segment(source, node).replace("class LlamaRMSNorm", "class MyRMSNorm", 1)
    (tmp_path / "my_model.py").write_text("import torch\nfrom torch import nn\n\n\n" + pasted + "\n")
    code = textwrap.dedent('''
        import sys, torch, normlib as nl
        from my_model import MyRMSNorm
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), MyRMSNorm(8))
        before = "transformers" in sys.modules
        report = nl.swap_norms(model, warn=False)
        print(before, report.count, model[1]._normlib_kind, "transformers.models.llama.modeling_llama" in sys.modules)
        print(nl.interop.classify(MyRMSNorm)[1])
    ''')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["False 1 llama_rms_norm True",
                                       "forward identical to transformers.models.llama.modeling_llama.LlamaRMSNorm"]


def test_anchors_read_from_their_files_match_the_imported_classes():
    """The syntax tree read from an anchor's file (to avoid importing it) is the one its imported class has."""
    checked = 0
    for entry in list(nl.interop.KINDS.values()) + list(nl.interop.UNFUSED.values()):
        for anchor in entry.anchors:
            if not anchor.module.startswith(("transformers.", "diffusers.")):
                continue
            try:
                cls = getattr(importlib.import_module(anchor.module), anchor.name)
            except (ImportError, AttributeError):  # not in this transformers version
                continue
            static = nl.interop.recognition._static_dump(anchor)
            assert static is not None and static == nl.interop.recognition._forward_dump(cls), anchor
            checked += 1
    assert checked >= 15 + (6 if importlib.util.find_spec("diffusers") else 0)
