import os

# The fused-path tests run Triton kernels on CPU tensors through Triton's
# interpreter, which must be switched on before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from normlib.testing.tolerance import close

# Tolerances for comparing two correct implementations in a given dtype: the one
# rule of normlib.testing.tolerance (2κ(u_out + λ√n·u_acc), n up to 4096, κ = 1).
TOL = {dtype: close(dtype) for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def kernels_on_cpu():
    """Call the returned function to run the rest of the test on the kernels, CPU tensors included.

    It forces the route onto the fused path (``normlib.ops.force_path("fused")``),
    where CPU tensors run through Triton's interpreter, until the test ends;
    it skips the test where Triton or its interpreter is missing.
    """
    import contextlib

    from normlib import ops

    stack = contextlib.ExitStack()

    def enter() -> None:
        if not ops.HAS_TRITON:
            pytest.skip("needs Triton (its interpreter runs the kernels on CPU)")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs TRITON_INTERPRET=1 before Triton is imported")
        stack.enter_context(ops.force_path("fused"))

    with stack:
        yield enter
