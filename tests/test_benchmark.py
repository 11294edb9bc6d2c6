"""The benchmark's bookkeeping; the measurements themselves need a GPU."""

import subprocess
import sys

import pytest
import torch

from normlib import benchmark


def test_bytes_model():
    assert benchmark.bytes_moved("layer_norm", "fwd", 4096, 1024, 2) == 2 * 4096 * 1024 * 2
    assert benchmark.bytes_moved("add_rms_norm", "fwd", 10, 10, 4) == 4 * 100 * 4
    assert benchmark.bytes_moved("rms_norm", "fwd+bwd", 10, 10, 2) == 5 * 100 * 2
    assert benchmark.bytes_moved("add_rms_norm", "fwd+bwd", 10, 10, 2) == 9 * 100 * 2
    assert benchmark.bytes_moved("", "copy", 10, 10, 2) == 2 * 100 * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_refuses_to_run_without_a_gpu(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, "-m", "normlib.benchmark", "--out", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "no CUDA GPU" in proc.stderr
    assert not out.exists()


def test_ratios_arithmetic():
    # bookkeeping only: hand-made records, not measurements
    recs = []
    for M, N in ((8192, 4096), (4096, 1024)):
        recs.append(dict(op="copy", mode="copy", provider="copy", dtype="bf16", M=M, N=N, ms=1.0, gbps=100.0))
        for prov, ms in (("normlib", 1.0), ("torch", 2.0), ("torch.compile", 1.5)):
            recs.append(dict(op="rms_norm", mode="fwd", provider=prov, dtype="bf16", M=M, N=N, ms=ms, gbps=90.0 / ms))
    r = benchmark.ratios({"results": recs})["rms_norm fwd"]
    assert r["median_of_copy_bandwidth_MN_ge_2^25"] == pytest.approx(0.9)
    assert r["min_of_copy_bandwidth"] == pytest.approx(0.9)
    assert r["speedup_vs_torch"] == pytest.approx(2.0)
    assert r["speedup_vs_torch.compile"] == pytest.approx(1.5)
