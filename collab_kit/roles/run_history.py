"""The run's history as the monitor saw it, in one SQLite file: what the dashboard draws.

    history = RunHistory("monitor/run.sqlite")
    history.record(snapshot, records)          # one poll of the DHT: a time-series row + contributors
    history.series(), history.leaderboard(), history.checkpoints()

Tables (the file is the interface: the dashboard and notebooks read it, possibly while the monitor
writes it, which SQLite's WAL mode allows):

    swarm(time, epoch, loss, alive_peers, samples_per_second, anchors, samples)  one row per poll (anchors: the
        run's anchors the monitor read; samples: every contributor's samples credited so far)
    contributors(name, samples, compute_seconds, first_seen, last_seen, device)  the leaderboard (device: the
        last one its records named, with its precision: "Tesla T4, fp16")
    peers(key, peer_id, name, samples_accumulated, compute_seconds, last_seen, averaged_with, lone_epochs, lone_reason)
        the last counters seen from each signed record, so that only their growth is credited, and how the
        peer's last gradient round went (with how many other training peers, or alone for how long and why)
    checkpoints(epoch, path, time, pushed_to)                            checkpoints the monitor wrote
    run(key, value)                                                      the run id the file belongs to

Every poll is one transaction: a monitor killed at any moment leaves the file as it was after the
last complete poll, and a restarted monitor goes on from there (no leaderboard row is lost, no
sample is credited twice: the per-peer counters are in the same transaction).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from collab_kit.swarm.metrics import PeerMetrics, SwarmSnapshot

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS swarm (
    time REAL NOT NULL, epoch INTEGER NOT NULL, loss REAL, alive_peers INTEGER NOT NULL,
    samples_per_second REAL NOT NULL);
CREATE TABLE IF NOT EXISTS contributors (
    name TEXT PRIMARY KEY, samples INTEGER NOT NULL, compute_seconds REAL NOT NULL,
    first_seen REAL NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS peers (
    key BLOB PRIMARY KEY, peer_id TEXT NOT NULL, name TEXT NOT NULL, samples_accumulated INTEGER NOT NULL,
    compute_seconds REAL NOT NULL, last_seen REAL NOT NULL);
CREATE TABLE IF NOT EXISTS checkpoints (
    epoch INTEGER PRIMARY KEY, path TEXT NOT NULL, time REAL NOT NULL, pushed_to TEXT);
CREATE TABLE IF NOT EXISTS run (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS anchors (peer_id TEXT PRIMARY KEY, addresses TEXT NOT NULL, last_seen REAL NOT NULL);
"""
# columns added after the first release: added to a file that lacks them (name, SQL type)
LATER_COLUMNS = {
    "peers": (("averaged_with", "INTEGER"), ("lone_epochs", "INTEGER"), ("lone_reason", "TEXT"), ("activity", "TEXT")),
    "contributors": (("device", "TEXT"),),
    "swarm": (("anchors", "INTEGER"), ("samples", "INTEGER")),
}


@dataclass
class Contributor:
    """One row of the leaderboard: a Hugging Face username in an authorized run, else a peer id."""

    name: str
    samples: int
    compute_seconds: float
    first_seen: float
    last_seen: float
    device: str | None = None  # where it trained last, and in what precision (None: its records do not say)


def device_label(record: PeerMetrics) -> str | None:
    """ "Tesla T4, fp16", "cpu, fp32", or None for a record that names neither."""
    named = [part for part in (record.device, record.precision) if part]
    return ", ".join(named) if named else None


