"""The local half of the paper's optimizer: 8-bit LAMB, its schedule and parameter groups, and gradient compression.

collab_kit.swarm.optimizer wraps these in hivemind.Optimizer; the monitor builds the same ones to hold the swarm's
state in the same layout.

- 8-bit LAMB (bitsandbytes): about 4x less optimizer memory; the trust ratio makes huge batches trainable.
- Size-adaptive compression: large tensors in 8 bits (or 4, collab_kit.swarm.four_bit), small ones in fp16.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import TYPE_CHECKING

import torch
from hivemind.compression import Float16Compression, SizeAdaptiveCompression, Uniform8BitQuantization

from collab_kit.config import OptimizerConfig
from collab_kit.quiet import import_bitsandbytes
from collab_kit.swarm.four_bit import Blockwise4BitQuantization

if TYPE_CHECKING:
    import bitsandbytes as bnb
else:
    bnb = import_bitsandbytes()  # bitsandbytes, without its warning of 4-bit kernels the kit never uses


class HoldableStepMixin:
    """Put before a torch optimizer: ``hold_next_step()`` makes its next ``step()`` leave the parameters and the
    optimizer's state as they are (the gradients it would apply are not the swarm's: collab_kit.swarm.anchor's round
    that no training peer reached)."""

    _hold_next_step = False

    def hold_next_step(self) -> None:
        self._hold_next_step = True

    def _step_is_held(self) -> bool:
        """Whether this step is the held one (the hold is then used up)."""
        held, self._hold_next_step = self._hold_next_step, False
        return held


class LAMB8bit(HoldableStepMixin, bnb.optim.AdamW8bit):
    """8-bit LAMB: bitsandbytes' blockwise 8-bit Adam statistics, LAMB's layer-wise trust ratio, global clipping.

    Each matrix steps ``lr * ||w|| / ||r||`` times the AdamW direction ``r`` (bitsandbytes' own ``LAMB8bit`` 0.50
    skips that ratio); groups with ``layer_adaptation=False`` take the plain AdamW step. Clipping is here because the
    averaged gradients exist only inside hivemind's step. Shown by tests/swarm/test_optim.py::
    test_lamb8bit_steps_each_matrix_by_lr_times_its_norm_whatever_the_gradient_scale.

    :param params: parameters or parameter groups
    :param max_grad_norm: clip the norm of all gradients together to this value; None disables clipping
    :param kwargs: passed to ``bitsandbytes.optim.AdamW8bit`` (lr, betas, eps, weight_decay, min_8bit_size)
    """

    def __init__(self, params, max_grad_norm: float | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: float | None = None

    @torch.no_grad()
    def step(self, closure=None):
        if self._step_is_held():
            return None
        if self.max_grad_norm is not None:
            grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            self.last_grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm))
        return super().step(closure)

    @torch.no_grad()
    def update_step(self, group, p, gindex, pindex):
        if not group.get("layer_adaptation", True):
            return super().update_step(group, p, gindex, pindex)
        before = p.detach().clone()
        super().update_step(group, p, gindex, pindex)  # p <- p - lr * r, with r = adam direction + wd * p
        update = p.detach() - before
        weight_norm, update_norm = before.norm(), update.norm()
        if weight_norm > 0 and update_norm > 0:
            # the trust ratio: a step of length lr * ||w|| along r
            p.copy_(before.add_(update, alpha=float(group["lr"] * weight_norm / update_norm)))


def linear_warmup_then_decay(step: int, warmup_steps: int, total_steps: int) -> float:
    """Learning-rate multiplier: rises linearly over warm-up, then falls linearly to 0 at total_steps.

    Step 0 already gets a small non-zero rate, so that the first global step does something.
    """
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices and embeddings decay and adapt their step to their norm (LAMB);
    biases and norm weights (1-d tensors) do neither."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 else decay).append(param)
    return [
        dict(params=decay, weight_decay=weight_decay),
        dict(params=no_decay, weight_decay=0.0, layer_adaptation=False),
    ]


def gradient_compression(threshold: int, bits: int = 8) -> SizeAdaptiveCompression:
    """8-bit uniform quantization (or 4-bit blockwise, ``bits`` = 4) for tensors of ``threshold`` elements or more, fp16
    for smaller ones."""
    large = Blockwise4BitQuantization() if bits == 4 else Uniform8BitQuantization()
    return SizeAdaptiveCompression(threshold=threshold, less=Float16Compression(), greater_equal=large)


def make_lamb8bit(params: Iterable, config: OptimizerConfig) -> LAMB8bit:
    """The bare 8-bit LAMB with the paper's hyperparameters (also the baseline of the benchmarks)."""
    return LAMB8bit(
        params,
        max_grad_norm=config.max_grad_norm,
        lr=config.learning_rate,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        min_8bit_size=config.min_8bit_size,
    )


def make_scheduler_factory(config: OptimizerConfig):
    """A factory hivemind calls with the (offloaded) optimizer to build the linear warm-up schedule."""
    schedule = partial(linear_warmup_then_decay, warmup_steps=config.warmup_steps, total_steps=config.total_steps)
    return partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=schedule)
