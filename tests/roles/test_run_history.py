"""The monitor's SQLite store: what a poll writes, what a restart keeps, and what is credited once only."""

import sqlite3

import pytest

from collab_kit.roles.run_history import RunHistory
from collab_kit.swarm.metrics import PeerMetrics, SwarmSnapshot


def record(peer: str, samples: int, seconds: float, at: float, **changes) -> PeerMetrics:
    fields = dict(
        peer_id=peer,
        username=None,
        epoch=1,
        samples_per_second=10.0,
        samples_accumulated=samples,
        loss=3.0,
        mini_steps=4,
        compute_seconds=seconds,
        time=at,
    )
    fields.update(changes)
    return PeerMetrics(**fields)


def point(at: float, epoch: int = 1) -> SwarmSnapshot:
    return SwarmSnapshot(time=at, epoch=epoch, loss=3.0, alive_peers=2, samples_per_second=20.0)


def test_each_peer_is_credited_its_growth_once_and_a_reopened_file_goes_on(tmp_path):
    path = str(tmp_path / "monitor" / "run.sqlite")
    with RunHistory(path) as history:
        history.record(
            point(100.0),
            [
                (b"key-a", record("peer-a", 64, 2.0, 100.0), "peer-a"),
                (b"key-b", record("peer-b", 32, 1.0, 100.0), "alice"),
            ],
        )
        # the same records read again by the next poll: nothing new to credit
        history.record(point(101.0), [(b"key-a", record("peer-a", 64, 2.0, 100.0), "peer-a")])
        history.record(point(102.0, epoch=2), [(b"key-a", record("peer-a", 192, 6.0, 102.0), "peer-a")])
    with RunHistory(path) as reopened:  # what a restarted monitor sees
        board = {row.name: row for row in reopened.leaderboard()}
        assert board["peer-a"].samples == 192 and board["peer-a"].compute_seconds == pytest.approx(6.0)
        assert (board["peer-a"].first_seen, board["peer-a"].last_seen) == (100.0, 102.0)
        assert board["alice"].samples == 32
        assert [row.name for row in reopened.leaderboard()] == ["peer-a", "alice"]  # most samples first
        assert [p.epoch for p in reopened.series()] == [1, 1, 2]
        # a peer that restarted under the same key counts from zero again: its new counters are all new work
        reopened.record(point(103.0, epoch=2), [(b"key-a", record("peer-a", 16, 0.5, 103.0), "peer-a")])
        assert reopened.leaderboard()[0].samples == 208
        # two peers of one user add up under the user's name
        reopened.record(point(104.0, epoch=2), [(b"key-c", record("peer-c", 100, 3.0, 104.0), "alice")])
        assert {row.name: row.samples for row in reopened.leaderboard()}["alice"] == 132
        reopened.record_checkpoint(2, "/ckpt/epoch-000002", 104.0)
        reopened.record_checkpoint(2, "/ckpt/epoch-000002", 105.0, pushed_to="user/model")
        assert [(c.epoch, c.pushed_to) for c in reopened.checkpoints()] == [(2, "user/model")]
        assert reopened.last_checkpoint_epoch() == 2


def test_a_poll_is_all_or_nothing(tmp_path):
    path = str(tmp_path / "run.sqlite")
    with RunHistory(path) as history:
        history.record(point(1.0), [(b"key-a", record("peer-a", 64, 2.0, 1.0), "peer-a")])
        with pytest.raises(sqlite3.Error):  # a name that is not text breaks the poll half-way through
            history.record(
                point(2.0),
                [
                    (b"key-a", record("peer-a", 128, 4.0, 2.0), "peer-a"),
                    (b"key-b", record("peer-b", 64, 2.0, 2.0), None),
                ],
            )
        assert len(history.series()) == 1  # the time-series row of the failed poll was rolled back too
        assert history.leaderboard()[0].samples == 64


def test_a_reader_needs_an_existing_file_and_cannot_write(tmp_path):
    with pytest.raises(FileNotFoundError, match="collab-kit monitor --db"):
        RunHistory(str(tmp_path / "missing.sqlite"), read_only=True)
    path = str(tmp_path / "run.sqlite")
    RunHistory(path).close()
    with RunHistory(path, read_only=True) as reader:
        assert reader.series() == [] and reader.leaderboard() == []
        with pytest.raises(sqlite3.OperationalError):
            reader.record(point(1.0), [])


def test_a_file_belongs_to_one_run(tmp_path):
    path = str(tmp_path / "run.sqlite")
    with RunHistory(path, run_id="run_a") as history:
        history.record(point(1.0), [])
    with RunHistory(path, run_id="run_a") as again:  # the same run continues
        assert again.run_id == "run_a" and len(again.series()) == 1
    with pytest.raises(ValueError, match="holds the history of run 'run_a', not of 'run_b'.*--db"):
        RunHistory(path, run_id="run_b")
    with RunHistory(path, read_only=True) as reader:
        assert reader.run_id == "run_a" and len(reader.series()) == 1


def test_the_leaderboard_names_each_contributors_last_device_and_an_older_file_gains_the_column(tmp_path):
    path = str(tmp_path / "run.sqlite")
    with sqlite3.connect(path) as old:  # a file written before the device column existed
        old.execute(
            "CREATE TABLE contributors (name TEXT PRIMARY KEY, samples INTEGER NOT NULL, "
            "compute_seconds REAL NOT NULL, first_seen REAL NOT NULL, last_seen REAL NOT NULL)"
        )
        old.execute("INSERT INTO contributors VALUES ('bob', 10, 1.0, 1.0, 1.0)")
    assert [row.device for row in RunHistory(path, read_only=True).leaderboard()] == [None]
    with RunHistory(path) as history:
        history.record(
            point(2.0), [(b"key-a", record("peer-a", 64, 2.0, 2.0, device="Tesla T4", precision="fp16"), "alice")]
        )
        # a record that names no device (an older peer) keeps the one seen before
        history.record(point(3.0), [(b"key-a", record("peer-a", 96, 3.0, 3.0), "alice")])
        history.record(point(4.0), [(b"key-b", record("peer-b", 8, 1.0, 4.0, device="cpu", precision="fp32"), "bob")])
        assert {row.name: row.device for row in history.leaderboard()} == {
            "alice": "Tesla T4, fp16",
            "bob": "cpu, fp32",
        }