@dataclass
class PeerAveraging:
    """How one training peer's last gradient round went, as its newest record says.

    :param averaged_with: other training peers in that round (0: it stepped alone; None: the peer does not say)
    :param lone_epochs: global epochs in a row it was not averaged while others trained
    :param lone_reason: why (None when it was averaged)
    """

    peer_id: str
    name: str
    last_seen: float
    averaged_with: int | None
    lone_epochs: int | None
    lone_reason: str | None
    activity: str | None = None  # what it is busy with instead of training ("downloading_state")

    @property
    def alone(self) -> bool:
        return bool(self.lone_epochs)

    def describe(self) -> str:
        """ "alone for 4 epochs: why" (the fact that matters most, with "; now downloading the swarm's state" when it
        does), "downloading the swarm's state", "averaging with 2 peers", or "not reported"."""
        downloading = self.activity == "downloading_state"
        if self.alone:
            now = "; now downloading the swarm's state" if downloading else ""
            return f"alone for {self.lone_epochs} epoch(s): {self.lone_reason or 'no reason given'}{now}"
        if downloading:
            return "downloading the swarm's state"
        if self.averaged_with is None:
            return "not reported"
        return f"averaging with {self.averaged_with} peer(s)" if self.averaged_with else "alone in the swarm"


@dataclass
class AnchorRow:
    """One anchor of the run (collab_kit.swarm.anchor): its peer id, the addresses volunteers join it by, when the
    monitor last read it in the DHT."""

    peer_id: str
    addresses: list[str]
    last_seen: float


def peer_id_of(addresses: Sequence[str]) -> str:
    """The peer id a peer's join addresses name (``.../p2p/<id>``), or "" if none does."""
    for address in addresses:
        if "/p2p/" in address:
            return address.rsplit("/p2p/", 1)[1]
    return ""


@dataclass
class CheckpointRow:
    epoch: int
    path: str
    time: float
    pushed_to: str | None


