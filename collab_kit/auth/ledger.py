"""The authentication server's ledger: every join, and per-user stats, in SQLite.

What it is for: the rate limit of joins per user (a minute's window), the maintainers' view of who joined and when,
and a server restarted with the same file that goes on where it was.
"""

from __future__ import annotations

import base64
import contextlib
import os
import sqlite3
import threading
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------
# the ledger: joins and per-user stats in SQLite


@dataclass
class UserStats:
    """One user's record: when first and last seen (Unix seconds, UTC) and how many joins."""

    username: str
    first_seen: float
    last_seen: float
    joins: int


class JoinLedger:
    """Every join and per-user stats in a SQLite file; safe to use from several threads.

    :param path: the database file, created (with its folder) if missing
    """

    SCHEMA_VERSION = 1

    def __init__(self, path: str):
        self.path = path
        folder = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(folder, exist_ok=True)
            # one connection shared under a lock: the server's threads take turns, each write is one transaction
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA busy_timeout = 5000")
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > self.SCHEMA_VERSION:
                raise ValueError(
                    f"{path} was written by a newer collab_kit (schema {version}): upgrade collab_kit "
                    f"or give another --db"
                )
            self._db.executescript("""
                CREATE TABLE IF NOT EXISTS joins (
                    id INTEGER PRIMARY KEY,
                    username TEXT NOT NULL,
                    peer_public_key TEXT NOT NULL,  -- base64 of the OpenSSH bytes, as the peer sent it
                    issued_at REAL NOT NULL,        -- Unix seconds
                    expires_at TEXT NOT NULL        -- the token's expiration_time (ISO 8601, UTC)
                );
                CREATE INDEX IF NOT EXISTS joins_by_user ON joins (username, issued_at);
                CREATE TABLE IF NOT EXISTS users (
                    username TEXT PRIMARY KEY,
                    first_seen REAL NOT NULL,
                    last_seen REAL NOT NULL,
                    joins INTEGER NOT NULL
                );
            """)
            self._db.execute(f"PRAGMA user_version = {self.SCHEMA_VERSION}")
        except sqlite3.Error as e:
            raise ValueError(
                f"cannot use {path} as the auth server's database ({e}): give --db a writable file path"
            ) from None
        self._lock = threading.Lock()

    def joins_since(self, username: str, since: float) -> list[float]:
        """When ``username`` joined at or after ``since`` (Unix seconds), oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT issued_at FROM joins WHERE username = ? AND issued_at >= ? ORDER BY issued_at",
                (username, since),
            ).fetchall()
        return [row[0] for row in rows]

    def record_join(self, username: str, peer_public_key: bytes, issued_at: float, expires_at: str) -> None:
        with self._lock:
            with self._transaction():
                self._db.execute(
                    "INSERT INTO joins (username, peer_public_key, issued_at, expires_at) VALUES (?, ?, ?, ?)",
                    (username, base64.b64encode(peer_public_key).decode(), issued_at, expires_at),
                )
                self._db.execute(
                    "INSERT INTO users (username, first_seen, last_seen, joins) VALUES (?, ?, ?, 1) "
                    "ON CONFLICT (username) DO UPDATE SET last_seen = excluded.last_seen, "
                    "joins = joins + 1",
                    (username, issued_at, issued_at),
                )

    def user_stats(self, username: str) -> UserStats | None:
        with self._lock:
            row = self._db.execute(
                "SELECT username, first_seen, last_seen, joins FROM users WHERE username = ?", (username,)
            ).fetchone()
        return UserStats(*row) if row else None

    def all_users(self) -> list[UserStats]:
        """Every user who joined, the most joins first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT username, first_seen, last_seen, joins FROM users ORDER BY joins DESC, username"
            ).fetchall()
        return [UserStats(*row) for row in rows]

    def count_joins(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM joins").fetchone()[0]

    @contextlib.contextmanager
    def _transaction(self):
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self):
        with self._lock:
            self._db.close()
