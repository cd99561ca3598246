"""Peers as subprocesses on this machine: what the demo and the multi-peer tests start.

hivemind allows one Optimizer per process (its averagers install signal handlers), so every peer
is its own process. A peer started with ``--events`` prints one machine-readable line per event
(``@event {...json...}``); the parent waits on those events with deadlines, never on bare sleeps,
and always kills the whole process group of a peer it started, p2p daemons included.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from collab_kit.errors import CollabKitError

EVENT_PREFIX = "@event "


def emit_event(kind: str, **fields) -> None:
    """Print one event line for a parent process to read (used by ``collab-kit join --events``), stamped with the
    wall-clock time it happened at (``at``, seconds since the epoch) unless the fields give one."""
    event = dict(type=kind, **fields)
    event.setdefault("at", round(time.time(), 3))
    print(EVENT_PREFIX + json.dumps(event), flush=True)


class PeerFailed(CollabKitError, RuntimeError):
    """A peer process exited, or an awaited event did not come before its deadline."""


class PeerProcess:
    """A ``collab-kit`` command running as a subprocess in a process group of its own.

    :param name: a short name for messages ("first-peer", "volunteer-1")
    :param args: arguments of ``collab-kit`` (for instance ``["join", "--preset", "tiny", ...]``)
    :param log_path: every line the process prints goes here
    :param env: extra environment variables
    :param command: what runs ``args``: ``collab-kit`` by default; a test or benchmark script gives its own
      (``[sys.executable, "path/to/script.py"]``)
    :param stdin: the process's standard input (``subprocess.PIPE`` to write to it)
    :param cwd: its working folder (default: this process's)
    """

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_path: str,
        env: dict[str, str] | None = None,
        command: Sequence[str] = (sys.executable, "-m", "collab_kit.cli"),
        stdin=subprocess.DEVNULL,
        cwd: str | None = None,
    ):
        self.name, self.log_path, self.args = name, log_path, list(args)
        self._events: list[dict] = []  # the events moved off the reader's queue so far, in order
        self._exited = False  # the reader saw the end of the process's output
        self._cursor = 0  # events before this index were returned by new_events()
        self._queue: queue.Queue[dict] = queue.Queue()
        self._log = open(log_path, "a", buffering=1)
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.process = subprocess.Popen(
            [*command, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            text=True,
            bufsize=1,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read_output, daemon=True, name=f"{name}-reader")
        self._reader.start()

    def _read_output(self):
        for line in self.process.stdout:
            self._log.write(line)
            if line.startswith(EVENT_PREFIX):
                try:
                    self._queue.put(json.loads(line[len(EVENT_PREFIX) :]))
                except json.JSONDecodeError:
                    pass
        self._queue.put(dict(type="_exited"))

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    @property
    def events(self) -> list[dict]:
        """Every event the process printed so far, in order (the reader thread's latest included: a test that waited
        a while and then looks back sees what happened meanwhile, not only what an earlier wait read)."""
        self._drain(0.0)
        return self._events

    def wait_for(self, predicate: Callable[[dict], bool], timeout: float, what: str = "an event") -> dict:
        """Return the first event (including earlier ones) that satisfies ``predicate``.

        :raises PeerFailed: if the process exits first, or ``timeout`` seconds pass
        """
        deadline, checked = time.monotonic() + timeout, 0
        while True:
            self._drain(0.0)
            # by index: a predicate that looks at self.events drains the queue too, and no event goes unchecked
            while checked < len(self._events):
                event, checked = self._events[checked], checked + 1
                if predicate(event):
                    return event
            if self._exited:
                code = self.process.wait()
                raise PeerFailed(
                    f"{self.name} exited with code {code} before reporting {what}; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerFailed(
                    f"{self.name} did not report {what} within {timeout:.0f} s; "
                    f"last lines of {self.log_path}:\n{self.log_tail()}"
                )
            self._drain(min(remaining, 1.0))

    def _drain(self, timeout: float) -> None:
        """Move events from the reader thread into the list of events, waiting up to ``timeout`` for the first."""
        if self._exited:
            return
        try:
            event = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return
        while True:
            if event["type"] == "_exited":
                self._exited = True  # nothing follows it
                return
            self._events.append(event)
            try:
                event = self._queue.get_nowait()
            except queue.Empty:
                return

    def new_events(self, timeout: float = 0.0) -> list[dict]:
        """The events that arrived since the last call, waiting up to ``timeout`` seconds for one."""
        self._drain(timeout)
        fresh, self._cursor = self._events[self._cursor :], len(self._events)
        return fresh

    def wait_exit(self, timeout: float) -> int:
        """Wait for the process to end by itself; returns its exit code.

        :raises PeerFailed: if it is still running after ``timeout`` seconds
        """
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise PeerFailed(
                f"{self.name} was still running after {timeout:.0f} s; "
                f"last lines of {self.log_path}:\n{self.log_tail()}"
            ) from None
        self._reader.join(5)
        self._drain(0.0)  # keep the events that arrived before the exit
        return code

    def interrupt(self):
        """Ask the peer to stop as Ctrl-C would."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGINT)

    def crash(self) -> None:
        """Kill the peer and everything it started at once (SIGKILL to its process group), as a machine that dies
        would: nothing of it says goodbye."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        except (ProcessLookupError, PermissionError):
            pass
        self._reader.join(5)

    def kill(self, grace: float = 5.0):
        """End the peer and everything it started (p2p daemons, averager processes)."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                self.process.wait(wait)
                # the leader is gone; make sure no child of its group survives it
                os.killpg(self.process.pid, signal.SIGKILL)
            except subprocess.TimeoutExpired:
                continue
            except (ProcessLookupError, PermissionError):
                pass
            break
        self._reader.join(5)
        self._log.close()


def group_is_empty(pgid: int) -> bool:
    """True when no process of process group ``pgid`` is left (used to check for orphaned p2p daemons)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    # zombies still count for killpg; look for live members
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, process_group = fields[0], int(fields[2])
        if process_group == pgid and state != "Z":
            return False
    return True
