"""The machinery of ``python -m normlib.benchmark --device cpu`` (tiny shapes; the timings are thrown away)."""

import json
import subprocess
import sys

import pytest

import torch
from torch import nn

import normlib as nl
from normlib.benchmark import cpu


def test_saved_bytes_counts_distinct_storages_and_skips_parameters():
    x = torch.randn(4, 8, requires_grad=True)
    assert cpu.saved_bytes(lambda t: t * t, x) == 4 * 8 * 4  # x saved twice, one storage
    assert cpu.saved_bytes(lambda t: t.exp(), x) == 4 * 8 * 4  # the result
    w = torch.randn(8, requires_grad=True)
    assert cpu.saved_bytes(lambda t: t * w, x, exclude=[w]) == 4 * 8 * 4  # x only
    assert cpu.saved_bytes(lambda t: t.sum(), x) == 0  # nothing saved


def test_normlib_saves_what_torch_saves_for_the_issue_layers():
    for case in cpu.CASES[:5]:
        module, ours, reference = case.build()
        x = torch.randn((2,) + tuple(case.shape[1:3]) + tuple(min(s, 8) for s in case.shape[3:]), requires_grad=True)
        params = list(module.parameters())
        theirs = cpu.saved_bytes(module, x, params)
        mine = cpu.saved_bytes(ours, x, list(ours.parameters()))
        ref = cpu.saved_bytes(reference, x, params)
        assert max(mine, ref) <= cpu.TARGETS["saved"] * theirs, (case.name, mine, ref, theirs)


def test_cases_compute_what_torch_computes():
    torch.manual_seed(0)
    for case in cpu.CASES:
        module, ours, reference = case.build()
        assert type(ours).__module__.startswith("normlib.")  # normlib's module, not torch's
        x = torch.randn((2,) + tuple(case.shape[1:3]) + tuple(min(s, 6) for s in case.shape[3:]))
        expected = module(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(reference(x), expected, atol=1e-4, rtol=1e-4)


def test_run_case_record():
    def build():
        m = nn.LayerNorm(16)
        return m, cpu._twin(m, nl.LayerNorm(16)), lambda x: m(x)

    case = cpu.Case("tiny LayerNorm", (4, 16), build, True)
    rec = cpu.run_case(case, rounds=3, budget=0.001, compile=False)
    assert rec["rounds"] == 3 and rec["shape"] == [4, 16]
    assert set(rec["ratio"]) == {"fwd", "fwd+bwd", "saved"}
    assert rec["ratio"]["saved"]["normlib"] == 1.0  # torch's op on the native path: what torch saves
    assert set(rec["ratio"]["fwd"]) == {"normlib", "reference"}
    for m in ("fwd", "fwd+bwd"):
        lo, hi = rec["ratio_range"][m]["normlib"]
        assert 0 < lo <= rec["ratio"][m]["normlib"] <= hi
    assert set(rec["met"]) == {"fwd", "fwd+bwd", "saved"}
    assert all(isinstance(v, bool) for v in rec["met"].values())


def test_profile_lists_shares_of_the_time():
    x = torch.randn(8, 32, requires_grad=True)
    m = nn.LayerNorm(32)
    rows = cpu.profile(m, x, list(m.parameters()), torch.randn(8, 32), top=3)
    # shares are rounded to 0.001: an op with a sliver of the time (the autograd engine's own row, under load)
    # shows 0.0; the rows come largest first and together hold at most the whole
    shares = [r["share"] for r in rows]
    assert 1 <= len(rows) <= 3 and shares[0] > 0 and all(0 <= s <= 1 for s in shares), rows
    assert shares == sorted(shares, reverse=True) and sum(shares) <= 1 + 0.0005 * len(shares), rows


def test_run_bert_tiny():
    pytest.importorskip("transformers")
    rec = cpu.run_bert(batch=2, seq=8, hidden=32, layers=1, rounds=2, budget=0.001)
    assert rec["same_gradients"]
    assert rec["layer_norms"] == 3 and rec["swap_norms_swapped"] == 3  # embeddings + 2 per layer
    assert set(rec["ratio"]) == {"swap_norms", "functional LayerNorm"}


def test_command_line(tmp_path):
    pytest.importorskip("matplotlib")  # for --plot
    out, fig = tmp_path / "cpu.json", tmp_path / "cpu.svg"
    cmd = [
        sys.executable, "-m", "normlib.benchmark", "--device", "cpu", "--cases", "RMSNorm(768)",
        "BatchNorm2d(64) eval", "--scale", "32", "--rounds", "2", "--budget", "0.001",
        "--no-compile", "--no-bert", "--out", str(out), "--plot", str(fig),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "RMSNorm(768)" in res.stdout and ("met" in res.stdout or "MISSED" in res.stdout)
    data = json.loads(out.read_text())
    for key in ("machine", "cpu_model", "threads", "torch", "date", "loadavg_before", "loadavg_after"):
        assert key in data["provenance"]
    assert [c["case"] for c in data["cases"]] == ["RMSNorm(768)", "BatchNorm2d(64) eval"]
    assert data["cases"][0]["shape"] == [1, 128, 768]
    assert fig.read_text().lstrip().startswith("<?xml")


def test_swap_cpu_record_and_its_bitwise_flags(tmp_path):
    """The swap instrument: a swapped module is the module's numbers bit for bit; normlib's reference path is not."""
    from normlib.benchmark import swap_cpu

    data = swap_cpu.measure(rounds=1, budget=0.001, shapes=[(2, 16)])
    assert set(data["cases"]) == {f"{n} {d} (2, 16)" for n in ("RMSNorm", "LayerNorm") for d in swap_cpu.DTYPES}
    for name, case in data["cases"].items():
        assert case["module_us"] > 0
        assert case["candidates"]["swapped"]["bitwise"], name
        for c in case["candidates"].values():
            lo, hi = c["ratio_range"]
            assert 0 < lo <= c["ratio"] <= hi
    # bfloat16 LayerNorm takes normlib's reference (float32 accumulation of γ's gradient): not torch's numbers
    assert not data["cases"]["LayerNorm bfloat16 (2, 16)"]["candidates"]["normlib"]["bitwise"]
    if nl.ops.native.HAS_RMS_NORM:
        assert data["cases"]["RMSNorm float32 (2, 16)"]["candidates"]["torch fused op"]["bitwise"]
