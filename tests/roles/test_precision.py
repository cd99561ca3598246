"""Peers of different precisions train together on 127.0.0.1, as volunteers of different GPUs would: fp32, bf16
autocast and fp16 autocast with loss scaling (torch's CPU autocast and ``GradScaler("cpu")`` stand for the GPU's)."""
import pytest
from nan_peer import start_nan_peer


def join_args(run_id, shards, precision, *extra):
    return ["join", "--preset", "tiny", "--run-id", run_id, "--host", "127.0.0.1", "--data", shards, "--threads", "1",
            "--events", "--no-progress", "--max-epochs", "4", "--wait-for-peers", "3", "--precision", precision,
            *extra]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fp32_bf16_and_fp16_peers_average_every_round_and_an_overflow_is_only_a_skipped_step(start_peer, tiny_shards,
                                                                                           tmp_path):
    run_id = "test_precisions"
    first = start_peer("fp32", *join_args(run_id, tiny_shards, "fp32"))
    addresses = first.wait_for(lambda e: e["type"] == "ready", timeout=90, what="its address")["addresses"]
    bf16 = start_peer("bf16", *join_args(run_id, tiny_shards, "bf16", "--initial-peers", *addresses))
    # its second step at epoch 1 overflows: the scaler skips it, nothing is reloaded, nobody is told it trains alone
    fp16 = start_nan_peer("fp16", join_args(run_id, tiny_shards, "fp16", "--initial-peers", *addresses),
                          str(tmp_path / "fp16.log"), at_epoch=1, at_step=2, what="overflow")
    try:
        peers = {"fp32": first, "bf16": bf16, "fp16": fp16}
        for name, peer in peers.items():
            ready = peer.wait_for(lambda e: e["type"] == "ready", timeout=90, what="its start")
            assert (ready["device"], ready["precision"]) == ("cpu", name), ready
        for name, peer in peers.items():
            done = peer.wait_for(lambda e: e["type"] == "done", timeout=300, what="the end of training")
            assert done["final_epoch"] >= 4 and done["precision"] == name and not done["interrupted"], done
            epochs = [event for event in peer.events if event["type"] == "epoch"]
            assert epochs and all(e["averaged"] and e["group_size"] == 3 for e in epochs), (name, epochs)
            assert not [e for e in peer.events if e["type"] in ("restore", "lone")], (name, peer.events)
            assert done["overflow_steps"] == (1 if name == "fp16" else 0) and done["skipped_steps"] == 0, done
        fault = fp16.wait_for(lambda e: e["type"] == "fault", timeout=1, what="the injected overflow")
        assert fault["what"] == "overflow" and fault["epoch"] >= 1
    finally:
        fp16.kill()
