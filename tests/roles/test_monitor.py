"""The monitor: checkpoints that fall back past a broken one, usernames credited only with proof, W&B's clear
error, state downloads retried until a peer can give one (then pushed to the Hub), and a monitor killed
mid-run and restarted that loses no leaderboard row and goes on with its checkpoints.

The monitor and the volunteers are real ``collab-kit monitor / join --events`` processes on 127.0.0.1; the tests
wait on their events with deadlines and read the SQLite file the monitor writes.
"""

import datetime
import logging
import os
import signal
import socket

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from collab_kit.config import get_preset
from collab_kit.model.checkpoint import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    checkpoint_name,
    list_checkpoints,
    load_checkpoint,
    load_latest_checkpoint,
    rotate_checkpoints,
    save_checkpoint,
)
from collab_kit.model.transformer import TextToImageTransformer
from collab_kit.roles.monitor_address import lasting_address
from collab_kit.roles.monitor_settings import MonitorSettings
from collab_kit.roles.run_history import RunHistory
from collab_kit.swarm.metrics import MetricsPublisher, PeerMetrics

# a small target batch: global epochs of a few seconds even on a loaded machine, so that checkpoints come often
TARGET = "optimizer.target_batch_size=512"
EVENT_DEADLINE = 240  # seconds; generous: the machines these run on are shared and often loaded


def monitor_args(run_id, tmp_path, *extra):
    return [
        "monitor",
        "--preset",
        "tiny",
        "--run-id",
        run_id,
        "--host",
        "127.0.0.1",
        "--events",
        "--poll-every",
        "0.5",
        "--db",
        str(tmp_path / "run.sqlite"),
        "--checkpoints",
        str(tmp_path / "checkpoints"),
        "--checkpoint-every",
        "2",
        "--keep",
        "2",
        "--backoff",
        "0.5",
        "--backoff-max",
        "2",
        "--set",
        TARGET,
        *extra,
    ]


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
        "--max-epochs",
        "1000",
        "--set",
        TARGET,
        *extra,
    ]


def events_of(peer, kind):
    return [event for event in peer.events if event["type"] == kind]


def wait_for_next(peer, predicate, timeout, what):
    """The first event from now on (not an earlier one) that satisfies ``predicate``."""
    start = len(peer.events)
    return peer.wait_for(lambda e: predicate(e) and any(new is e for new in peer.events[start:]), timeout, what)


# ---------------------------------------------------------------------------------------------
# checkpoint series: rotation, and fault (4): the newest checkpoint broken, the previous one loaded


def save_series(folder, epochs):
    config = get_preset("tiny", swarm=dict(run_id="series"))
    models = {}
    for epoch in epochs:
        torch.manual_seed(epoch)
        models[epoch] = TextToImageTransformer(config.model)
        save_checkpoint(
            models[epoch], config, os.path.join(folder, checkpoint_name(epoch)), metadata=dict(global_epoch=epoch)
        )
    return models


