import os

# The fused-path tests run Triton kernels on CPU tensors through Triton's
# interpreter, which must be switched on before anything imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor picks its vector ISA from ATEN_CPU_CAPABILITY, but (torch 2.13) its
# on-disk caches are not keyed on it: after a run at this CPU's own capability,
# a run with ATEN_CPU_CAPABILITY=default reuses the AVX-512 kernel source and
# compiles it against the portable header, a C++ compile error ("'at::vec' has
# not been declared"). A run that forces a capability gets a cache of its own.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import getpass
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_aten_{os.environ['ATEN_CPU_CAPABILITY']}")

import pytest
import torch

from normlib.testing.tolerance import close

# Tolerances for comparing two correct implementations in a given dtype: the one
# rule of normlib.testing.tolerance (2κ(u_out + λ√n·u_acc), n up to 4096, κ = 1).
TOL = {dtype: close(dtype) for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}


# The modules `make check` leaves to `make test` (marked `slow`): each compiles
# graphs, spawns processes, runs Triton's interpreter or the benchmarks' machinery,
# or builds transformers models, and together they are most of the suite's time
# (measured with `pytest tests --durations=0`). Everything else runs in seconds.
SLOW_MODULES = {
    "test_compile_gradients", "test_ops_interpreter", "test_distributed", "test_kernels_compile",
    "test_compile_export", "test_swap", "test_swap_scan", "test_swap_families", "test_cpu_benchmark",
    "test_custom_ops", "test_benchmark", "test_book", "test_site", "test_zh_edition", "test_ops_cuda",
    "test_tune", "test_model_benchmark", "test_fused_api", "test_project", "test_layouts", "test_standalone",
}


def pytest_ignore_collect(collection_path, config):
    """Under ``-m "not slow"`` (make check) the slow modules are not even imported (transformers, compile)."""
    if config.getoption("markexpr", "") == "not slow" and collection_path.suffix == ".py" \
            and collection_path.stem in SLOW_MODULES:
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


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
