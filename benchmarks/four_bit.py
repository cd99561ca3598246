"""4-bit pseudo-gradients with error feedback beside 8-bit ones in the local-update mode: bytes and loss.

Figures: the bytes of one round's pseudo-gradients of the small preset, 4-bit / fp32 and 8-bit / fp32, serialized as
hivemind's all-reduce sends them; and the small preset over 1000 global batches in the local-update mode (H = 100),
once with 8-bit and once with 4-bit pseudo-gradients: the loss at equal samples, 4-bit / 8-bit.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from benchmarks import common, gradient_compression, local_updates

TITLE = "4-bit pseudo-gradients with error feedback beside 8-bit ones (local-update mode, small preset)"
HOW = f"""
Bytes: the small preset model's gradients on one synthetic batch (`benchmarks.gradient_compression.real_gradients`,
the pseudo-gradient's shapes; 4 bits round each block to its own scale whatever the values) serialized by hivemind's
`TensorPartContainer` with the kit's compression (`gradient_compression(2^16, bits)`: 4 or 8 bits for tensors of 2^16
elements or more, fp16 below) and with none; each part's protobuf size, summed. A 4-bit sender gets the average back
in 4 bits too (`collab_kit.swarm.runners.SharedFourBitAverageMixin`), so a round's bytes both ways keep this ratio.
Target 4-bit / fp32 <= 0.14.

Loss: `run_demo` with `--preset small` and 2 volunteers in the local-update mode, H = {local_updates.SMALL_LOCAL_STEPS},
{local_updates.SMALL_ROUNDS} rounds (1000 global batches), with `benchmarks.local_updates`' settings
({", ".join(f"`{s}`" for s in local_updates.SMALL_SETTINGS)}), once with `optimizer.pseudo_gradient_bits=8` and once
with `=4` (error feedback on). Loss at equal samples: the mean loss of the volunteers' local steps in the last round,
4-bit / 8-bit: target <= 1.02. `--quick`: H = 4, 2 rounds.
"""


def _small_local_runs(quick: bool, folder: str) -> dict:
    from collab_kit.demo import run_demo

    local_steps, rounds = (4, 2) if quick else (local_updates.SMALL_LOCAL_STEPS, local_updates.SMALL_ROUNDS)
    settings = [
        setting if "total_steps" not in setting else f"optimizer.total_steps={local_steps * rounds}"
        for setting in local_updates.SMALL_SETTINGS
    ] + [f"optimizer.local_steps={local_steps}"]
    runs = {"local_steps": local_steps}
    for bits in (8, 4):
        started = time.perf_counter()
        runs[bits] = run_demo(
            num_volunteers=2,
            epochs=rounds,
            preset="small",
            workdir=os.path.join(folder, str(bits)),
            output_dir=None,
            overrides=settings + [f"optimizer.pseudo_gradient_bits={bits}"],
            timeout=600 + 4.0 * local_steps * rounds,
        )
        print(
            f"  small, local updates, {bits}-bit: {runs[bits].summary_line()} ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    return runs


def run(quick: bool = False) -> list[dict]:
    names, gradients = gradient_compression.real_gradients("small")
    sizes = {bits: gradient_compression.round_bytes(gradients, 2**16, names=names, bits=bits) for bits in (8, 4)}
    folder = tempfile.mkdtemp(prefix="collab_kit_bench_four_bit_")
    try:
        runs = _small_local_runs(quick, folder)
    except BaseException:
        print(f"  the logs are kept in {folder}", flush=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    mib = 2**20
    four, eight = sizes[4], sizes[8]
    bytes_details = (
        f"one round of the small preset's {four['elements'] / 1e6:.2f} M values: fp32 "
        f"{four['fp32'] / mib:.2f} MiB, 8-bit {eight['compressed'] / mib:.2f} MiB (ratio "
        f"{eight['ratio']:.3f}), 4-bit {four['compressed'] / mib:.2f} MiB; {four['eight_bit_share']:.1%} of "
        f"the values in the large tensors; worst relative error of a tensor decoded: 4-bit "
        f"{four['worst_error']:.3f} ({four['worst_name']}), 8-bit {eight['worst_error']:.3f}"
    )
    h, with_8, with_4 = runs["local_steps"], runs[8], runs[4]
    last_8, last_4 = local_updates._window_loss(with_8, 1), local_updates._window_loss(with_4, 1)
    loss_ratio = last_4 / last_8

    def describe(result) -> str:
        return (
            f"loss {result.loss_first:.3f} -> {local_updates._window_loss(result, 1):.3f} in the last round, "
            f"{result.averaged_rounds} rounds averaged, {local_updates._rounds_bytes(result) / mib:.2f} MiB sent "
            f"per volunteer in rounds, {result.seconds:.0f} s; each round's loss: "
            + ", ".join(f"{result.epoch_losses[epoch]:.3f}" for epoch in sorted(result.epoch_losses))
        )

    loss_details = f"8-bit: {describe(with_8)}; 4-bit with error feedback: {describe(with_4)}."
    sent_ratio = local_updates._rounds_bytes(with_4) / max(1.0, local_updates._rounds_bytes(with_8))
    return [
        common.make_row(
            __spec__.name,
            "small preset: bytes of a round's pseudo-gradients, 4-bit / fp32",
            four["ratio"],
            "<= 0.14",
            f"{four['ratio']:.3f}",
            bytes_details,
            note=f"8-bit / fp32: {eight['ratio']:.3f}",
        ),
        common.make_row(
            __spec__.name,
            f"small preset, {with_8.epochs * h} global batches, local updates (H = {h}): "
            f"loss at equal samples, 4-bit pseudo-gradients / 8-bit",
            loss_ratio,
            "<= 1.02",
            f"{loss_ratio:.3f}",
            loss_details,
            note=f"{last_4:.3f} vs {last_8:.3f}; bytes sent 4-bit / 8-bit {sent_ratio:.2f}",
        ),
    ]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
