"""Peers of different precisions train together on 127.0.0.1, as volunteers of different GPUs would: fp32, bf16
autocast and fp16 autocast with loss scaling (torch's CPU autocast and ``GradScaler("cpu")`` stand for the GPU's)."""

import pytest
from nan_peer import start_nan_peer


def join_args(run_id, shards, precision, *extra):
    # a 6 s matchmaking window, not the tiny preset's 2 s: on 2 shared cores a peer's step can lag the others' by more
    # than 2 s, and a late peer rightly misses the group, while this test asks that every round hold all three
    return [
        "join",
        "--preset",
        "tiny",
        "--run-id",
        run_id,
        "--host",
        "127.0.0.1",
        "--data",
        shards,
        "--threads",
        "1",
        "--events",
        "--no-progress",
        "--max-epochs",
        "4",
        "--wait-for-peers",
        "3",
        "--precision",
        precision,
        "--set",
        "optimizer.matchmaking_time=6.0",
        *extra,
    ]


def rounds_of(peers):
    """Each peer's epochs in one line each (epoch, local steps, averaged, group size, problem): what a failed
    assertion needs to tell a peer late to a round from a round that failed for all."""
    return "\n".join(
        f"{name}: "
        + "; ".join(
            f"{e['epoch']} {e['local_steps']} steps {e['averaged']} {e['group_size']} {e['problem']}"
            for e in peer.events
            if e["type"] == "epoch"
        )
        for name, peer in peers.items()
    )


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fp32_bf16_and_fp16_peers_average_every_round_and_an_overflow_is_only_a_skipped_step(
    start_peer, tiny_shards, tmp_path
):
    run_id = "test_precisions"
    first = start_peer("fp32", *join_args(run_id, tiny_shards, "fp32"))
    addresses = first.wait_for(lambda e: e["type"] == "ready", timeout=90, what="its address")["addresses"]
    bf16 = start_peer("bf16", *join_args(run_id, tiny_shards, "bf16", "--initial-peers", *addresses))
    # its second step at epoch 1 overflows: the scaler skips it, nothing is reloaded, nobody is told it trains alone
    fp16 = start_nan_peer(
        "fp16",
        join_args(run_id, tiny_shards, "fp16", "--initial-peers", *addresses),
        str(tmp_path / "fp16.log"),
        at_epoch=1,
        at_step=2,
        what="overflow",
    )
    try:
        peers = {"fp32": first, "bf16": bf16, "fp16": fp16}
        for name, peer in peers.items():
            ready = peer.wait_for(lambda e: e["type"] == "ready", timeout=90, what="its start")
            assert (ready["device"], ready["precision"]) == ("cpu", name), ready
        dones = {
            name: peer.wait_for(lambda e: e["type"] == "done", timeout=300, what="the end of training")
            for name, peer in peers.items()
        }
        for name, peer in peers.items():
            done = dones[name]
            assert done["final_epoch"] >= 4 and done["precision"] == name and not done["interrupted"], done
            epochs = [event for event in peer.events if event["type"] == "epoch"]
            assert epochs and all(e["averaged"] and e["group_size"] == 3 for e in epochs), rounds_of(peers)
            assert not [e for e in peer.events if e["type"] in ("restore", "lone")], (name, peer.events)
            assert done["overflow_steps"] == (1 if name == "fp16" else 0) and done["skipped_steps"] == 0, done
        fault = fp16.wait_for(lambda e: e["type"] == "fault", timeout=1, what="the injected overflow")
        assert fault["what"] == "overflow" and fault["epoch"] >= 1
    finally:
        fp16.kill()
