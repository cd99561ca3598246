"""Reversible residual layers: activations are recomputed in backward, so memory does not grow with depth.

A reversible layer (RevNet, Gomez et al. 2017; used in the paper after Brügger et al. 2019) keeps two
streams and updates them in turn::

    y1 = x1 + f(x2)        # f: attention
    y2 = x2 + g(y1)        # g: feed-forward

Its inputs can be rebuilt from its outputs (``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``), so the forward
pass keeps no activation at all: only the last layer's outputs are saved, and backward walks the
layers from the top, rebuilding each layer's inputs and back-propagating through one layer at a time.
The memory of a 64-layer model is then that of one layer.

``run_plain`` is the same computation with ordinary autograd (every activation kept); tests check
that both give the same gradients.
"""
from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch

Layer = Tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]  # (f, g)


def run_plain(x1: torch.Tensor, x2: torch.Tensor, layers: Sequence[Layer]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both streams through every ``(f, g)`` layer, with ordinary autograd."""
    for f, g in layers:
        x1 = x1 + f(x2)
        x2 = x2 + g(x1)
    return x1, x2


def run_reversible(x1: torch.Tensor, x2: torch.Tensor, layers: Sequence[Layer]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Like ``run_plain``, keeping no activations for backward.

    The parameters of ``f`` and ``g`` get their gradients during ``loss.backward()`` as usual (they are
    accumulated, so a block used by several layers sums its gradients). ``torch.autograd.grad`` with
    those parameters as inputs is not supported: the function does not list them as its inputs.
    """
    return _ReversibleFunction.apply(x1, x2, tuple(layers))


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1: torch.Tensor, x2: torch.Tensor, layers: Tuple[Layer, ...]):
        # autograd.Function.forward runs without recording a graph: nothing here is kept
        y1, y2 = run_plain(x1, x2, layers)
        ctx.layers = layers
        # backward recomputes the layers: under the same autocast as the forward pass, or the rebuilt
        # inputs would not be the ones the forward pass used
        device_type = x1.device.type
        ctx.autocast = dict(device_type=device_type, enabled=torch.is_autocast_enabled(device_type),
                            dtype=torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(y1, y2)
        return y1, y2

    @staticmethod
    def backward(ctx, grad_y1: torch.Tensor, grad_y2: torch.Tensor):
        y1, y2 = ctx.saved_tensors
        grad_y1 = torch.zeros_like(y1) if grad_y1 is None else grad_y1
        grad_y2 = torch.zeros_like(y2) if grad_y2 is None else grad_y2
        with torch.autocast(**ctx.autocast):
            return _ReversibleFunction._backward(ctx.layers, y1, y2, grad_y1, grad_y2)

    @staticmethod
    def _backward(layers, y1, y2, grad_y1, grad_y2):
        for f, g in reversed(layers):
            # y2 = x2 + g(y1): rebuild x2, and send grad_y2 through g (to its parameters and to y1)
            with torch.enable_grad():
                y1 = y1.detach().requires_grad_(True)
                g_y1 = g(y1)
                torch.autograd.backward(g_y1, grad_y2)
            with torch.no_grad():
                x2 = y2 - g_y1
                grad_y1 = grad_y1 + y1.grad  # the total gradient of y1, hence of x1
            # y1 = x1 + f(x2): rebuild x1, and send that gradient through f (to its parameters and to x2)
            with torch.enable_grad():
                x2 = x2.detach().requires_grad_(True)
                f_x2 = f(x2)
                torch.autograd.backward(f_x2, grad_y1)
            with torch.no_grad():
                x1 = y1 - f_x2
                grad_y2 = grad_y2 + x2.grad
            y1, y2 = x1.detach(), x2.detach()
            del g_y1, f_x2
        return grad_y1, grad_y2, None
