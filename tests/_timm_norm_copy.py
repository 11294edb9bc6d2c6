"""Stand-ins for ``timm.layers.norm.LayerNorm`` and ``LayerNorm2d``, whose forwards they reproduce.

timm needs torchvision, and neither loads against the pinned CPU torch here
(see ``../shared/TOOLCHAIN.md``), so the swap tests install this module as
``sys.modules["timm.layers.norm"]``. The two ``forward`` methods are the code
of timm's classes (timm is Apache-2.0; huggingface/pytorch-image-models,
``timm/layers/norm.py``), statement for statement, since normlib recognises a
class by the syntax tree of its forward; the constructors are reduced to what
the forwards read. ``fast_layer_norm`` and ``is_fast_norm`` stand in for
timm's (fast-norm mode off by default, as in timm).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def is_fast_norm():
    return False


def fast_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    # timm's version runs apex's kernel, or F.layer_norm in the autocast dtype
    raise NotImplementedError("stand-in: the tests never switch fast-norm mode on for a forward")


class LayerNorm(nn.LayerNorm):
    """LayerNorm w/ fast norm option"""

    _fast_norm: torch.jit.Final[bool]

    def __init__(self, num_channels, eps=1e-6, affine=True, **kwargs):
        super().__init__(num_channels, eps=eps, elementwise_affine=affine, **kwargs)
        self._fast_norm = is_fast_norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fast_norm:
            x = fast_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        else:
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm for channels of '2D' spatial NCHW tensors"""

    _fast_norm: torch.jit.Final[bool]

    def __init__(self, num_channels, eps=1e-6, affine=True, **kwargs):
        super().__init__(num_channels, eps=eps, elementwise_affine=affine, **kwargs)
        self._fast_norm = is_fast_norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        if self._fast_norm:
            x = fast_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        else:
            x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x
