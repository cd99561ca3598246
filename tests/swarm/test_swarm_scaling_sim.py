"""The swarm scaling benchmark's simulated peers (benchmarks/swarm_scaling.py): how an epoch's end is read
from the peers' events, and a real 2-peer swarm on 127.0.0.1 where one peer is 8x slower."""

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:  # `pytest` (not `python -m pytest`) does not put the repository on the path
    sys.path.insert(0, REPO_ROOT)

from benchmarks import swarm_scaling  # noqa: E402


def epoch_events(times):
    return [dict(type="epoch", epoch=epoch, time=t, samples=32, group_size=3) for epoch, t in times.items()]


def test_epoch_end_is_the_median_over_peers_and_needs_most_of_them():
    peers = [
        epoch_events({1: 10.0, 2: 20.0, 4: 40.0}),
        epoch_events({1: 10.2, 2: 20.4, 3: 30.0, 4: 40.2}),
        epoch_events({1: 50.0, 3: 31.0}),
    ]  # a straggler: epoch 1 far too late, epochs 2 and 4 skipped
    ends = swarm_scaling.epoch_end_times(peers)
    assert ends[1] == pytest.approx(10.2)  # the straggler's late time does not move the median
    assert ends[2] == pytest.approx(20.2) and ends[3] == pytest.approx(30.5)
    assert ends[4] == pytest.approx(40.1)
    seconds = swarm_scaling.seconds_per_epoch(peers, warmup_epochs=1, measured_epochs=3)
    assert seconds == pytest.approx((40.1 - 10.2) / 3)
    with pytest.raises(ValueError, match="fewer than half"):
        swarm_scaling.seconds_per_epoch(peers, warmup_epochs=1, measured_epochs=4)  # nobody reached epoch 5


def test_simulated_swarm_predictions():
    sim = swarm_scaling.Simulation(target_batch_size=4096, micro_batch=32, compute_seconds=0.25)
    assert sim.peer_rate == 128
    assert sim.compute_time([1, 1]) == pytest.approx(16.0)
    assert sim.compute_time([1] * 6) == pytest.approx(16.0 / 3)
    assert swarm_scaling.parameter_count(64) == sum(p.numel() for p in swarm_scaling.make_model(64).parameters())


@pytest.mark.slow
def test_epoch_does_not_wait_for_a_slow_peer(tmp_path):
    """Two simulated peers, one taking 8x longer per micro-batch: epochs take about what their summed throughput
    needs (144 samples/s, 3.6 s for 512 samples), far from the 16 s the slow peer needs for half of the batch."""
    sim = swarm_scaling.Simulation(
        target_batch_size=512,
        micro_batch=32,
        compute_seconds=0.25,
        matchmaking_time=2.0,
        progress_refresh_period=0.6,
        warmup_epochs=1,
        measured_epochs=2,
        width=64,
    )
    speeds = [1.0, 1.0 / 8]
    epochs_by_peer, left_behind = swarm_scaling.run_swarm(speeds, sim, "test_scaling_uneven", str(tmp_path))
    # each peer's log, for a failure to be read from the report alone (a round that stalls shows there)
    logs = "\n".join(
        f"--- {path.name}:\n" + "".join(path.read_text().splitlines(keepends=True)[-40:])
        for path in sorted(tmp_path.glob("*.log"))
    )
    assert left_behind == [], logs
    seconds = swarm_scaling.seconds_per_epoch(epochs_by_peer, sim.warmup_epochs, sim.measured_epochs)
    waiting_for_slow_peer = sim.target_batch_size / 2 / (sim.peer_rate / 8)
    assert 0.9 * sim.compute_time(speeds) < seconds < waiting_for_slow_peer / 2, (seconds, logs)
    measured = [[e for e in events if e["epoch"] > sim.warmup_epochs] for events in epochs_by_peer]
    assert all(e["group_size"] == 2 for events in measured for e in events)  # gradients averaged by both
    fast, slow = (sum(e["samples"] for e in events) for events in measured)
    assert 0 < slow < fast / 3  # the slow peer contributes what it computed, no more
