"""swap_norms on timm itself, where timm imports (the torch matrix installs it beside the lowest torch).

timm needs torchvision, which does not load against the pinned CPU torch of
``make test`` (``../shared/TOOLCHAIN.md``); there the kinds are tested on
``tests/_timm_norm_copy.py`` (``tests/test_swap_kinds.py``) and the scan of
timm's norm classes skips. Here, with timm:

* the copy is faithful: each of its forwards, and the functions they call,
  has the syntax tree of timm's (normlib's recognition compares exactly
  that), so what the kinds' tests establish on the copy holds for timm;
* a ViT built with ``norm_layer="rmsnorm"`` (the issue's 0 of 25) swaps every
  norm and computes on CPU exactly what it computed before.
"""

import copy
import importlib
import inspect

import pytest
import torch

import normlib as nl
from normlib import interop

try:
    TIMM = importlib.import_module("timm.layers.norm")
    FAST = importlib.import_module("timm.layers.fast_norm")
except Exception:  # not installed, or its torchvision does not load against this torch
    pytest.skip("timm is not installed here, or its torchvision does not load against this torch",
                allow_module_level=True)

COPY = importlib.import_module("_timm_norm_copy")
CLASSES = [n for n, c in vars(COPY).items() if isinstance(c, type) and issubclass(c, torch.nn.Module)
           and not n.startswith("_")]
FUNCTIONS = ["rms_norm", "rms_norm2d", "simple_norm"]


def _tree(fn) -> str:
    """``fn``'s syntax tree as recognition compares a forward's (annotations, docstrings and local names aside)."""
    r = interop.recognition
    return r._dump(r._normalised(r._parse(inspect.getsource(fn)))[0])


def test_the_copy_covers_timms_norms():
    assert {"LayerNorm", "LayerNorm2d", "RmsNorm", "RmsNorm2d", "RmsNormFp32", "RmsNorm2dFp32", "LayerNormFp32",
            "LayerNorm2dFp32", "SimpleNorm", "SimpleNorm2d", "SimpleNormFp32", "SimpleNorm2dFp32"} <= set(CLASSES)


@pytest.mark.parametrize("name", CLASSES)
def test_each_forward_of_the_copy_is_timms(name):
    assert interop.recognition._forward_dump(getattr(COPY, name)) == interop.recognition._forward_dump(getattr(TIMM, name))


@pytest.mark.parametrize("name", FUNCTIONS)
def test_each_function_the_forwards_call_is_timms(name):
    assert _tree(getattr(COPY, name)) == _tree(getattr(FAST, name))


def test_a_vit_with_rms_norm_swaps_every_norm_and_computes_the_same():
    """Outputs and gradients bit for bit on CPU (where a swapped module runs its class's forward)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=5, img_size=32, patch_size=8,
                              depth=2, norm_layer="rmsnorm")
    swapped = copy.deepcopy(model)
    report = nl.swap_norms(swapped, warn=False)
    norms = sum(isinstance(m, TIMM.RmsNorm) for m in model.modules())
    assert norms == 2 * 2 + 1 and report.swapped == {"timm.layers.norm.RmsNorm": norms}, str(report)
    assert report.kinds == {"timm.layers.norm.RmsNorm": "input_dtype_rms_norm"}
    x = torch.randn(2, 3, 32, 32)
    ya, yb = model(x), swapped(x)
    assert torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    for (n, p), q in zip(model.named_parameters(), swapped.parameters()):
        assert torch.equal(p.grad, q.grad), n
