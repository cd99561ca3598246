"""Robust gradient aggregation: 3 honest peers and one sending its gradients x -1000, plain mean vs CenteredClip.

The figure is the honest peers' loss at the end over their loss at the start with
``optimizer.aggregation="centered_clip"``; the plain mean's and a swarm without an attacker are in the details.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from benchmarks import common

TITLE = "Robust aggregation: honest peers' loss beside a peer sending its gradients x -1000"
HOW = """
Four peers of the `tiny` preset, each its own process on 127.0.0.1 (`collab-kit join --events`, synthetic shards
of 512 samples, 1 torch thread each), train together for 10 global epochs (4 in `--quick`) of 1024 samples,
matchmaking 3 s, gradients of tensors of 1024 values or more in 8 bits, state averaging off (this is about the
gradients). One peer is `tests/helpers/byzantine_peer.py`: `collab-kit join` whose averager multiplies the gradients it
sends by -1000 (x 1000 would not hurt: LAMB and gradient clipping ignore the scale, the swarm would only train on
that peer's batch); it reduces its own span honestly. The figure is the mean loss of the honest peers' last 3
epochs over that of their first 3, with `--set optimizer.aggregation=centered_clip` (default `clip_tau=0.5`,
`clip_iterations=30`); target below 0.995 (the loss falls). The details give the same ratio with the plain mean
(`aggregation=mean`) and, in a full run, with CenteredClip and the fourth peer honest (x 1).
"""


def _byzantine_module():
    tests = os.path.join(common.REPO_ROOT, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import byzantine_peer

    return byzantine_peer


def run(quick: bool = False) -> list[dict]:
    from collab_kit.config import get_preset
    from collab_kit.data.synthetic import make_synthetic_shards

    byzantine = _byzantine_module()
    epochs = 4 if quick else 10
    config = get_preset("tiny")
    runs = [("centered_clip", -1000.0), ("mean", -1000.0)] + ([] if quick else [("centered_clip", 1.0)])
    ratios, finals, seconds = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="collab_kit_bench_robust_") as folder:
        shards = os.path.join(folder, "shards")
        make_synthetic_shards(
            shards,
            num_samples=512,
            image_side=config.model.image_side,
            codebook_size=config.model.codebook_size,
            num_shards=2,
        )
        for aggregation, scale in runs:
            started = time.perf_counter()
            run_id = f"bench_robust_{aggregation}_{'attack' if scale != 1 else 'honest'}"
            epochs_by_peer = byzantine.run_poisoned_swarm(aggregation, scale, epochs, shards, folder, run_id)
            key = (aggregation, scale)
            seconds[key] = time.perf_counter() - started
            ratios[key] = byzantine.loss_ratio(epochs_by_peer, window=1 if quick else 3)
            finals[key] = (epochs_by_peer[0][0][1], sum(e[-1][1] for e in epochs_by_peer) / len(epochs_by_peer))
            print(
                f"  {aggregation} x {scale:g}: honest loss last/first {ratios[key]:.4f} "
                f"({finals[key][0]:.3f} -> {finals[key][1]:.3f}, {seconds[key]:.0f} s)",
                flush=True,
            )

    def describe(key):
        return f"{ratios[key]:.4f} ({finals[key][0]:.3f} -> {finals[key][1]:.3f}, {seconds[key]:.0f} s)"

    robust = ratios[("centered_clip", -1000.0)]
    details = (
        f"{epochs} epochs, honest peers' loss last / first: CenteredClip {describe(('centered_clip', -1000.0))}; "
        f"plain mean {describe(('mean', -1000.0))}"
    )
    if ("centered_clip", 1.0) in ratios:
        details += f"; CenteredClip, no attacker {describe(('centered_clip', 1.0))}"
    return [
        common.make_row(
            __spec__.name,
            "honest loss last / first, 1 of 4 peers sending gradients x -1000, CenteredClip",
            robust,
            "< 0.995",
            f"{robust:.4f}",
            details + ".",
            note=f"plain mean: {ratios[('mean', -1000.0)]:.4f}",
        )
    ]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
