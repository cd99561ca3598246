"""Activation memory of a training step: reversible layers / standard residual layers, at depth 16 (target <= 0.25).

The activations are what the forward pass leaves for backward: every tensor autograd saves, counted
once per storage, parameters excluded. Reversible layers save only the last layer's two streams and
rebuild the rest during backward; standard layers save every layer's intermediate results.
"""

from __future__ import annotations

import sys
import time

import torch

from benchmarks import common

TITLE = "Activation memory: reversible / standard layers"
HOW = """
The `small` preset's layer width (hidden 256, 4 heads, GEGLU 1024, 16 caption tokens + 8 x 8 image codes)
at depth 16 (row, column, row, row repeated, conv last; shared blocks), seed 0, one batch of 16 synthetic
samples. Two models with the same weights, `model.reversible=True` and `False`, each run the forward
pass and the loss inside `torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd
keeps for backward; the figure is the ratio of their bytes (each storage counted once, parameters
excluded). This is the memory that grows with depth in training; it does not include the weights, the
gradients or the short-lived tensors of one layer being recomputed in backward. The details give the
same count at depths 4, 8, 16 and 32 (reversible stays flat), the time of a forward + backward step
(reversible layers compute each layer's forward once more in backward), and that both give the same
gradients.
"""


def activation_bytes(model, batch) -> int:
    """Bytes of the distinct non-parameter storages autograd saves during the forward pass and the loss."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storages:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def step_seconds(model, batch, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(**batch).loss.backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return min(times)


def build(depth: int, reversible: bool):
    from collab_kit.config import get_preset
    from collab_kit.model.transformer import TextToImageTransformer

    config = get_preset("small", model=dict(num_layers=depth, reversible=reversible))
    torch.manual_seed(0)
    return TextToImageTransformer(config.model).train(), config


def measure(depths=(4, 8, 16, 32), repeats: int = 3) -> dict:
    _, config = build(16, True)
    batch = common.synthetic_batches(config, 16, count=1)[0]
    memory = {
        (depth, reversible): activation_bytes(build(depth, reversible)[0], batch)
        for depth in depths
        for reversible in (True, False)
    }
    reversible, standard = build(16, True)[0], build(16, False)[0]
    seconds = {
        name: step_seconds(model, batch, repeats)
        for name, model in (("reversible", reversible), ("standard", standard))
    }
    for model in (reversible, standard):
        model(**batch).loss.backward()
    worst = max(
        (a.grad - b.grad).abs().max().item() / max(b.grad.abs().max().item(), 1e-30)
        for a, b in zip(reversible.parameters(), standard.parameters())
    )
    return dict(memory=memory, seconds=seconds, worst_gradient_difference=worst)


def run(quick: bool = False) -> list[dict]:
    result = measure(depths=(4, 16) if quick else (4, 8, 16, 32), repeats=1 if quick else 3)
    memory = result["memory"]
    ratio = memory[16, True] / memory[16, False]
    per_depth = "; ".join(
        f"depth {d}: {common.fmt_bytes(memory[d, True])} vs {common.fmt_bytes(memory[d, False])}"
        for d in sorted({d for d, _ in memory})
    )
    seconds = result["seconds"]
    print(f"  {per_depth}", flush=True)
    details = (
        f"Saved for backward (reversible vs standard), batch 16: {per_depth}. A forward + backward step at "
        f"depth 16 takes {seconds['reversible'] * 1e3:.0f} ms reversible vs {seconds['standard'] * 1e3:.0f} ms "
        f"standard ({seconds['reversible'] / seconds['standard']:.2f}x, the price of recomputing); the "
        f"gradients differ by at most {result['worst_gradient_difference']:.1e} of the largest entry."
    )
    return [
        common.make_row(
            __spec__.name,
            "activation memory, reversible / standard (depth 16, small width)",
            ratio,
            "<= 0.25",
            f"{ratio:.3f}",
            details,
        )
    ]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
