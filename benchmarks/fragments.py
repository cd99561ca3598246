"""Fragments in the network lab: the peak rate of a volunteer's link with F = 4 fragments against F = 1.

Figure: the highest 1 s mean of the interface counters of two volunteers' links (behind NAT, the monitor's anchor on a
public host reducing every round), with ``optimizer.fragments=4`` over the same run without fragments.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from benchmarks import common, local_updates, swarm_scaling

LINK_MBIT = 100.0  # each volunteer's link, each way: a round of the toy model takes well under a second on it
LOCAL_STEPS = 16
FRAGMENTS = 4
ROUNDS = 3  # rounds of H global batches: F = 1 has ROUNDS epochs, F = 4 has 4 x ROUNDS
SETTINGS = ("optimizer.average_state_every=100000",)  # no state averaging: the rounds' bytes alone
SAMPLE_PERIOD = 0.1  # seconds between two readings of the counters
WINDOW = 1.0  # seconds of the mean whose highest value is the peak

TITLE = "Fragments: the peak rate of a volunteer's link, F = 4 against F = 1 (network lab)"
HOW = f"""
`tests/helpers/netlab.py`: `collab-kit monitor --preset toy` on a public host (its anchor reduces every round) and 2
volunteers (`collab-kit join --preset toy`, 1 torch thread each, the toy world's dataset), each behind its own NAT
router with its link capped at {LINK_MBIT:g} Mbit/s each way, in the local-update mode with H = {LOCAL_STEPS}
(`optimizer.local_steps={LOCAL_STEPS}`, 8-bit pseudo-gradients, {", ".join(f"`{s}`" for s in SETTINGS)}): once with
F = 1 ({ROUNDS} rounds) and once with `optimizer.fragments={FRAGMENTS}` ({FRAGMENTS * ROUNDS} epochs of
{LOCAL_STEPS // FRAGMENTS} global batches, the same {ROUNDS * LOCAL_STEPS} global batches and the same bytes in all).
Each volunteer's link counters (bytes sent and received, `Host.link_bytes`) are read every {SAMPLE_PERIOD:g} s from its
first epoch's end (after start-up and any state download) to its last; the peak is the highest mean rate over
{WINDOW:g} s, of either direction, the larger of the two volunteers'. The figure: peak with F = {FRAGMENTS} / peak with
F = 1, target <= 0.4 (Streaming DiLoCo: about F-fold lower peak bandwidth). On this link a whole round's pseudo-gradient
(about 4 MiB of the toy model's 8-bit values each way) passes in about a third of a second, so its bytes make its
second's peak; on a link too thin for a fragment to pass within a second, every round runs at the link's rate and the
peak is the link's: there fragments spread the load in time rather than lower the rate. `--quick`: H = 8, 2 rounds.
"""


class LinkSampler(threading.Thread):
    """Reads hosts' link counters every ``SAMPLE_PERIOD`` seconds while ``recording`` is set: (time, sent, received)
    per host."""

    def __init__(self, hosts: Sequence):
        super().__init__(daemon=True)
        self.hosts, self.samples = list(hosts), [[] for _ in hosts]
        self.recording, self.stopped = threading.Event(), threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(SAMPLE_PERIOD):
            if self.recording.is_set():
                for host, samples in zip(self.hosts, self.samples):
                    link = host.link_bytes()
                    samples.append((time.monotonic(), link.sent, link.received))


def peak_rate(samples: Sequence[tuple[float, int, int]], window: float = WINDOW) -> float:
    """The highest mean rate (bytes/s) over ``window`` seconds of either direction: for each sample, the rate to the
    first sample at least ``window`` later."""
    best, later = 0.0, 0
    for start in range(len(samples)):
        later = max(later, start + 1)
        while later < len(samples) and samples[later][0] - samples[start][0] < window:
            later += 1
        if later == len(samples):
            break
        seconds = samples[later][0] - samples[start][0]
        for direction in (1, 2):
            best = max(best, (samples[later][direction] - samples[start][direction]) / seconds)
    return best


def _lab_run(fragments: int, local_steps: int, rounds: int, shards: str, log_dir: str) -> dict[str, object]:
    from tests.helpers.netlab import NetworkLab

    run_id = f"bench_fragments_{fragments}_{os.getpid()}"
    epochs = rounds * fragments
    settings = [f"optimizer.local_steps={local_steps}", f"optimizer.fragments={fragments}", *SETTINGS]
    with NetworkLab() as lab:
        monitor, homes, volunteers = local_updates.start_toy_swarm(
            lab, run_id, settings, 2, LINK_MBIT, epochs, shards, log_dir
        )
        sampler = LinkSampler(homes)
        sampler.start()
        try:
            for volunteer in volunteers:
                volunteer.wait_for(lambda e: e["type"] == "epoch", timeout=300, what="its first epoch")
            sampler.recording.set()
            last = [
                volunteer.wait_for(
                    lambda e: e["type"] == "epoch" and e["epoch"] >= epochs - 1,
                    timeout=120 + 60 * epochs,
                    what="its last epoch",
                )
                for volunteer in volunteers
            ]
            sampler.recording.clear()
            for volunteer in volunteers:
                volunteer.wait_for(lambda e: e["type"] == "done", timeout=120, what="the end")
        finally:
            sampler.stopped.set()
            swarm_scaling.stop_peers(volunteers + [monitor])
    epoch_events = [[e for e in volunteer.events if e["type"] == "epoch"] for volunteer in volunteers]
    peaks = [peak_rate(samples) for samples in sampler.samples]
    moved = [
        (samples[-1][1] - samples[0][1] + samples[-1][2] - samples[0][2]) if samples else 0
        for samples in sampler.samples
    ]
    seconds = [samples[-1][0] - samples[0][0] if samples else 0.0 for samples in sampler.samples]
    averaged = [sum(e["averaged"] for e in events) for events in epoch_events]
    print(
        f"  F = {fragments}: peaks {[f'{p / 2**20:.2f}' for p in peaks]} MiB/s, averaged epochs {averaged} of "
        f"{[len(events) for events in epoch_events]}, last epochs {[e['epoch'] for e in last]}",
        flush=True,
    )
    return dict(
        peaks=peaks, moved=moved, seconds=seconds, averaged=averaged, epochs=[len(events) for events in epoch_events]
    )


def run(quick: bool = False) -> list[dict]:
    from collab_kit.toy.dataset import prepare_toy_dataset

    common.require_network_lab()
    local_steps, rounds = (8, 2) if quick else (LOCAL_STEPS, ROUNDS)
    shards = prepare_toy_dataset(4096, progress=False)
    folder = tempfile.mkdtemp(prefix="collab_kit_bench_fragments_")
    try:
        whole = _lab_run(1, local_steps, rounds, shards, folder)
        fragmented = _lab_run(FRAGMENTS, local_steps, rounds, shards, folder)
    except BaseException:
        print(f"  the logs are kept in {folder}", flush=True)
        raise
    shutil.rmtree(folder, ignore_errors=True)
    ratio = max(fragmented["peaks"]) / max(whole["peaks"])
    mib = 2**20

    def describe(result: dict) -> str:
        return (
            f"peak {max(result['peaks']) / mib:.2f} MiB/s (volunteers: "
            f"{', '.join(f'{p / mib:.2f}' for p in result['peaks'])}), "
            f"{', '.join(f'{m / mib:.1f}' for m in result['moved'])} MiB over "
            f"{', '.join(f'{s:.0f}' for s in result['seconds'])} s measured, averaged epochs "
            f"{', '.join(f'{a} of {n}' for a, n in zip(result['averaged'], result['epochs']))}"
        )

    details = f"F = 1 (H = {local_steps}): {describe(whole)}; F = {FRAGMENTS}: {describe(fragmented)}."
    return [
        common.make_row(
            __spec__.name,
            f"network lab, 2 NAT volunteers on {LINK_MBIT:g} Mbit/s links, H = "
            f"{local_steps}: peak link rate (highest {WINDOW:g} s mean), F = {FRAGMENTS} fragments / "
            f"F = 1",
            ratio,
            "<= 0.4",
            f"{ratio:.2f}",
            details,
            note=f"{max(fragmented['peaks']) / mib:.2f} vs {max(whole['peaks']) / mib:.2f} MiB/s",
        )
    ]


if __name__ == "__main__":
    common.main(sys.modules[__name__])