def same_parameters(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_rotation_keeps_the_newest_and_clears_what_a_crash_left(tmp_path):
    folder = str(tmp_path / "checkpoints")
    save_series(folder, [2, 4, 6, 8])
    os.makedirs(os.path.join(folder, ".checkpoint-abc123"))  # a save killed before its rename
    os.makedirs(os.path.join(folder, "notes"))  # not ours: left alone
    removed = rotate_checkpoints(folder, keep=2)
    assert sorted(os.path.basename(path) for path in removed) == [".checkpoint-abc123", "epoch-000002", "epoch-000004"]
    assert [epoch for epoch, _ in list_checkpoints(folder)] == [6, 8]
    assert sorted(os.listdir(folder)) == ["epoch-000006", "epoch-000008", "notes"]
    with pytest.raises(ValueError, match="keep at least"):
        rotate_checkpoints(folder, keep=0)


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_good_one(tmp_path, caplog):
    folder = str(tmp_path / "checkpoints")
    models = save_series(folder, [10, 20, 30])
    model, _, metadata, path = load_latest_checkpoint(folder)
    assert metadata["global_epoch"] == 30 and same_parameters(model, models[30])

    # the newest weights cut in half (a copy interrupted, a disk full)
    weights = os.path.join(folder, "epoch-000030", WEIGHTS_NAME)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    with caplog.at_level(logging.WARNING, logger="collab_kit.model.checkpoint"):
        model, config, metadata, path = load_latest_checkpoint(folder)
    assert path.endswith("epoch-000020") and metadata["global_epoch"] == 20 and same_parameters(model, models[20])
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any("epoch-000030" in message and "skipping" in message for message in warnings), warnings
    # a parent folder given to load_checkpoint (what generate_images and the inference notebook call) does the same
    assert load_checkpoint(folder)[2]["global_epoch"] == 20

    # the one before garbled too: its configuration is not JSON; then the oldest one loads
    with open(os.path.join(folder, "epoch-000020", CONFIG_NAME), "w") as f:
        f.write('{"run": {"model": ')
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="collab_kit.model.checkpoint"):
        _, _, metadata, _ = load_latest_checkpoint(folder)
    assert metadata["global_epoch"] == 10
    assert any("epoch-000020" in record.getMessage() for record in caplog.records)

    # none good: an error that names each one and why
    os.remove(os.path.join(folder, "epoch-000010", CONFIG_NAME))
    with pytest.raises(FileNotFoundError, match="none of the 3 checkpoints") as error:
        load_latest_checkpoint(folder)
    assert all(name in str(error.value) for name in ("epoch-000010", "epoch-000020", "epoch-000030"))
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        load_latest_checkpoint(str(tmp_path / "empty"))


# ---------------------------------------------------------------------------------------------
# who gets the credit in an authorized run


def test_a_username_is_credited_only_when_the_binding_proves_it():
    from collab_kit.auth.tokens import issue_token, sign_peer_binding
    from collab_kit.roles.monitor import verified_username

    server_key, other_server_key = RSAPrivateKey(), RSAPrivateKey()
    peer_key = RSAPrivateKey()
    peer_id = PeerID(b"\x00\x24" + os.urandom(36))
    subkey = RSASignatureValidator(peer_key).local_public_key

    def bound(username, key=peer_key, server=server_key, lifetime=datetime.timedelta(hours=1), to=peer_id):
        """The binding record a peer with ``key`` publishes (collab_kit.swarm.bindings.binding_record), for peer id
        ``to``."""
        token = issue_token(server, username, key.get_public_key().to_bytes(), lifetime)
        return dict(token=token.SerializeToString(), binding=sign_peer_binding(key, token, to.to_bytes()))

    def record(username=None):
        return PeerMetrics(
            peer_id=peer_id.to_base58(),
            username=username,
            epoch=3,
            samples_per_second=1.0,
            samples_accumulated=64,
            loss=2.0,
            mini_steps=8,
            compute_seconds=4.0,
            time=get_dht_time(),
        )

    server_public = server_key.get_public_key()
    assert verified_username(subkey, record("alice"), bound("alice"), server_public) == "alice"
    # what the record claims counts for nothing: the token names the user
    assert verified_username(subkey, record("mallory"), bound("alice"), server_public) == "alice"
    refused = {
        "no binding": None,
        "a token from another server": bound("alice", server=other_server_key),
        "an expired token": bound("alice", lifetime=datetime.timedelta(seconds=-1)),
        "a binding for another peer id": bound("alice", to=PeerID(b"\x00\x24" + os.urandom(36))),
        "another key's token (the record was not signed by the token's key)": bound("alice", key=RSAPrivateKey()),
        "not a binding": {"token": b"garbage", "binding": b"garbage"},
    }
    for why, binding in refused.items():
        assert verified_username(subkey, record("alice"), binding, server_public) is None, why


# ---------------------------------------------------------------------------------------------
# Weights & Biases asked for, not installed


