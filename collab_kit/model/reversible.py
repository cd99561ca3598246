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
that both give the same gradients, under autocast too, and with stochastic layers (dropout): each call's random
state is kept in forward and replayed in backward (tests/model/test_model.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

Layer = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]  # (f, g)


def run_plain(x1: torch.Tensor, x2: torch.Tensor, layers: Sequence[Layer]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both streams through every ``(f, g)`` layer, with ordinary autograd."""
    for f, g in layers:
        x1 = x1 + f(x2)
        x2 = x2 + g(x1)
    return x1, x2


def run_reversible(x1: torch.Tensor, x2: torch.Tensor, layers: Sequence[Layer]) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``run_plain``, keeping no activations for backward.

    The parameters of ``f`` and ``g`` get their gradients during ``loss.backward()`` as usual (they are
    accumulated, so a block used by several layers sums its gradients). ``torch.autograd.grad`` with
    those parameters as inputs is not supported: the function does not list them as its inputs.
    """
    return _ReversibleFunction.apply(x1, x2, tuple(layers))


def _rng_devices(x: torch.Tensor) -> list:
    return [x.device.index if x.device.index is not None else torch.cuda.current_device()] if x.is_cuda else []


def _rng_state(devices: list):
    """The random state a layer's call starts from (the CPU's, and the GPU's it runs on)."""
    return torch.get_rng_state(), [torch.cuda.get_rng_state(device) for device in devices]


@contextlib.contextmanager
def _replayed(state, devices: list):
    """Run with the random state a forward call started from, then go back to the state outside: a stochastic layer
    (dropout) draws in backward what it drew in forward."""
    with torch.random.fork_rng(devices=devices):
        cpu_state, gpu_states = state
        torch.set_rng_state(cpu_state)
        for device, gpu_state in zip(devices, gpu_states):
            torch.cuda.set_rng_state(gpu_state, device)
        yield


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1: torch.Tensor, x2: torch.Tensor, layers: tuple[Layer, ...]):
        # autograd.Function.forward runs without recording a graph: nothing here is kept but each call's random state,
        # which backward replays to rebuild the same activations
        devices = _rng_devices(x1)
        states = []
        y1, y2 = x1, x2
        for f, g in layers:
            f_state = _rng_state(devices)
            y1 = y1 + f(y2)
            g_state = _rng_state(devices)
            y2 = y2 + g(y1)
            states.append((f_state, g_state))
        ctx.layers, ctx.rng_states, ctx.rng_devices = layers, states, devices
        # backward recomputes the layers: under the same autocast as the forward pass, or the rebuilt
        # inputs would not be the ones the forward pass used
        device_type = x1.device.type
        ctx.autocast = dict(
            device_type=device_type,
            enabled=torch.is_autocast_enabled(device_type),
            dtype=torch.get_autocast_dtype(device_type),
        )
        ctx.save_for_backward(y1, y2)
        return y1, y2

    @staticmethod
    def backward(ctx, grad_y1: torch.Tensor, grad_y2: torch.Tensor):
        y1, y2 = ctx.saved_tensors
        grad_y1 = torch.zeros_like(y1) if grad_y1 is None else grad_y1
        grad_y2 = torch.zeros_like(y2) if grad_y2 is None else grad_y2
        with torch.autocast(**ctx.autocast):
            return _ReversibleFunction._backward(ctx.layers, ctx.rng_states, ctx.rng_devices, y1, y2, grad_y1, grad_y2)

    @staticmethod
    def _backward(layers, rng_states, devices, y1, y2, grad_y1, grad_y2):
        for (f, g), (f_state, g_state) in zip(reversed(layers), reversed(rng_states)):
            # y2 = x2 + g(y1): rebuild x2, and send grad_y2 through g (to its parameters and to y1)
            with torch.enable_grad(), _replayed(g_state, devices):
                y1 = y1.detach().requires_grad_(True)
                g_y1 = g(y1)
                torch.autograd.backward(g_y1, grad_y2)
            with torch.no_grad():
                x2 = y2 - g_y1
                grad_y1 = grad_y1 + y1.grad  # the total gradient of y1, hence of x1
            # y1 = x1 + f(x2): rebuild x1, and send that gradient through f (to its parameters and to x2)
            with torch.enable_grad(), _replayed(f_state, devices):
                x2 = x2.detach().requires_grad_(True)
                f_x2 = f(x2)
                torch.autograd.backward(f_x2, grad_y1)
            with torch.no_grad():
                x1 = y1 - f_x2
                grad_y2 = grad_y2 + x2.grad
            y1, y2 = x1.detach(), x2.detach()
            del g_y1, f_x2
        return grad_y1, grad_y2, None
