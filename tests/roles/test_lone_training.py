"""Training alone while others train is said: the volunteer's watch, its metrics record, the monitor's history,
the dashboard and the join notebook's live view (the swarm itself: tests/netlab/test_network_lab.py)."""

import pytest

from collab_kit.roles.records import LONE_AFTER_EPOCHS, EpochRecord, LoneTrainingWatch
from collab_kit.roles.run_history import RunHistory
from collab_kit.swarm.metrics import PeerMetrics, SwarmSnapshot
from collab_kit.widgets.dashboard import averaging_html, load
from collab_kit.widgets.live_view import LiveView


def epoch(number, averaged, training_peers=3, problem=None, anchors=0):
    return EpochRecord(
        epoch=number,
        loss=3.0,
        local_steps=4,
        samples=32,
        averaged=averaged,
        group_size=2 if averaged else 1,
        num_peers=training_peers + 1,
        seconds=1.0,
        anchors=anchors,
        training_peers=training_peers,
        problem=problem,
    )


def observe(watch, record, client_mode=True, anchors_in_swarm=1):
    return watch.observe(
        record, client_mode=client_mode, anchors_in_swarm=anchors_in_swarm, averaging_timeout=30.0, matchmaking_time=3.0
    )


def test_the_warning_comes_after_a_stretch_of_lone_epochs_once_and_again_after_a_recovery():
    watch = LoneTrainingWatch()
    said = [
        observe(watch, epoch(n, averaged=False, problem="Averaging step failed: could not find a group"))
        for n in range(LONE_AFTER_EPOCHS + 2)
    ]
    assert said[: LONE_AFTER_EPOCHS - 1] == [None] * (LONE_AFTER_EPOCHS - 1)
    warning = said[LONE_AFTER_EPOCHS - 1]
    assert warning.epochs == LONE_AFTER_EPOCHS and warning.training_peers == 3
    assert "could not find a group" in warning.reason and "averaging_timeout" in warning.advice
    assert "30 s and 3 s" in warning.advice and "training alone" in str(warning)
    assert said[LONE_AFTER_EPOCHS:] == [None, None]  # said once per stretch
    assert observe(watch, epoch(10, averaged=True)) is None and watch.streak == 0
    again = [observe(watch, epoch(11 + n, averaged=False)) for n in range(LONE_AFTER_EPOCHS)]
    assert again[-1] is not None and "no other training peer" in again[-1].reason


def test_alone_in_the_swarm_is_not_training_alone():
    watch = LoneTrainingWatch()
    assert all(observe(watch, epoch(n, averaged=False, training_peers=1)) is None for n in range(10))


def test_behind_nat_with_no_anchor_the_reason_names_the_missing_public_peer():
    watch = LoneTrainingWatch(after_epochs=2)
    observe(watch, epoch(0, averaged=False), anchors_in_swarm=0)
    # the reason the metrics record carries (the monitor's history) is the same diagnosis, from the first lone epoch
    assert watch.streak == 1 and "no peer of the swarm accepts connections" in watch.reason
    warning = observe(watch, epoch(1, averaged=False), anchors_in_swarm=0)
    assert "client mode" in warning.reason and "no peer of the swarm accepts connections" in warning.reason
    assert watch.reason == warning.reason
    observe(watch, epoch(2, averaged=True), anchors_in_swarm=0)
    assert watch.streak == 0 and watch.reason is None
    assert "collab-kit monitor" in warning.advice and "anchor" in warning.advice
    # the same peer with an anchor in the swarm: not the reason
    watch = LoneTrainingWatch(after_epochs=1)
    assert "client mode" not in observe(watch, epoch(0, averaged=False), anchors_in_swarm=1).reason


def test_failed_rounds_of_a_peer_nobody_checked_blame_the_dialling():
    from collab_kit.config import get_preset
    from collab_kit.roles.records import undialable_reason

    elsewhere = ["/ip4/10.77.0.10/tcp/31337/p2p/12D3KooWBmwXN3rsVfnLsZKbXeBrSLfczHxZHwVjPrbKwpLfYm3t"]
    forced = get_preset("tiny", swarm=dict(initial_peers=elsewhere, client_mode=False, host="0.0.0.0"))
    why = undialable_reason(forced, reachability=None)
    assert "--no-client-mode" in why and "never checked" in why
    # checked by a probe (its verdict, or the address it found announced), in client mode, or a swarm on this
    # machine: nothing to blame on the dialling
    probed = get_preset(
        "tiny", swarm=dict(initial_peers=elsewhere, client_mode=False, announce_maddrs=["/ip4/10.77.1.3/tcp/4242"])
    )
    here = get_preset(
        "tiny", swarm=dict(initial_peers=[elsewhere[0].replace("10.77.0.10", "127.0.0.1")], client_mode=False)
    )
    assert undialable_reason(forced, reachability=object()) is None
    assert undialable_reason(probed, None) is None and undialable_reason(here, None) is None
    assert undialable_reason(get_preset("tiny", swarm=dict(initial_peers=elsewhere, client_mode=True)), None) is None
    watch = LoneTrainingWatch(after_epochs=1)
    warning = watch.observe(
        epoch(0, averaged=False, problem="could not find a group"),
        client_mode=False,
        anchors_in_swarm=1,
        averaging_timeout=30.0,
        matchmaking_time=3.0,
        undialable=why,
    )
    assert "may be unable to dial this one" in warning.reason and "never checked" in warning.reason
    assert "leave --client-mode and --host out" in warning.advice and "slow or unsteady" not in warning.advice
    # a peer that was checked: its failing rounds are the link's
    link = LoneTrainingWatch(after_epochs=1).observe(
        epoch(0, averaged=False, problem="could not find a group"),
        client_mode=False,
        anchors_in_swarm=1,
        averaging_timeout=30.0,
        matchmaking_time=3.0,
    )
    assert "slow or unsteady" in link.advice