def test_wandb_without_the_package_is_a_clear_error_before_anything_starts(tmp_path, monkeypatch):
    from collab_kit.cli import make_parser
    from collab_kit.roles.monitor import Monitor
    from collab_kit.roles.monitor_settings import MonitorError, MonitorSettings

    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    monkeypatch.setenv("WANDB_PROJECT", "my-run-charts")  # the variable alone asks for W&B
    args = make_parser().parse_args(["monitor", "--preset", "tiny"])
    assert args.wandb_project == "my-run-charts"
    settings = MonitorSettings(
        db_path=str(tmp_path / "run.sqlite"),
        checkpoint_dir=str(tmp_path / "checkpoints"),
        wandb_project=args.wandb_project,
    )
    with pytest.raises(MonitorError, match="pip install wandb") as error:
        Monitor(get_preset("tiny"), settings)
    assert "my-run-charts" in str(error.value) and "WANDB_PROJECT" in str(error.value)
    assert not os.listdir(tmp_path)  # it failed before starting anything: no database, no checkpoint folder


# ---------------------------------------------------------------------------------------------
# state downloads retried with backoff until a peer can give one; the checkpoint pushed to the Hub


@pytest.mark.slow
def test_failed_state_downloads_are_retried_with_backoff_until_a_peer_arrives(
    start_peer, tiny_shards, tmp_path, hub_server
):
    run_id = "test_monitor_backoff"
    hub = {
        "HF_ENDPOINT": hub_server.endpoint,
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }
    from collab_kit.roles.processes import PeerProcess

    monitor = PeerProcess(
        "monitor",
        monitor_args(run_id, tmp_path, "--push-to", "someone/tiny-run"),
        str(tmp_path / "monitor.log"),
        env=hub,
    )
    volunteer = None
    reporter = None
    try:
        addresses = monitor.wait_for(lambda e: e["type"] == "ready", timeout=EVENT_DEADLINE, what="ready")["addresses"]
        # a peer that reports metrics of epoch 3 but has no state to give (no averager): the monitor wants the
        # checkpoint of epoch 2 and finds no one to download it from
        reporter = hivemind.DHT(initial_peers=addresses, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
        reporter_id = reporter.peer_id.to_base58()
        publisher = MetricsPublisher(reporter, run_id)
        publisher.add_work(samples=96, seconds=3.0)
        assert publisher.publish(epoch=3, loss=2.5, mini_steps=12, samples_per_second=32.0)

        failures = []
        while len(failures) < 4:
            failures.append(
                monitor.wait_for(
                    lambda e: e["type"] == "state_download_failed" and e not in failures,
                    timeout=EVENT_DEADLINE,
                    what=f"failed download #{len(failures) + 1}",
                )
            )
        assert [f["retry_in"] for f in failures] == [0.5, 1.0, 2.0, 2.0]  # doubled, then capped
        assert all(f["epoch"] == 2 and "no peer gave its state" in f["reason"] for f in failures), failures
        assert [f["attempt"] for f in failures] == [1, 2, 3, 4]
        # polling went on meanwhile
        assert any(
            e["type"] == "poll" and e["records"] == 1
            for e in monitor.events[monitor.events.index(failures[0]) : monitor.events.index(failures[-1])]
        )
        assert not events_of(monitor, "checkpoint")

        # a training peer arrives: once it is at epoch 2, its state becomes the checkpoint, pushed to the Hub
        volunteer = start_peer("volunteer", *volunteer_args(run_id, addresses, tiny_shards))
        checkpoint = monitor.wait_for(lambda e: e["type"] == "checkpoint", timeout=EVENT_DEADLINE, what="a checkpoint")
        assert checkpoint["epoch"] >= 2 and checkpoint["pushed_to"] == "someone/tiny-run"
        assert monitor.process.poll() is None  # it never died of the failures
        volunteer.kill()
        monitor.kill()  # the series stops here: what is on disk and on the Hub no longer changes
        monitor.new_events()
        last = events_of(monitor, "checkpoint")[-1]
    finally:
        if reporter is not None:
            reporter.shutdown()
        if volunteer is not None:
            volunteer.kill()
        monitor.kill()
    with RunHistory(str(tmp_path / "run.sqlite"), read_only=True) as history:
        board = {row.name: row for row in history.leaderboard()}
        rows = {row.epoch: row for row in history.checkpoints()}
    assert board[reporter_id].samples == 96
    # a checkpoint is saved, recorded, pushed, recorded as pushed, then announced: the kill may have come anywhere in
    # the next one, so the history and the Hub may hold a newer epoch than the last event, never an older one
    assert rows[last["epoch"]].pushed_to == "someone/tiny-run", rows
    assert max(rows) >= last["epoch"]
    assert hub_server.commits[0]["added"] == [CONFIG_NAME, WEIGHTS_NAME]
    assert f"global epoch {checkpoint['epoch']}" in hub_server.commits[0]["summary"]
    # what an inference notebook does with the repository id: the newest checkpoint pushed
    stdout = hub_server.run_python("""
        from collab_kit.model.checkpoint import load_checkpoint
        print(load_checkpoint("someone/tiny-run")[2]["global_epoch"])
    """)
    on_the_hub = int(stdout.strip())
    assert on_the_hub >= last["epoch"] and on_the_hub in rows, (on_the_hub, rows)
    model, _, metadata = load_checkpoint(rows[on_the_hub].path)  # saved here before it was pushed
    assert metadata["global_epoch"] == on_the_hub and all(torch.isfinite(p).all() for p in model.parameters())
    pushed = os.path.join(hub_server.folder("someone/tiny-run"), WEIGHTS_NAME)
    with open(pushed, "rb") as f, open(os.path.join(rows[on_the_hub].path, WEIGHTS_NAME), "rb") as g:
        assert f.read() == g.read()


# ---------------------------------------------------------------------------------------------
# fault (3): the monitor killed mid-run and restarted


def test_a_monitor_keeps_its_identity_and_port_beside_its_database(tmp_path, caplog):
    settings = MonitorSettings(db_path=str(tmp_path / "monitor" / "run.sqlite"))
    config = get_preset("tiny", swarm=dict(host="127.0.0.1"))
    first = lasting_address(config, settings)
    assert first.swarm.identity_path == str(tmp_path / "monitor" / "run.key") and first.swarm.port == 0
    assert os.path.isdir(tmp_path / "monitor")  # hivemind writes the key there at the first start
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        noted = holder.getsockname()[1]
        (tmp_path / "monitor" / "run.port").write_text(f"{noted}\n")
        with caplog.at_level(logging.WARNING, logger="collab_kit.roles.monitor"):
            busy = lasting_address(config, settings)  # another program holds it now: any port, and said
        assert busy.swarm.port == 0 and f"port {noted}, where this monitor listened before, is taken" in caplog.text
    assert lasting_address(config, settings).swarm.port == noted  # free again: the same port
    chosen = get_preset("tiny", swarm=dict(host="127.0.0.1", port=noted + 1, identity_path=str(tmp_path / "own.key")))
    assert lasting_address(chosen, settings).swarm == chosen.swarm  # --port and swarm.identity_path win
    assert lasting_address(config, MonitorSettings(db_path=None)).swarm == config.swarm  # no database, nothing kept


def prefix_sums(values):
    sums, total = {0}, 0
    for value in values:
        total += value
        sums.add(total)
    return sums


@pytest.mark.slow
def test_a_monitor_killed_and_restarted_loses_no_leaderboard_row_and_its_checkpoints_go_on(
    start_peer, tiny_shards, tmp_path
):
    run_id = "test_monitor_restart"
    first = start_peer("monitor-1", *monitor_args(run_id, tmp_path))
    addresses = first.wait_for(lambda e: e["type"] == "ready", timeout=EVENT_DEADLINE, what="ready")["addresses"]
    volunteers = [
        start_peer(f"volunteer-{i}", *volunteer_args(run_id, addresses, tiny_shards, "--wait-for-peers", "2"))
        for i in range(2)
    ]
    peer_ids = [
        v.wait_for(lambda e: e["type"] == "ready", timeout=EVENT_DEADLINE, what="ready")["peer_id"] for v in volunteers
    ]
    first.wait_for(lambda e: e["type"] == "checkpoint", timeout=EVENT_DEADLINE, what="a first checkpoint")
    first.wait_for(
        lambda e: e["type"] == "poll" and e["contributors"] == 2,
        timeout=EVENT_DEADLINE,
        what="both volunteers on the leaderboard",
    )

    os.killpg(first.process.pid, signal.SIGKILL)  # no chance to finish anything: the DHT, averager and all
    first.process.wait(30)
    killed_at = get_dht_time()
    with RunHistory(str(tmp_path / "run.sqlite"), read_only=True) as history:
        board_before = {row.name: row for row in history.leaderboard()}
        polls_before = len(history.series())
        checkpoints_before = [row.epoch for row in history.checkpoints()]
    assert set(board_before) == set(peer_ids) and checkpoints_before

    # the swarm went on without it; it rejoins through a volunteer, with the same database and folder
    volunteer_addresses = events_of(volunteers[0], "ready")[0]["addresses"]
    second = start_peer("monitor-2", *monitor_args(run_id, tmp_path, "--initial-peers", *volunteer_addresses))
    ready_again = second.wait_for(
        lambda e: e["type"] == "ready", timeout=EVENT_DEADLINE, what="ready after the restart"
    )
    ready_before = events_of(first, "ready")[0]
    # the same peer id (its key file beside the database) and port: every join line it printed still works
    assert ready_again["peer_id"] == ready_before["peer_id"], (ready_again, ready_before)
    assert sorted(ready_again["addresses"]) == sorted(ready_before["addresses"]), (ready_again, ready_before)
    newer = second.wait_for(
        lambda e: e["type"] == "checkpoint" and e["epoch"] > max(checkpoints_before),
        timeout=EVENT_DEADLINE,
        what="a checkpoint newer than those before the kill",
    )
    wait_for_next(
        second,
        lambda e: e["type"] == "poll" and e["contributors"] == 2,
        timeout=EVENT_DEADLINE,
        what="a poll after the new checkpoint",
    )
    for volunteer in volunteers:  # stop them; what they did is in their events
        volunteer.interrupt()
    for volunteer in volunteers:
        volunteer.wait_exit(90)
    second.kill()

    with RunHistory(str(tmp_path / "run.sqlite"), read_only=True) as history:
        board_after = {row.name: row for row in history.leaderboard()}
        series = history.series()
        checkpoint_rows = history.checkpoints()
    for name, before in board_before.items():  # no row lost, none went back, none started over
        after = board_after[name]
        assert after.samples >= before.samples and after.first_seen == before.first_seen
    assert any(board_after[name].samples > board_before[name].samples for name in board_before)
    # nothing credited twice: each volunteer's total is what it had reported after one of its epochs
    for volunteer, peer_id in zip(volunteers, peer_ids):
        reported = prefix_sums(event["samples"] for event in events_of(volunteer, "epoch"))
        assert board_after[peer_id].samples in reported, (board_after[peer_id].samples, sorted(reported))
    assert len(series) > polls_before and series[-1].time > killed_at
    assert [row.epoch for row in checkpoint_rows][: len(checkpoints_before)] == checkpoints_before
    assert checkpoint_rows[-1].epoch >= newer["epoch"]
    kept = list_checkpoints(str(tmp_path / "checkpoints"))
    assert len(kept) <= 2 and kept[-1][0] == checkpoint_rows[-1].epoch  # numbering and rotation went on
    assert not [name for name in os.listdir(tmp_path / "checkpoints") if name.startswith(".checkpoint-")]
    assert load_latest_checkpoint(str(tmp_path / "checkpoints"))[2]["global_epoch"] == kept[-1][0]
