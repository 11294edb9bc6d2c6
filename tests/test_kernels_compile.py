"""The kernels compile for an H100 (sm_90) through Triton's real compiler, without spilling registers.

The interpreter tests run the kernels' Python; this compiles them ahead of
time for sm_90 (no GPU needed; see :mod:`normlib.benchmark.resources`), which the interpreter
cannot vouch for, and checks the register budget ptxas reports for the
launcher's configurations: no spills up to N = 8192 for either kernel.
"""

import json
import os
import subprocess
import sys

import pytest

from normlib.benchmark.resources import ptxas_path


def _compile(*specs):
    env = dict(os.environ, TRITON_INTERPRET="0")
    cmd = [sys.executable, "-m", "normlib.benchmark.resources", "--arch", "90", "--json", *specs]
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
    proc = subprocess.run([sys.executable, "-m", "normlib.benchmark.resources"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "TRITON_INTERPRET=0" in proc.stderr


def test_widest_rows_compile():
    # 64 KiB rows (the kernels' limit) compile; they may spill, which the benchmark will show. (A bf16 row of
    # 32768 with an fp32 residual would hold 128 KiB of residual: the route never launches it.)
    rows = _compile("bf16:none:layer:32768", "fp32:none:rms:16384")
    assert [(r["kernel"], r["num_warps"]) for r in rows] == [("fwd", 32), ("bwd", 32), ("fwd", 16), ("bwd", 16)]


# Shared memory a block may use on an H100 (227 KiB); more and the launch fails with OutOfResources.
H100_SHARED_LIMIT = 232448


@pytest.mark.parametrize("dtype,kind", [("bf16", "rms"), ("fp32", "rms"), ("bf16", "layer"), ("fp16", "rms")])
def test_every_default_launch_fits_in_shared_memory(dtype, kind):
    """The widest rows the kernels take (64 KiB) and the pipelined RMSNorm backward fit an H100's shared memory.

    A pipelined backward holds its stages of x and dy in shared memory; three
    stages of 16384 lanes needed 257-393 KB and failed to launch on an H100.
    """
    widest = 32768 if dtype in ("bf16", "fp16") else 16384
    specs = [f"{dtype}:none:{kind}:{n}" for n in (4096, 8192, 16384, widest) if n <= widest]
    specs.append(f"{dtype}:fp32:{kind}:{widest // 2}")
    for r in _compile(*sorted(set(specs))):
        assert r["shared_bytes"] <= H100_SHARED_LIMIT, r


def test_the_check_catches_the_launch_that_failed_on_an_h100():
    """Three pipeline stages of float32 16384-lane rows: ptxas's figure is the one the H100 refused (262216 B)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    code = ("from normlib.benchmark.resources import resources; "
            "print(resources(90, 'fp32:none:rms:16384', bwd={'num_stages': 3})[1]['shared_bytes'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.strip()) > H100_SHARED_LIMIT
