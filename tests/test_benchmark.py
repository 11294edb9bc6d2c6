"""The benchmark's bookkeeping and machinery; its measurements need a GPU.

The machinery is exercised end to end on CPU (kernels through the Triton
interpreter, a wall-clock timer, tiny shapes): every record it must produce,
resuming, the summary, the targets, the report and the plot. Those CPU
timings are thrown away; the command line refuses to run without a GPU.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from normlib import ops
from normlib.benchmark import _common, gpu


def test_bytes_model():
    assert gpu.bytes_moved("layer_norm", "fwd", 4096, 1024, 2) == 2 * 4096 * 1024 * 2
    assert gpu.bytes_moved("add_rms_norm", "fwd", 10, 10, 4) == 4 * 100 * 4
    assert gpu.bytes_moved("rms_norm", "bwd", 10, 10, 2) == 3 * 100 * 2
    assert gpu.bytes_moved("add_rms_norm", "bwd", 10, 10, 2) == 5 * 100 * 2
    assert gpu.bytes_moved("rms_norm", "fwd+bwd", 10, 10, 2) == 5 * 100 * 2
    assert gpu.bytes_moved("add_rms_norm", "fwd+bwd", 10, 10, 2) == 9 * 100 * 2
    assert gpu.bytes_moved("", "copy", 10, 10, 2) == 2 * 100 * 2
    for op in gpu.OPS:  # forward + backward moves what the two move apart
        fwd, bwd, both = (gpu.bytes_moved(op, m, 3, 5, 2) for m in gpu.MODES)
        assert fwd + bwd == both


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_refuses_to_run_without_a_gpu(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, "-m", "normlib.benchmark", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "no CUDA GPU" in proc.stderr
    assert not out.exists()


def _records(shapes, times):
    """Hand-made records (bookkeeping only, not measurements): times[(op, mode, provider)] in ms."""
    recs = []
    for M, N in shapes:
        recs.append(dict(op="copy", mode="copy", provider="copy", dtype="bf16", M=M, N=N, ms=1.0, gbps=100.0))
        for (op, mode, prov), ms in times.items():
            recs.append(dict(op=op, mode=mode, provider=prov, dtype="bf16", M=M, N=N, ms=ms, gbps=90.0 / ms))
    return {"environment": {"device": "x", "driver": "x", "cuda": "x", "torch": "x", "triton": "x", "date": "2026"}, "results": recs}


def test_ratios_arithmetic():
    times = {("rms_norm", "fwd", p): ms for p, ms in (("normlib", 1.0), ("torch", 2.0), ("torch.compile", 1.5))}
    r = gpu.ratios(_records([(8192, 4096), (4096, 1024)], times))["rms_norm fwd"]
    assert r["median_of_copy_bandwidth_MN_ge_2^25"] == pytest.approx(0.9)  # only 8192 x 4096 counts
    assert r["median_of_copy_bandwidth_N_le_8K_M_ge_16K"] is None  # no such shape measured
    assert r["min_of_copy_bandwidth"] == pytest.approx(0.9)
    assert r["speedup_vs_torch"] == pytest.approx(2.0)
    assert r["speedup_vs_torch.compile"] == pytest.approx(1.5)


def test_targets_are_judged_from_the_ratios():
    times = {}
    for op in gpu.OPS:
        for mode in gpu.MODES:
            times[(op, mode, "normlib")] = 1.0
            times[(op, mode, "torch")] = 1.45  # fwd passes 1.3x (LN) and 1.4x (RMS); bwd fails 1.5x
            times[(op, mode, "torch.compile")] = 0.96  # passes 0.95x forward, fails 1.0x backward
    rows = gpu.targets(_records([(16384, 4096)], times))
    by = {(t["op_mode"], t["target"]): t for t in rows}
    fwd_share = by[("rms_norm fwd", "share of copy bandwidth, median, M*N >= 2^25")]
    assert fwd_share["value"] == pytest.approx(0.9) and fwd_share["met"] is True
    assert by[("layer_norm bwd", "share of copy bandwidth, median, M*N >= 2^25")]["met"] is True
    assert by[("layer_norm fwd", "speed-up over torch eager")]["met"] is True
    assert by[("rms_norm fwd", "speed-up over torch eager")]["required"] == 1.4
    assert by[("rms_norm fwd", "speed-up over torch eager")]["met"] is True
    assert by[("layer_norm bwd", "speed-up over torch eager")]["met"] is False
    assert by[("rms_norm bwd", "speed-up over torch eager")]["required"] == 2.0
    assert by[("layer_norm fwd", "speed-up over torch.compile")]["met"] is True
    assert by[("layer_norm bwd", "speed-up over torch.compile")]["met"] is False
    assert by[("add_rms_norm fwd+bwd", "speed-up over torch eager")]["met"] is False
    compile_rows = [t for t in rows if t["target"] == "speed-up over torch.compile"]
    assert all(t["met"] is (t["op_mode"].endswith(" fwd")) for t in compile_rows)
    text = gpu.report(_records([(16384, 4096)], times))
    assert "NO" in text and "yes" in text


@pytest.mark.interpreter
@pytest.mark.skipif(not ops.HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_machinery_end_to_end_on_cpu(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")

    matplotlib.use("Agg")
    monkeypatch.setattr(gpu, "COMPILE_BACKEND", "aot_eager")
    saved = []
    kw = dict(device="cpu", timer=_common.wall_timer, log=lambda line: None)
    first = gpu.run(["fp32"], rows=[3], widths=[16, 40], save=lambda d: saved.append(len(d["results"])), **kw)
    # per shape: the copy, then 3 ops x 3 providers x 3 modes
    assert saved == [28, 56]
    assert {(r["op"], r["mode"], r["provider"]) for r in first["results"]} >= {("add_rms_norm", "bwd", "torch.compile"), ("copy", "copy", "copy")}
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in first["results"])
    assert first["environment"]["device"].startswith("cpu") and first["runs"] == [first["environment"]["date"]]

    # resuming measures only what is missing, and keeps the first environment
    partial = dict(first, results=[r for r in first["results"] if not (r["N"] == 40 and r["op"] == "rms_norm")])
    lines = []
    second = gpu.run(["fp32"], rows=[3], widths=[16, 40], previous=partial, **dict(kw, log=lines.append))
    assert len(lines) == 9 and all(" rms_norm " in line and "N=    40" in line for line in lines)
    assert len(second["results"]) == 56 and len(second["runs"]) == 2
    assert second["environment"] == first["environment"]
    with pytest.raises(ValueError, match="another environment: device"):
        gpu.run(["fp32"], rows=[3], widths=[16], previous=dict(first, environment=dict(first["environment"], device="other")), **kw)

    path = tmp_path / "b.json"
    _common.write_json(second, str(path))
    data = json.loads(path.read_text())
    assert len(gpu.targets(data, "fp32")) == 5 * 3 + 1 + 9
    assert "measured on cpu" in gpu.report(data, "fp32")
    fig = gpu.plot(data, str(tmp_path / "b.png"), dtype="fp32")
    assert len(fig.axes) == 9 and (tmp_path / "b.png").stat().st_size > 0


def test_each_mode_times_what_it_says():
    steps = []

    def spy_timer(fn, grad_to_none=None):
        leaves = grad_to_none or ()
        for t in leaves:
            t.grad = None
        fn()
        steps.append((torch.is_grad_enabled(), [t.grad is not None for t in leaves]))
        return 1.0

    fn = gpu._provider_fn("torch", "add_rms_norm")
    ms = gpu.measure_op(fn, gpu.MODES, 4, 8, torch.float32, "cpu", spy_timer)
    assert ms == {"fwd": 1.0, "bwd": 1.0, "fwd+bwd": 1.0}
    assert steps[0] == (False, [])  # forward: without autograd
    assert steps[1] == (True, [True, True, True, False])  # backward alone: x, residual, weight (no bias in RMSNorm)
    assert steps[2] == (True, [True, True, True, False])  # forward + backward: the same


# Liger-Kernel: a provider wherever it is installed, imported only when it runs.


def test_liger_is_skipped_with_a_message_where_it_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # absent, even on a machine that has it
    providers, skipped = gpu.choose_providers(None)
    assert providers == list(gpu.PROVIDERS)  # torch.compile is always measured: it comes with torch
    assert skipped == ["skipping provider liger: Liger-Kernel is not installed (pip install liger-kernel)"]
    assert gpu.choose_providers(["torch", "liger"], ["rms_norm"]) == (["torch"], skipped)


def test_liger_asked_for_by_name_but_absent_stops_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # get past the GPU check: nothing is measured
    monkeypatch.setattr(ops, "HAS_TRITON", True)
    out = tmp_path / "b.json"
    assert gpu.main(["--providers", "torch", "liger", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        "normlib.benchmark: skipping provider liger: Liger-Kernel is not installed (pip install liger-kernel)\n")
    assert not out.exists()


def _stand_in_liger(monkeypatch) -> list:
    """Modules where Liger-Kernel's Functions would be, with its call signatures and torch's math; returns the calls."""
    import importlib.machinery
    import types

    import torch.nn.functional as F

    calls = []

    def layer_norm(X, W, B, eps):
        calls.append(("layer_norm", eps))
        return F.layer_norm(X, X.shape[-1:], W, B, eps)

    def rms_norm(X, W, eps, offset, casting_mode, in_place):
        calls.append(("rms_norm", eps, offset, casting_mode, in_place))
        return F.rms_norm(X, X.shape[-1:], W + offset, eps)

    def fused_add_rms_norm(X, R, W, eps, offset, casting_mode, in_place):
        calls.append(("add_rms_norm", eps, offset, casting_mode, in_place))
        S = X + R
        return F.rms_norm(S, S.shape[-1:], W + offset, eps), S

    for name, fn in (("", None), (".ops", None), (".ops.layer_norm", ("LigerLayerNormFunction", layer_norm)),
                     (".ops.rms_norm", ("LigerRMSNormFunction", rms_norm)),
                     (".ops.fused_add_rms_norm", ("LigerFusedAddRMSNormFunction", fused_add_rms_norm))):
        module = types.ModuleType("liger_kernel" + name)
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
        if fn is not None:
            setattr(module, fn[0], type(fn[0], (), {"apply": staticmethod(fn[1])}))
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return calls


def test_liger_is_measured_where_it_is_installed(monkeypatch):
    calls = _stand_in_liger(monkeypatch)
    assert gpu.choose_providers(None) == ([*gpu.PROVIDERS, "liger"], [])
    monkeypatch.setattr(gpu, "environment", lambda device: dict(device="cpu", driver="none", cuda=None, torch="x",
                                                                 triton="x", date="2026"))
    data = gpu.run(["fp32"], rows=[3], widths=[16], providers=("torch", "liger"), device="cpu",
                   timer=_common.wall_timer, log=lambda line: None)
    measured = {(r["op"], r["mode"]) for r in data["results"] if r["provider"] == "liger"}
    assert measured == {(op, mode) for op in gpu.OPS for mode in gpu.MODES}
    eps = torch.finfo(torch.float32).eps  # normlib's and torch's RMSNorm default, as Liger is called with
    assert set(calls) == {("layer_norm", 1e-5), ("rms_norm", eps, 0.0, "llama", False),
                                  ("add_rms_norm", eps, 0.0, "llama", False)}
    # the summary and the report compare against it where it was measured (normlib's times stand in here)
    data["results"] += [dict(r, provider="normlib") for r in data["results"] if r["provider"] == "torch"]
    assert gpu.ratios(data, "fp32")["rms_norm fwd"]["speedup_vs_liger"] > 0
    assert "speed-up over liger (no target): add_rms_norm bwd " in gpu.report(data, "fp32")


def test_records_without_liger_keep_their_fields():
    times = {("rms_norm", "fwd", p): ms for p, ms in (("normlib", 1.0), ("torch", 2.0), ("torch.compile", 1.5))}
    data = _records([(8192, 4096)], times)
    assert not any("liger" in key for entry in gpu.ratios(data).values() for key in entry)
    assert "liger" not in gpu.report(data)
