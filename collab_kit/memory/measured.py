"""Measured bytes, to check the estimate against: what torch and bitsandbytes really allocated."""

from __future__ import annotations

import torch

# ---------------------------------------------------------------------------------------------
# measured bytes, to check the estimate against


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct tensors (a tensor listed twice, such as bitsandbytes' shared qmap, counts once)."""
    seen, total = set(), 0
    for value in tensors:
        if torch.is_tensor(value):
            key = (value.device, value.untyped_storage().data_ptr(), value.storage_offset(), value.numel(), value.dtype)
            if key not in seen:
                seen.add(key)
                total += value.numel() * value.element_size()
    return total


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Measured: the bytes of every tensor in ``optimizer.state`` (torch.optim.Adam, bitsandbytes' 8-bit
    optimizers, Adafactor...), each distinct tensor once."""
    return _tensor_bytes(value for state in optimizer.state.values() for value in state.values())


def parameter_bytes(module: torch.nn.Module) -> int:
    """Measured: the bytes of ``module``'s distinct parameters."""
    return _tensor_bytes(module.parameters())


def gradient_bytes(module: torch.nn.Module) -> int:
    """Measured: the bytes of the gradients ``module``'s parameters hold now."""
    return _tensor_bytes(p.grad for p in module.parameters() if p.grad is not None)
