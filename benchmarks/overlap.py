"""The local-update mode with its new settings on: overlapped rounds, 4-bit pseudo-gradients and fragments in the toy
demo.

Figure: the toy demo's colour match in the local-update mode (H = 10) with ``optimizer.overlap_rounds=true``,
``optimizer.pseudo_gradient_bits=4`` and ``optimizer.fragments=2`` (benchmarks.local_updates measures it without
them).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time

from benchmarks import common, local_updates

NEW_SETTINGS = ("optimizer.overlap_rounds=true", "optimizer.pseudo_gradient_bits=4", "optimizer.fragments=2")
FRAGMENTS = 2

TITLE = "The toy demo in the local-update mode with overlapped rounds, 4-bit pseudo-gradients and fragments"
HOW = f"""
`collab_kit.demo.run_demo` as `make demo` runs it (the first peer and 2 volunteers on 127.0.0.1, the `toy` preset,
2048 pictures) in the local-update mode, `optimizer.local_steps={local_updates.TOY_LOCAL_STEPS}` (the synchronous
demo's {local_updates.TOY_BATCHES} global batches and schedule), with {", ".join(f"`{s}`" for s in NEW_SETTINGS)}:
each volunteer's inner steps go on while its round averages, pseudo-gradients travel in 4 bits with error feedback,
and each round averages one of {FRAGMENTS} fragments ({FRAGMENTS} x {
    local_updates.TOY_BATCHES // local_updates.TOY_LOCAL_STEPS
} epochs of {local_updates.TOY_LOCAL_STEPS // FRAGMENTS} global batches). The figure:
`color_match` of CLIP's best 4 of 32 pictures for each of the 8 prompts (chance 0.125), target >= 0.6
(`benchmarks.local_updates` gives the same run without these settings). `--quick`: 12 global batches, H = 4.
"""


def run(quick: bool = False) -> list[dict]:
    from collab_kit.demo import run_demo

    local_steps = 4 if quick else local_updates.TOY_LOCAL_STEPS
    batches = 12 if quick else local_updates.TOY_BATCHES
    epochs = batches // local_steps * FRAGMENTS
    folder = tempfile.mkdtemp(prefix="collab_kit_bench_overlap_")
    try:
        started = time.perf_counter()
        result = run_demo(
            num_volunteers=2,
            epochs=epochs,
            preset="toy",
            workdir=os.path.join(folder, "demo"),
            output_dir=None,
            overrides=[
                f"optimizer.local_steps={local_steps}",
                f"optimizer.total_steps={batches}",
                "optimizer.learning_rate=0.03",
                *NEW_SETTINGS,
            ],
            draws_per_prompt=8 if quick else 32,
        )
        print(
            f"  toy, local updates, overlapped, 4-bit, {FRAGMENTS} fragments: {result.summary_line()} "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    except BaseException:
        print(f"  the logs are kept in {folder}", flush=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    details = (
        f"colour match {result.color_match:.3f}, shape {result.shape_match:.3f}, place {result.place_match:.3f}, "
        f"loss {result.loss_first:.3f} -> {result.loss_last:.3f}, "
        f"{result.averaged_rounds} rounds averaged, {result.seconds:.0f} s."
    )
    name = (
        f"toy demo, local updates (H = {local_steps}) with overlapped rounds and 4-bit pseudo-gradients in "
        f"{FRAGMENTS} fragments: colour match of CLIP's best 4"
    )
    return [common.make_row(__spec__.name, name, result.color_match, ">= 0.6", f"{result.color_match:.3f}", details)]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
