"""Several real peers, each its own process on 127.0.0.1, training the tiny preset together."""

import time

import pytest
import torch

from collab_kit.roles.processes import group_is_empty

pytestmark = pytest.mark.slow

# The tiny model steps in milliseconds; a larger target batch makes each global epoch last long
# enough (about a second per peer) for the peers' progress reports to meet in the DHT.
TARGET = "optimizer.target_batch_size=4096"
# the tiny model has no tensor of 2**16 elements; a lower threshold sends most gradients in 8 bits
EIGHT_BIT = "optimizer.compression_threshold=1024"


RUN_SETTINGS = ("--set", TARGET, "--set", EIGHT_BIT)  # the monitor's too: a volunteer checks its own against them


def volunteer_args(run_id, addresses, shards, *extra):
    return [
        "join",
        "--preset",
        "tiny",
        "--run-id",
        run_id,
        "--host",
        "127.0.0.1",
        "--initial-peers",
        *addresses,
        "--data",
        shards,
        "--threads",
        "1",
        "--events",
        "--no-progress",
        *RUN_SETTINGS,
        *extra,
    ]


def test_two_peers_average_gradients_and_end_with_the_same_parameters(first_peer, start_peer, tiny_shards, tmp_path):
    run_id = "test_two_peers"
    exact = ("--set", "optimizer.state_compression='none'")  # exact (fp32) state averaging: peers end bit-for-bit close
    _, addresses = first_peer(run_id, *RUN_SETTINGS, *exact)
    volunteers = [
        start_peer(
            f"volunteer-{i}",
            *volunteer_args(
                run_id,
                addresses,
                tiny_shards,
                "--max-epochs",
                "3",
                "--wait-for-peers",
                "2",
                *exact,
                "--save-params",
                str(tmp_path / f"params-{i}.pt"),
            ),
        )
        for i in range(2)
    ]
    for volunteer in volunteers:
        assert volunteer.wait_exit(timeout=180) == 0, volunteer.log_tail()

    initial = None
    for volunteer in volunteers:
        done = volunteer.wait_for(lambda e: e["type"] == "done", timeout=1, what="done")
        epochs = [e for e in volunteer.events if e["type"] == "epoch"]
        assert done["final_epoch"] == 3
        assert [e["epoch"] for e in epochs] == [0, 1, 2]
        # every global step of this peer was taken with gradients averaged across both peers
        assert done["averaged_rounds"] == 3
        assert all(e["averaged"] and e["group_size"] == 2 for e in epochs), epochs

    first, second = (torch.load(tmp_path / f"params-{i}.pt") for i in range(2))
    assert first.keys() == second.keys()
    from collab_kit.config import get_preset
    from collab_kit.model.transformer import TextToImageTransformer, model_seed

    torch.manual_seed(model_seed(run_id))
    initial = dict(TextToImageTransformer(get_preset("tiny").model).named_parameters())
    moved = max((first[name] - initial[name]).abs().max().item() for name in first)
    differ = max((first[name] - second[name]).abs().max().item() for name in first)
    assert moved > 1e-3, "training did not change the parameters"
    assert differ < 1e-6, f"peers ended {differ:.2e} apart after moving {moved:.2e}"


def test_late_peer_loads_the_swarm_state_and_continues_at_its_epoch(first_peer, start_peer, tiny_shards):
    run_id = "test_late_peer"
    _, addresses = first_peer(run_id, *RUN_SETTINGS)
    early = [
        start_peer(
            f"early-{i}", *volunteer_args(run_id, addresses, tiny_shards, "--max-epochs", "12", "--wait-for-peers", "2")
        )
        for i in range(2)
    ]
    early[0].wait_for(lambda e: e["type"] == "epoch" and e["epoch"] >= 1, timeout=180, what="epoch 2")
    swarm_epoch_at_join = max(e["epoch"] + 1 for e in early[0].events if e["type"] == "epoch")

    late = start_peer("late", *volunteer_args(run_id, addresses, tiny_shards, "--epochs", "2"))
    assert late.wait_exit(timeout=180) == 0, late.log_tail()
    done = late.wait_for(lambda e: e["type"] == "done", timeout=1, what="done")
    assert done["start_epoch"] >= swarm_epoch_at_join >= 2  # it did not start from scratch at epoch 0
    # --epochs 2: it stops once the swarm is 2 epochs past where it started. Not always after 2 epochs of its own:
    # tiny epochs last a second, and when the swarm moved on by two while this peer took a state, it goes on at the
    # swarm's epoch (a jump of two), as any peer behind does
    assert done["final_epoch"] >= done["start_epoch"] + 2 and done["local_steps"] > 0
    late_events = [e for e in late.events if e["type"] == "epoch"]
    late_epochs = [e["epoch"] for e in late_events]
    # its first step ends the epoch it started at; or, when the swarm ended that epoch while this peer took its state,
    # the swarm's next one, in a round of the others' (it holds their state, so it follows them: see optim.py)
    assert late_epochs and late_epochs == sorted(set(late_epochs)), late_epochs
    assert late_epochs[0] == done["start_epoch"] or (
        late_epochs[0] == done["start_epoch"] + 1 and late_events[0]["averaged"]
    ), (late_events[0], done)
    assert late_epochs[-1] < done["start_epoch"] + 2 <= done["final_epoch"]  # none past the limit
    for peer in early:
        peer.kill()


def test_the_monitor_reads_the_swarms_progress(first_peer, start_peer, tiny_shards):
    from collab_kit.config import SwarmConfig
    from collab_kit.roles.monitor import progress_validators, read_swarm_progress
    from collab_kit.swarm.dht import start_dht

    run_id = "test_monitor"
    _, addresses = first_peer(run_id, *RUN_SETTINGS)
    volunteers = [
        start_peer(
            f"volunteer-{i}",
            *volunteer_args(run_id, addresses, tiny_shards, "--max-epochs", "50", "--wait-for-peers", "2"),
        )
        for i in range(2)
    ]
    volunteers[0].wait_for(lambda e: e["type"] == "epoch" and e["epoch"] >= 1, timeout=180, what="epoch 2")
    watcher = start_dht(
        SwarmConfig(host="127.0.0.1", initial_peers=addresses), record_validators=progress_validators(run_id)
    )
    try:
        progress = read_swarm_progress(watcher, run_id)
    finally:
        watcher.shutdown()
    assert progress.num_peers == 2 and progress.epoch >= 2 and progress.samples_per_second > 0


def test_ctrl_c_leaves_the_swarm_cleanly(first_peer, start_peer, tiny_shards):
    run_id = "test_ctrl_c"
    _, addresses = first_peer(run_id, *RUN_SETTINGS)
    volunteer = start_peer("volunteer", *volunteer_args(run_id, addresses, tiny_shards, "--max-epochs", "1000"))
    volunteer.wait_for(lambda e: e["type"] == "epoch", timeout=120, what="a first epoch")
    volunteer.interrupt()
    assert volunteer.wait_exit(timeout=60) == 130, volunteer.log_tail()
    done = volunteer.wait_for(lambda e: e["type"] == "done", timeout=1, what="done")
    assert done["interrupted"] is True
    # its p2p daemon and averager processes left with it
    deadline = time.monotonic() + 15
    while not group_is_empty(volunteer.process.pid):
        assert time.monotonic() < deadline, "processes of the interrupted peer are still running"
        time.sleep(0.2)
