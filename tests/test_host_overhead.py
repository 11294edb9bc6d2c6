"""The host path of a fused call may not grow: normlib's own calls per call, against the committed record.

``python -m normlib.benchmark.host`` times what a call does before its
kernel launch (on CPU, with the launch stubbed) and counts the function
calls normlib's code makes on the way; book/data/host_overhead.json holds
the record chapter 07 shows. A change that adds work to that path fails
here until the record is measured again (and the chapter re-read).
"""

import json
from pathlib import Path

import pytest
import torch

from normlib import ops

pytestmark = pytest.mark.skipif(not ops.HAS_TRITON, reason="the launch heuristics need Triton installed")

RECORD = Path(__file__).resolve().parent.parent / "book" / "data" / "host_overhead.json"


@pytest.fixture(scope="module")
def record():
    return json.loads(RECORD.read_text())


def test_the_record_has_every_case_and_its_provenance(record):
    from normlib.benchmark import host

    assert set(record["cases"]) == set(host.CASES)
    assert set(record["modules"]) == set(host.MODULE_CASES)
    for case in record["modules"].values():
        for kind in ("forward", "forward+backward"):
            c = case[kind]
            assert c["ratio_range"][0] <= c["ratio"] <= c["ratio_range"][1] and c["us"] > 0 and c["torch_us"] > 0
    assert {"cpu_model", "torch", "date", "threads"} <= set(record["provenance"])


def test_a_layer_norm_call_passes_through_at_most_six_functions_on_cpu(record):
    """From the module to torch's op: forward, the dispatch, the checks, the plan, the native op and its
    trust check; nothing more (the record shows which)."""
    from normlib.benchmark import host

    stops = host.measure_stops()
    assert stops["cpu"]["functions"] <= 6, stops["cpu"]["path"]
    assert stops["fused"]["functions"] <= record["stops"]["fused"]["functions"], stops["fused"]["path"]


@pytest.mark.parametrize("name", __import__("normlib.benchmark.host", fromlist=["CASES"]).CASES)
def test_the_host_path_does_not_grow(record, name):
    from normlib.benchmark import host

    ours, _ = host._cases()[name]
    grad = "backward" in name
    with torch.set_grad_enabled(grad), host.stubbed_launch():
        calls = host.count_calls(ours())
    assert calls <= record["cases"][name]["calls"], (
        f"{name}: normlib's host path makes {calls} calls, the record {record['cases'][name]['calls']}: "
        f"remove the new work, or measure again (python -m normlib.benchmark.host --out {RECORD})"
    )


def test_the_stub_really_stubs_and_restores():
    from normlib.benchmark import host
    from normlib.ops import _kernels, routing

    before = _kernels._norm_fwd_kernel
    with host.stubbed_launch():
        assert ops.path_for(torch.randn(2, 8)) == "triton-interpreter"
        y = ops.layer_norm(torch.randn(2, 8))  # no kernel ran: the output is whatever memory held
        assert y.shape == (2, 8)
    assert _kernels._norm_fwd_kernel is before and routing.forced_path() is None
