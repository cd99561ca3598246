"""What the monitor is set to keep and how often: its database, checkpoints, polls, retries, the anchor, W&B.

``MonitorSettings`` checks every field when it is built, so ``collab-kit monitor`` fails at once with what to
change (``MonitorError``) rather than after it has joined the swarm.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from collab_kit.errors import CollabKitError


class MonitorError(CollabKitError, RuntimeError):
    """A setting the monitor cannot work with; the message says what to do."""


# ---------------------------------------------------------------------------------------------
# settings


@dataclass
class MonitorSettings:
    """What the monitor keeps, where, and how often.

    :param db_path: the SQLite file of the time series, contributors and checkpoints (None: keep no history)
    :param checkpoint_dir: the folder of ``epoch-NNNNNN`` checkpoints
    :param checkpoint_every: save a checkpoint every this many global epochs (0: never; the model is then not built)
    :param keep_last: checkpoints kept in ``checkpoint_dir``; older ones are removed
    :param push_to: also upload each checkpoint to this Hub model repository (``user/name``); None: local only
    :param poll_every: seconds between two readings of the DHT
    :param wandb_project: also log each poll to this Weights & Biases project (needs ``pip install wandb``)
    :param backoff_initial: seconds before retrying a failed state download; doubled after each failure...
    :param backoff_max: ...up to this many seconds
    :param download_timeout: seconds one state download may take before it counts as failed
    :param address_file: also write the join addresses to this file (for scripts that start volunteers)
    :param dashboard_port: serve the run's live page and its JSON API on this port (collab_kit.roles.live_page; 0:
      any free one); None: no page
    :param dashboard_host: the address the page listens on: 127.0.0.1 (this machine only) unless told otherwise
    :param anchor: run the swarm's anchor (collab_kit.swarm.anchor) in this process: None (default) when this peer
      accepts
      connections, True always (an error in client mode), False never
    """

    db_path: str | None = "monitor/run.sqlite"
    checkpoint_dir: str = "monitor/checkpoints"
    checkpoint_every: int = 10
    keep_last: int = 3
    push_to: str | None = None
    poll_every: float = 10.0
    wandb_project: str | None = None
    backoff_initial: float = 5.0
    backoff_max: float = 300.0
    download_timeout: float = 300.0
    address_file: str | None = None
    anchor: bool | None = None
    dashboard_port: int | None = None
    dashboard_host: str = "127.0.0.1"

    @property
    def identity_file(self) -> str | None:
        """The monitor's private key, beside its database (``monitor/run.key`` for ``monitor/run.sqlite``): the same
        peer id after a restart, so every join line it printed stays valid. None without a database."""
        return os.path.splitext(self.db_path)[0] + ".key" if self.db_path else None

    @property
    def port_file(self) -> str | None:
        """Where the monitor notes the port it listens on, beside its database: it listens there again after a
        restart unless --port says otherwise. None without a database."""
        return os.path.splitext(self.db_path)[0] + ".port" if self.db_path else None

    def __post_init__(self):
        def require(condition: bool, what: str):
            if not condition:
                raise ValueError(what)

        require(
            isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0,
            f"checkpoint_every={self.checkpoint_every!r}: expected a number of global epochs >= 0 (0: no checkpoints)",
        )
        require(
            isinstance(self.keep_last, int) and self.keep_last >= 1,
            f"keep_last={self.keep_last!r}: keep at least 1 checkpoint",
        )
        for name in ("poll_every", "backoff_initial", "backoff_max", "download_timeout"):
            value = getattr(self, name)
            require(
                isinstance(value, (int, float)) and 0 < value < math.inf,
                f"{name}={value!r}: expected a positive number of seconds",
            )
        require(
            self.backoff_max >= self.backoff_initial,
            f"backoff_max={self.backoff_max} is below backoff_initial={self.backoff_initial}",
        )
        port = self.dashboard_port
        require(
            port is None or (isinstance(port, int) and not isinstance(port, bool) and 0 <= port < 65536),
            f"dashboard_port={self.dashboard_port!r}: expected a port number (0: any free one)",
        )
        require(
            self.dashboard_port is None or bool(self.db_path),
            "the live page (dashboard_port) draws the monitor's database: give it one (db_path, --db)",
        )
        require(self.anchor in (None, True, False), f"anchor={self.anchor!r}: expected None, True or False")
        require(
            self.push_to is None or (self.push_to.count("/") == 1 and all(self.push_to.split("/"))),
            f"push_to={self.push_to!r}: expected a Hub model repository id such as 'user/model'",
        )