def test_the_live_view_turns_red_and_prints_the_warning(capsys):
    view = LiveView(target_batch_size=64)
    for n in range(LONE_AFTER_EPOCHS):
        view.update(epoch(n, averaged=False, problem="the averaging round did not finish"))
    assert view.caption().startswith(f"TRAINING ALONE for {LONE_AFTER_EPOCHS} epochs while 2 other peer(s) train")
    assert view.figure()._suptitle.get_color() == "tab:red"
    watch = LoneTrainingWatch()
    warning = [observe(watch, epoch(n, averaged=False)) for n in range(LONE_AFTER_EPOCHS)][-1]
    view.warn(warning)
    assert "WARNING: training alone" in capsys.readouterr().out and view.warnings == [warning]
    view.update(epoch(9, averaged=True))
    assert not view.caption().startswith("TRAINING ALONE")


def metrics(peer, at, **fields):
    values = dict(
        peer_id=peer,
        username=None,
        epoch=5,
        samples_per_second=10.0,
        samples_accumulated=100,
        loss=3.0,
        mini_steps=4,
        compute_seconds=10.0,
        time=at,
        averaged_with=None,
        lone_epochs=None,
        lone_reason=None,
    )
    values.update(fields)
    return PeerMetrics(**values)


def test_the_monitors_history_and_dashboard_show_each_peers_averaging(tmp_path):
    path = str(tmp_path / "run.sqlite")
    with RunHistory(path, run_id="r") as history:
        history.record(
            SwarmSnapshot(time=1.0, epoch=5, loss=3.0, alive_peers=3, samples_per_second=30.0),
            [
                (b"a", metrics("peer-a", 1.0, averaged_with=2, lone_epochs=0), "peer-a"),
                (
                    b"b",
                    metrics(
                        "peer-b",
                        1.0,
                        averaged_with=0,
                        lone_epochs=4,
                        lone_reason="Averaging step failed: could not find a group",
                    ),
                    "peer-b",
                ),
                (b"c", metrics("peer-c", 1.0), "peer-c"),
            ],
        )
        peers = history.peer_averaging()
    assert [p.name for p in peers] == ["peer-b", "peer-a", "peer-c"]  # alone first
    assert (
        peers[0].alone and peers[0].describe() == "alone for 4 epoch(s): Averaging step failed: could not find a group"
    )
    assert peers[1].describe() == "averaging with 2 peer(s)" and peers[2].describe() == "not reported"
    data = load(path)
    page = averaging_html(data.averaging)
    assert page.count('class="alone"') == 1 and "alone for 4 epoch(s)" in page and "averaging with 2 peer(s)" in page


def test_a_history_file_from_before_the_averaging_columns_gets_them(tmp_path):
    import sqlite3

    path = str(tmp_path / "old.sqlite")
    connection = sqlite3.connect(path)
    connection.executescript(
        "CREATE TABLE peers (key BLOB PRIMARY KEY, peer_id TEXT NOT NULL, name TEXT NOT NULL, "
        "samples_accumulated INTEGER NOT NULL, compute_seconds REAL NOT NULL, last_seen REAL NOT NULL);"
        "INSERT INTO peers VALUES (x'01', 'old-peer', 'old-peer', 5, 1.0, 0.5);"
    )
    connection.commit()
    connection.close()
    with RunHistory(path) as history:
        assert [(p.name, p.describe()) for p in history.peer_averaging()] == [("old-peer", "not reported")]
        history.record(
            SwarmSnapshot(time=1.0, epoch=1, loss=3.0, alive_peers=1, samples_per_second=1.0),
            [(b"\x01", metrics("old-peer", 1.0, averaged_with=1, lone_epochs=0), "old-peer")],
        )
        assert history.peer_averaging()[0].describe() == "averaging with 1 peer(s)"


@pytest.mark.parametrize("reason", ["x" * 301, 3])
def test_a_malformed_lone_reason_is_refused_by_the_schema(reason):
    with pytest.raises(ValueError):
        metrics("p", 1.0, lone_reason=reason)
