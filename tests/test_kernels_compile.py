"""The kernels compile for an H100 (sm_90) through Triton's real compiler, without spilling registers.

The interpreter tests run the kernels' Python; this compiles them ahead of
time for sm_90 (no GPU needed; see :mod:`normlib.ops.resources`), which the interpreter
cannot vouch for, and checks the register budget ptxas reports for the
launcher's configurations: no spills up to N = 8192 for either kernel.
"""

import json
import os
import subprocess
import sys

import pytest

from normlib.ops.resources import ptxas_path


def _compile(*specs):
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "normlib.ops.resources", "--arch", "90", "--json", *specs]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


pytestmark = pytest.mark.skipif(ptxas_path() is None, reason="needs Triton with its NVIDIA backend (ptxas)")

# (dtype, residual dtype, kind, N): every dtype, both kinds, with and without a
# residual, and the widths where the launcher's warp count changes.
SPECS = [
    "bf16:fp32:layer:1024",
    "bf16:none:rms:4096",
    "fp16:fp16:rms:8192",
    "fp32:none:layer:8192",
    "fp32:fp32:layer:3000",
    "bf16:bf16:layer:100",
]


@pytest.mark.parametrize("spec", SPECS)
def test_compiles_for_sm90_without_spills(spec):
    rows = _compile(spec)
    assert [r["kernel"] for r in rows] == ["fwd", "bwd"]
    for r in rows:
        assert r["registers"] <= 255, r
        assert r["spill_bytes"] == 0, f"{r['kernel']} spills {r['spill_bytes']} bytes per thread at {spec}: {r}"


def test_refuses_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "normlib.ops.resources"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "TRITON_INTERPRET=0" in proc.stderr


def test_widest_rows_compile():
    # 64 KiB rows (the kernels' limit) compile; they may spill, which the benchmark will show.
    rows = _compile("bf16:fp32:layer:32768", "fp32:none:rms:16384")
    assert len(rows) == 4 and all(r["num_warps"] == 32 for r in rows)
