"""The local-update mode with its new settings on: overlapped rounds and 4-bit pseudo-gradients in the toy demo.

Figure: the toy demo's colour match in the local-update mode (H = 10) with ``optimizer.overlap_rounds=true`` and
``optimizer.pseudo_gradient_bits=4`` (benchmarks.local_updates measures it without them).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import List

from benchmarks import common, local_updates

NEW_SETTINGS = ("optimizer.overlap_rounds=true", "optimizer.pseudo_gradient_bits=4")

TITLE = "The toy demo in the local-update mode with overlapped rounds and 4-bit pseudo-gradients"
HOW = f"""
`collab_kit.demo.run_demo` as `make demo` runs it (the first peer and 2 volunteers on 127.0.0.1, the `toy` preset,
4096 pictures) in the local-update mode, `optimizer.local_steps={local_updates.TOY_LOCAL_STEPS}` (6 rounds, the demo's
60 global batches), with {' and '.join(f'`{s}`' for s in NEW_SETTINGS)}: each volunteer's inner steps go on while
its round averages, and pseudo-gradients travel in 4 bits with error feedback. The figure: `color_match` of CLIP's best
4 of 32 pictures for each of the 8 prompts (chance 0.125), target >= 0.6 (`benchmarks.local_updates` gives the same
run without these settings). `--quick`: 12 global batches, H = 4.
"""


def run(quick: bool = False) -> List[dict]:
    from collab_kit.demo import run_demo

    local_steps = 4 if quick else local_updates.TOY_LOCAL_STEPS
    rounds = (12 if quick else 60) // local_steps
    folder = tempfile.mkdtemp(prefix="collab_kit_bench_overlap_")
    try:
        started = time.perf_counter()
        result = run_demo(num_volunteers=2, epochs=rounds, preset="toy", workdir=os.path.join(folder, "demo"),
                          output_dir=None, overrides=[f"optimizer.local_steps={local_steps}", *NEW_SETTINGS],
                          draws_per_prompt=8 if quick else 32)
        print(f"  toy, local updates, overlapped, 4-bit: {result.summary_line()} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    except BaseException:
        print(f"  the logs are kept in {folder}", flush=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    details = (f"colour match {result.color_match:.3f}, loss {result.loss_first:.3f} -> {result.loss_last:.3f}, "
               f"{result.averaged_rounds} rounds averaged, {result.seconds:.0f} s.")
    return [common.make_row(__spec__.name, f"toy demo, local updates (H = {local_steps}) with overlapped rounds and "
                            f"4-bit pseudo-gradients: colour match of CLIP's best 4", result.color_match, ">= 0.6",
                            f"{result.color_match:.3f}", details)]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
