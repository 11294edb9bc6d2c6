"""The fused path's dispatch rules, fallbacks, torch.compile and swap_norms (no kernels needed)."""

import pytest
import torch

import normlib as nl
import normlib.functional as F
from normlib import ops


def test_path_for_rules(monkeypatch):
    x = torch.randn(4, 8)
    monkeypatch.setattr(ops, "HAS_TRITON", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert ops.path_for(x) == "reference"  # CPU tensor, no interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.path_for(x) == "triton-interpreter"
    assert ops.path_for(x, torch.randn(4, 8)) == "triton-interpreter"
    assert ops.path_for(x.to(torch.float16)) == "triton-interpreter"
    # rows over 64 KiB, empty rows, 0-D input, meta tensors: reference
    assert ops.path_for(torch.randn(2, 16385)) == "reference"
    assert ops.path_for(torch.randn(2, 16384)) == "triton-interpreter"
    assert ops.path_for(torch.randn(2, 32768, dtype=torch.bfloat16)) == "triton-interpreter"
    assert ops.path_for(torch.randn(2, 16384, dtype=torch.bfloat16), torch.randn(2, 16384, dtype=torch.float64)) == "reference"
    assert ops.path_for(torch.randn(3, 0)) == "reference"
    assert ops.path_for(torch.tensor(1.0)) == "reference"
    assert ops.path_for(torch.empty(4, 8, device="meta")) == "reference"
    monkeypatch.setattr(ops, "HAS_TRITON", False)
    assert ops.path_for(x) == "reference"


def test_modules_use_kernels_only_on_cuda(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(4, 8)
    assert not ops.use_fused(x)  # the interpreter is opt-in through normlib.ops only
    monkeypatch.setattr(ops, "_fused", lambda *a: pytest.fail("modules must not use the kernels on CPU"))
    nl.LayerNorm(8)(x)
    nl.RMSNorm(8)(x)
    nl.TransformerBlock(8, 2)(x.view(1, 4, 8))


@pytest.mark.skipif(not torch.cuda.is_available() or not ops.HAS_TRITON, reason="needs a CUDA device")
def test_cuda_tensors_take_the_triton_path():
    x = torch.randn(4, 8, device="cuda")
    assert ops.path_for(x) == "triton" and ops.use_fused(x)


def test_fallback_is_the_reference_math(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(0)
    x, r, w, b = torch.randn(3, 5, 10), torch.randn(3, 5, 10), torch.randn(10), torch.randn(10)
    assert ops.path_for(x) == "reference"
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (10,), w, b, 1e-5))
    torch.testing.assert_close(ops.rms_norm(x, w), F.rms_norm(x, (10,), w))
    y, res = ops.add_layer_norm(x, r, w, b)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(y, F.layer_norm(x + r, (10,), w, b))
    y, res = ops.add_rms_norm(x.half(), r, w)
    assert res.dtype == torch.float32 and y.dtype == torch.float16
    torch.testing.assert_close(y, F.rms_norm(x.half().float() + r, (10,), w).half())


def test_fused_api_rejects_bad_input():
    x = torch.randn(3, 8)
    with pytest.raises(TypeError, match="input must be a floating-point tensor"):
        ops.layer_norm(torch.ones(3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match=r"residual must have the shape of input \[3, 8\] \(got \[3, 7\]\)"):
        ops.add_layer_norm(x, torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        ops.rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        ops.add_rms_norm(x, x, None, -1.0)
    with pytest.raises(ValueError, match="at least one dimension"):
        ops.layer_norm(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"weight must be on the input's device cpu \(got meta\)"):
        ops.layer_norm(x, torch.ones(8, device="meta"))
    with pytest.raises(ValueError, match=r"residual must be on the input's device cpu \(got meta\)"):
        ops.add_rms_norm(x, torch.empty(3, 8, device="meta"))


def test_torch_compile_fullgraph():
    torch.manual_seed(0)
    model = torch.nn.Sequential(nl.LayerNorm(16), torch.nn.Linear(16, 16), nl.RMSNorm(16))
    block = nl.TransformerBlock(16, 4, norm_first=True)
    x = torch.randn(2, 5, 16)
    for m in (model, block):
        compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(x), m(x))


def test_swap_norms_keeps_outputs_and_modules(monkeypatch):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        torch.nn.RMSNorm(16, eps=1e-6),
        torch.nn.LayerNorm(16, bias=False),
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(3, 7, 16)
    before = model(x)
    modules = list(model.modules())
    report = nl.swap_norms(model)
    assert list(model.modules()) == modules  # in place: the same module objects
    assert report.count == 6 and sum(report.swapped.values()) == 6
    assert report.kinds == {"torch.nn.modules.normalization.LayerNorm": "layer_norm",
                            "torch.nn.modules.normalization.RMSNorm": "rms_norm"}
    assert torch.equal(model(x), before)  # on CPU the class's own forward runs: bit for bit
    # through the kernels (the interpreter standing in for CUDA) the outputs agree to rounding
    if ops.HAS_TRITON:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(ops, "use_fused", lambda x, residual=None: ops.path_for(x, residual) != "reference")
        if ops.path_for(x) == "triton-interpreter":
            torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)
    again = nl.swap_norms(model)  # idempotent
    assert sum(again.swapped.values()) == 0 and again.count == 6
    assert "already" in str(again)
    assert nl.unswap_norms(model) == 6 and "forward" not in vars(model[1])
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        nl.swap_norms("not a model")


def test_swap_norms_reports_what_it_leaves_and_warns_when_nothing_is_swapped():
    class MyNorm(torch.nn.Module):
        def forward(self, x):
            return x / x.norm(dim=-1, keepdim=True)

    class LN(torch.nn.LayerNorm):
        def forward(self, x):  # its own forward: normlib cannot know what it computes
            return super().forward(x) * 2

    model = torch.nn.Sequential(MyNorm(), LN(4))
    with pytest.warns(UserWarning, match="swapped nothing"):
        report = nl.swap_norms(model)
    assert report.count == 0
    assert set(report.left) == {f"{__name__}.{n}" for n in (
        "test_swap_norms_reports_what_it_leaves_and_warns_when_nothing_is_swapped.<locals>.MyNorm",
        "test_swap_norms_reports_what_it_leaves_and_warns_when_nothing_is_swapped.<locals>.LN")}
    assert "own forward" in str(report) and "not a norm normlib knows" in str(report)
