"""Optimizer state bytes per parameter: the kit's 8-bit LAMB over bitsandbytes' 32-bit LAMB (target <= 0.27).

Both optimizers take one step on the same real gradients of the ``small`` preset; the figure is the
ratio of the bytes of every tensor they keep in ``optimizer.state``.
"""

from __future__ import annotations

import copy
import sys

import torch

from benchmarks import common
from collab_kit.memory.measured import optimizer_state_bytes

TITLE = "Optimizer state: 8-bit LAMB / 32-bit LAMB"
HOW = """
The `small` preset's model (seed 0) computes real gradients on one batch of 16 synthetic samples.
Two copies of it, with the same gradients, take one step each: one with the kit's optimizer
(`collab_kit.swarm.lamb.make_lamb8bit(parameter_groups(model, weight_decay), config.optimizer)`), one with
bitsandbytes' 32-bit LAMB (`bnb.optim.LAMB(..., optim_bits=32)`) with the same learning rate, betas,
eps, weight decay and parameter groups. The figure is the ratio of the bytes of all tensors in
`optimizer.state` (moments, quantization maps, block scales, norms; a tensor shared by several
parameters, such as bitsandbytes' quantization map, counted once), also shown per parameter.
Tensors smaller than `min_8bit_size` (4096 elements: biases, norms) keep 32-bit statistics in both.
The kit's `collab_kit.swarm.lamb.LAMB8bit` keeps bitsandbytes' blockwise 8-bit Adam statistics and applies
LAMB's trust ratio itself (bitsandbytes 0.50's own `LAMB8bit` does not in its 8-bit update); the
trust ratio needs no stored state, so this figure is the statistics' memory.
"""


def measure(preset: str = "small", batch_size: int = 16) -> dict[str, float]:
    import bitsandbytes as bnb

    from collab_kit.config import get_preset
    from collab_kit.model.transformer import TextToImageTransformer, count_parameters
    from collab_kit.swarm.lamb import make_lamb8bit, parameter_groups

    config = get_preset(preset)
    opt_config = config.optimizer
    batch = common.synthetic_batches(config, batch_size, count=1)[0]
    torch.manual_seed(0)
    model = TextToImageTransformer(config.model)
    model(**batch).loss.backward()

    def one_step(make_optimizer) -> int:
        replica = copy.deepcopy(model)  # the same parameters and gradients for both optimizers
        for source, param in zip(model.parameters(), replica.parameters()):
            param.grad = source.grad.clone()  # deepcopy leaves .grad out
        optimizer = make_optimizer(parameter_groups(replica, opt_config.weight_decay))
        optimizer.step()
        return optimizer_state_bytes(optimizer)

    eight_bit = one_step(lambda groups: make_lamb8bit(groups, opt_config))
    fp32 = one_step(
        lambda groups: bnb.optim.LAMB(
            groups,
            lr=opt_config.learning_rate,
            betas=opt_config.betas,
            eps=opt_config.eps,
            weight_decay=opt_config.weight_decay,
            optim_bits=32,
        )
    )
    params = count_parameters(model)
    if not eight_bit or not fp32:
        raise RuntimeError(f"an optimizer kept no state after its step (8-bit: {eight_bit} B, 32-bit: {fp32} B)")
    return dict(eight_bit=eight_bit, fp32=fp32, params=params, ratio=eight_bit / fp32)


def run(quick: bool = False) -> list[dict]:
    result = measure("small")
    per_param = {key: result[key] / result["params"] for key in ("eight_bit", "fp32")}
    print(f"  8-bit {per_param['eight_bit']:.3f} B/param, 32-bit {per_param['fp32']:.3f} B/param", flush=True)
    details = (
        f"{per_param['eight_bit']:.3f} bytes per parameter ({common.fmt_bytes(result['eight_bit'])}) vs "
        f"{per_param['fp32']:.3f} ({common.fmt_bytes(result['fp32'])}) for {result['params'] / 1e6:.2f} M "
        f"parameters of the small preset."
    )
    return [
        common.make_row(
            __spec__.name,
            "optimizer state bytes/param, 8-bit LAMB / 32-bit LAMB (small preset)",
            result["ratio"],
            "<= 0.27",
            f"{result['ratio']:.3f}",
            details,
        )
    ]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
