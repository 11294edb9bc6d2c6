import os

# The fused-path tests run Triton kernels on CPU tensors through Triton's
# interpreter, which must be switched on before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

# Tolerances for comparing two correct implementations in a given dtype.
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
