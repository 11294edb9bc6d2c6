"""The fused path's dispatch rules, fallbacks, torch.compile and the resources tool (no kernels needed).

swap_norms is tested in test_swap.py.
"""

import os
import subprocess
import sys

import pytest
import torch

import normlib as nl
import normlib.functional as F
from normlib import ops
from normlib.ops import native


def test_path_for_rules(monkeypatch):
    from normlib.ops import routing as R

    x = torch.randn(4, 8)
    monkeypatch.setattr(R, "HAS_TRITON", True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.path_for(x) == "native"  # a CPU tensor: torch's op, checked; the interpreter only when forced
    rms_native = "native" if native.HAS_RMS_NORM else "reference"  # torch's RMSNorm that returns its rstd
    assert ops.path_for(x, op="rms_norm") == rms_native
    with ops.force_path("fused"):
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
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert ops.path_for(x) == "reference"  # forced, but the kernels cannot run here
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        monkeypatch.setattr(R, "HAS_TRITON", False)
        assert ops.path_for(x) == "reference"
    with ops.force_path("reference"):
        assert ops.path_for(x) == "reference"
    with ops.force_path("native"):
        assert ops.path_for(x, op="rms_norm") == rms_native
    with pytest.raises(ValueError, match="path must be one of"):
        with ops.force_path("triton"):
            pass


def test_modules_use_kernels_only_on_cuda(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(4, 8)
    assert not ops.use_fused(x)  # the interpreter is opt-in through force_path("fused") only
    monkeypatch.setattr(ops.dispatch, "fused", lambda *a, **k: pytest.fail("modules must not use the kernels on CPU"))
    nl.LayerNorm(8)(x)
    nl.RMSNorm(8)(x)
    nl.TransformerBlock(8, 2)(x.view(1, 4, 8))


@pytest.mark.skipif(not torch.cuda.is_available() or not ops.HAS_TRITON, reason="needs a CUDA device")
def test_cuda_tensors_take_the_triton_path():
    x = torch.randn(4, 8, device="cuda")
    assert ops.path_for(x) == "triton" and ops.use_fused(x)


@pytest.mark.parametrize("path", ["native", "reference"])
def test_fallback_is_the_reference_math(path):
    torch.manual_seed(0)
    x, r, w, b = torch.randn(3, 5, 10), torch.randn(3, 5, 10), torch.randn(10), torch.randn(10)
    with ops.force_path(path):
        assert ops.path_for(x) == path
        _fallback_checks(x, r, w, b)


def _fallback_checks(x, r, w, b):
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
    with pytest.raises(ValueError, match=r"weight is on device meta but input is on cpu"):
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


def test_resources_tool_without_triton_ends_with_one_line():
    """python -m normlib.benchmark.resources on a machine without Triton: exit status 2 and one line, no traceback."""
    code = "import sys, runpy; sys.modules['triton'] = None; runpy.run_module('normlib.benchmark.resources', run_name='__main__')"
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normlib.benchmark.resources: needs Triton"), proc.stderr
    assert proc.stdout == ""