class RunHistory:
    """The monitor's SQLite file (created if missing; an existing one is continued).

    :param path: the database file
    :param read_only: open for reading only (the dashboard): never creates or changes the file
    :param run_id: the run this history is of: recorded in a new file, checked in an existing one (two runs'
      points in one file would draw one meaningless curve)
    :raises ValueError: the file holds another run's history
    """

    def __init__(self, path: str, read_only: bool = False, run_id: str | None = None):
        self.path = path
        if read_only:
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"no monitor database at {path!r}: start `collab-kit monitor --db {path}` "
                    f"first, or pass the file it writes"
                )
            self._connection = sqlite3.connect(
                f"file:{os.path.abspath(path)}?mode=ro", uri=True, check_same_thread=False
            )
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._connection = sqlite3.connect(path, check_same_thread=False)
            self._connection.execute("PRAGMA journal_mode=WAL")  # readers (the dashboard) never block the monitor
            self._connection.execute("PRAGMA synchronous=FULL")  # a committed poll survives a power cut
            self._connection.executescript(SCHEMA)
            with self._connection:
                for table, columns in LATER_COLUMNS.items():
                    present = {row[1] for row in self._connection.execute(f"PRAGMA table_info({table})")}
                    for column, kind in columns:
                        if column not in present:
                            self._connection.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        self._lock = threading.Lock()
        if run_id is not None and not read_only:
            self._claim(run_id)

    def _claim(self, run_id: str) -> None:
        with self._lock, self._connection:
            row = self._connection.execute("SELECT value FROM run WHERE key = 'run_id'").fetchone()
            if row is None:
                self._connection.execute("INSERT INTO run (key, value) VALUES ('run_id', ?)", (run_id,))
        if row is not None and row[0] != run_id:
            self._connection.close()
            raise ValueError(
                f"{self.path!r} holds the history of run {row[0]!r}, not of {run_id!r}: give this "
                f"run a database of its own (--db), or use --run-id {row[0]} to continue that run"
            )

    @property
    def run_id(self) -> str | None:
        """The run this file belongs to (None for a file written without one)."""
        with self._lock:
            try:
                row = self._connection.execute("SELECT value FROM run WHERE key = 'run_id'").fetchone()
            except sqlite3.OperationalError:  # a file from before the table existed, opened read-only
                return None
        return row[0] if row else None

    def close(self) -> None:
        self._connection.close()

    def __enter__(self) -> RunHistory:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- writing --------------------------------------------------------------------------------

    def record(self, snapshot: SwarmSnapshot, records: Iterable[tuple[bytes, PeerMetrics, str]]) -> None:
        """Store one poll: the swarm's point and each peer's growth since its last record, in one transaction.

        :param snapshot: the aggregate (collab_kit.swarm.metrics.summarize)
        :param records: (the record's subkey, the record, the name to credit: a verified username or the peer id)
        """
        with self._lock, self._connection:  # one transaction: all of this poll or none of it
            for key, record, name in records:
                self._credit(bytes(key), record, name)
            snapshot.samples = int(self._connection.execute("SELECT SUM(samples) FROM contributors").fetchone()[0] or 0)
            self._connection.execute(
                "INSERT INTO swarm (time, epoch, loss, alive_peers, samples_per_second, anchors, samples) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    snapshot.time,
                    snapshot.epoch,
                    snapshot.loss,
                    snapshot.alive_peers,
                    snapshot.samples_per_second,
                    snapshot.anchors,
                    snapshot.samples,
                ),
            )

    def _credit(self, key: bytes, record: PeerMetrics, name: str) -> None:
        row = self._connection.execute(
            "SELECT samples_accumulated, compute_seconds, last_seen FROM peers WHERE key = ?", (key,)
        ).fetchone()
        if row is None:
            new_samples, new_seconds = record.samples_accumulated, record.compute_seconds
        elif record.time <= row[2]:
            return  # the same record read again: nothing new
        else:
            # counters only grow while a peer lives; smaller ones mean it restarted under the same key
            new_samples = (
                record.samples_accumulated - row[0]
                if record.samples_accumulated >= row[0]
                else record.samples_accumulated
            )
            new_seconds = (
                record.compute_seconds - row[1] if record.compute_seconds >= row[1] else record.compute_seconds
            )
        self._connection.execute(
            "INSERT INTO peers (key, peer_id, name, samples_accumulated, compute_seconds, last_seen, averaged_with, "
            "lone_epochs, lone_reason, activity) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET "
            "peer_id = excluded.peer_id, name = excluded.name, samples_accumulated = excluded.samples_accumulated, "
            "compute_seconds = excluded.compute_seconds, last_seen = excluded.last_seen, "
            "averaged_with = excluded.averaged_with, lone_epochs = excluded.lone_epochs, "
            "lone_reason = excluded.lone_reason, activity = excluded.activity",
            (
                key,
                record.peer_id,
                name,
                record.samples_accumulated,
                record.compute_seconds,
                record.time,
                record.averaged_with,
                record.lone_epochs,
                record.lone_reason,
                record.activity,
            ),
        )
        self._connection.execute(
            "INSERT INTO contributors (name, samples, compute_seconds, first_seen, last_seen, device) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET samples = samples + excluded.samples, "
            "compute_seconds = compute_seconds + excluded.compute_seconds, "
            "first_seen = MIN(first_seen, excluded.first_seen), last_seen = MAX(last_seen, excluded.last_seen), "
            "device = COALESCE(excluded.device, device)",
            (name, new_samples, new_seconds, record.time, record.time, device_label(record)),
        )

    def record_anchors(self, anchors: Iterable[Sequence[str]], time: float) -> None:
        """The run's live anchors (each one's join addresses), read at ``time``."""
        with self._lock, self._connection:
            for addresses in anchors:
                peer_id = peer_id_of(addresses)
                if peer_id:
                    self._connection.execute(
                        "INSERT INTO anchors (peer_id, addresses, last_seen) VALUES (?, ?, ?) ON CONFLICT(peer_id) "
                        "DO UPDATE SET addresses = excluded.addresses, last_seen = excluded.last_seen",
                        (peer_id, json.dumps(list(addresses)), time),
                    )

    def record_checkpoint(self, epoch: int, path: str, time: float, pushed_to: str | None = None) -> None:
        with self._lock, self._connection:
            self._connection.execute(
                "INSERT INTO checkpoints (epoch, path, time, pushed_to) VALUES (?, ?, ?, ?) ON CONFLICT(epoch) "
                "DO UPDATE SET path = excluded.path, time = excluded.time, pushed_to = excluded.pushed_to",
                (epoch, path, time, pushed_to),
            )

    # -- reading --------------------------------------------------------------------------------

    def series(self, since: float | None = None) -> list[SwarmSnapshot]:
        """Every polled point, oldest first (``since``: only those polled after that time)."""
        columns = "time, epoch, loss, alive_peers, samples_per_second"
        query = " FROM swarm WHERE time > ? ORDER BY time"
        since = float("-inf") if since is None else since
        with self._lock:
            try:
                rows = self._connection.execute(f"SELECT {columns}, anchors, samples" + query, (since,)).fetchall()
            except sqlite3.OperationalError:  # a file from before those columns, opened read-only
                rows = self._connection.execute(f"SELECT {columns}" + query, (since,)).fetchall()
        return [SwarmSnapshot(*row) for row in rows]

    def last_epoch(self) -> int:
        """The highest global epoch of the polled points (0 before the first)."""
        with self._lock:
            row = self._connection.execute("SELECT MAX(epoch) FROM swarm").fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    def leaderboard(self, limit: int | None = None) -> list[Contributor]:
        """Contributors, most samples first."""
        columns = "name, samples, compute_seconds, first_seen, last_seen"
        query = " FROM contributors ORDER BY samples DESC, name" + (" LIMIT ?" if limit else "")
        with self._lock:
            try:
                rows = self._connection.execute(f"SELECT {columns}, device" + query, (limit,) if limit else ())
            except sqlite3.OperationalError:  # a file from before the device column, opened read-only
                rows = self._connection.execute(f"SELECT {columns}" + query, (limit,) if limit else ())
            rows = rows.fetchall()
        return [Contributor(*row) for row in rows]

    def peer_averaging(self, since: float | None = None) -> list[PeerAveraging]:
        """Each peer's last gradient round as its newest record said, peers alone first, then by name.

        :param since: only peers seen at this DHT time or later (None: every peer ever seen)
        """
        columns = "peer_id, name, last_seen, averaged_with, lone_epochs, lone_reason"
        since = since if since is not None else float("-inf")
        try:
            with self._lock:
                try:
                    rows = self._connection.execute(
                        f"SELECT {columns}, activity FROM peers WHERE last_seen >= ?", (since,)
                    ).fetchall()
                except sqlite3.OperationalError:  # a read-only file from before the activity column
                    rows = self._connection.execute(
                        f"SELECT {columns} FROM peers WHERE last_seen >= ?", (since,)
                    ).fetchall()
        except sqlite3.OperationalError:  # a file from before these columns, opened read-only
            return []
        peers = [PeerAveraging(*row) for row in rows]
        return sorted(peers, key=lambda peer: (not peer.alone, peer.name))

    def checkpoints(self) -> list[CheckpointRow]:
        with self._lock:
            rows = self._connection.execute(
                "SELECT epoch, path, time, pushed_to FROM checkpoints ORDER BY epoch"
            ).fetchall()
        return [CheckpointRow(*row) for row in rows]

    def anchors(self) -> list[AnchorRow]:
        """Every anchor the monitor has read, the one seen last first ([] in a file from before anchors were kept)."""
        with self._lock:
            try:
                rows = self._connection.execute(
                    "SELECT peer_id, addresses, last_seen FROM anchors ORDER BY last_seen DESC, peer_id"
                ).fetchall()
            except sqlite3.OperationalError:  # a read-only file written before the table existed
                return []
        return [AnchorRow(peer_id, json.loads(addresses), last_seen) for peer_id, addresses, last_seen in rows]

    def last_checkpoint_epoch(self) -> int | None:
        with self._lock:
            row = self._connection.execute("SELECT MAX(epoch) FROM checkpoints").fetchone()
        return row[0]
