"""Replace a model's torch.nn norm layers with normlib's, keeping their weights."""

from __future__ import annotations

import torch
from torch import nn

from .normalization import LayerNorm, RMSNorm

__all__ = ["swap_norms"]


def _convert(module: nn.Module) -> nn.Module | None:
    if type(module) is nn.LayerNorm:
        new = LayerNorm(
            module.normalized_shape,
            eps=module.eps,
            elementwise_affine=module.elementwise_affine,
            bias=module.bias is not None,
        )
    elif type(module) is nn.RMSNorm:
        new = RMSNorm(module.normalized_shape, eps=module.eps, elementwise_affine=module.elementwise_affine)
    else:
        return None
    ref = next(iter(module.parameters()), None)
    if ref is not None:
        new = new.to(device=ref.device, dtype=ref.dtype)
    new.load_state_dict(module.state_dict())
    new.train(module.training)
    return new


@torch.no_grad()
def swap_norms(model: nn.Module) -> nn.Module:
    """Swap every ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` in ``model`` for normlib's, in place.

    Parameters (and their device and dtype) are kept, so outputs are unchanged;
    on CUDA the swapped layers then run through the fused Triton kernels.
    Subclasses of the torch layers are left alone, since they may override
    ``forward``. Returns ``model`` (a bare norm layer is returned converted).

    Example:
        >>> enc = torch.nn.TransformerEncoderLayer(16, 4, batch_first=True)
        >>> type(swap_norms(enc).norm1).__module__
        'normlib.normalization'
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (got {type(model).__name__})")
    top = _convert(model)
    if top is not None:
        return top
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _convert(child)
            if new is not None:
                setattr(parent, name, new)
    return model
