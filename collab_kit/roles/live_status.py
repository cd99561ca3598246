"""What the run's live page shows, built by the monitor once a poll: the documents its JSON API serves.

    presence = PeerPresence(dht, timeout=3.0)
    gone = presence.gone(records)                                   # peer ids that stopped answering
    document = page_document(history, run_facts(config, data, addresses, poll_every), gone, poll=12)
    write_document(page_document_path("monitor/run.sqlite"), document)   # monitor/run.page.json, replaced whole

The page's process (collab_kit.roles.live_page) serves ``document["status"]`` at ``/api/status`` and
``document["series"]`` at ``/api/series``: the page is drawn from the monitor's SQLite history, as the static
dashboard is, plus what only the live monitor knows (which peers answer now, the join line). Built once a poll, never
once a request: however many people watch, the monitor's work stays the same.

Safe to publish: a peer is its credited name (a Hugging Face username in an authorized run, else its peer id, which
the swarm's DHT shows to anyone) and the device it names; nobody's address, no token, key or path of this machine.
The only addresses are the join line's, the organizers' own peers that every volunteer is given. A checkpoint is its
folder's name and, when pushed, its Hub repository; the run's data, when it is a folder here, is "a folder of the
organizers'". ``tests/roles/test_live_page.py`` reads every field served and finds none of those.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Sequence

import hivemind

from collab_kit.config import RunConfig, shared_settings
from collab_kit.roles.run_history import RunHistory
from collab_kit.swarm.dht import join_command
from collab_kit.swarm.liveness import peers_answering
from collab_kit.swarm.metrics import DEFAULT_EXPIRATION, PeerMetrics

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}$")
MAX_SERIES_POINTS = 4000  # a long run's older polls are thinned to this many: a chart has no more pixels than that
DATA_OF_THE_ORGANIZERS = "a folder of the organizers' (pass --data with your own copy)"


def page_document_path(db_path: str) -> str:
    """Where the monitor writes its page's documents: beside its database (``monitor/run.page.json``)."""
    return os.path.splitext(db_path)[0] + ".page.json"


class PeerPresence:
    """Which training peers stopped answering (collab_kit.swarm.liveness), asked once a poll.

    A peer found gone is not dialled again while its record stays the one it left: a dead machine costs one dial.
    """

    def __init__(self, dht: hivemind.DHT, timeout: float):
        self.dht, self.timeout = dht, timeout
        self._gone: dict[str, float] = {}  # peer id -> the time of the record it left

    def gone(self, records: Sequence[PeerMetrics]) -> set[str]:
        newest: dict[str, float] = {}
        for record in records:
            newest[record.peer_id] = max(record.time, newest.get(record.peer_id, -math.inf))
        to_ask = [peer_id for peer_id, seen in newest.items() if self._gone.get(peer_id) != seen]
        for peer_id, answers in peers_answering(self.dht, to_ask, self.timeout).items():
            if answers:
                self._gone.pop(peer_id, None)
            else:
                self._gone[peer_id] = newest[peer_id]
        self._gone = {peer_id: seen for peer_id, seen in self._gone.items() if peer_id in newest}
        return set(self._gone)


def public_data(data: str | None) -> str | None:
    """The run's data as the page may name it: a Hub dataset id or "synthetic"; a folder here is not named."""
    if not data:
        return None
    if data == "synthetic" or (HUB_ID.match(data) and not os.path.exists(data)):
        return data
    return DATA_OF_THE_ORGANIZERS


def training_mode(config: RunConfig) -> str:
    optimizer = config.optimizer
    if not optimizer.local_steps:
        return "synchronous: gradients averaged at every global step"
    mode = f"local updates: pseudo-gradients averaged every {optimizer.local_steps} global batches"
    if optimizer.fragments > 1:
        mode += f", in {optimizer.fragments} fragments"
    return mode + f", {optimizer.pseudo_gradient_bits}-bit"


def run_facts(config: RunConfig, data: str | None, addresses: Sequence[str], poll_every: float) -> dict:
    """The run's mode, settings and join line: what the page shows of the run itself."""
    shown = public_data(data)
    line = join_command(config, addresses, data=None if shown == DATA_OF_THE_ORGANIZERS else shown)
    if shown == DATA_OF_THE_ORGANIZERS:
        line += " --data PATH-TO-YOUR-COPY"
    settings = {
        f"{section}.{name}": value for (section, name), value in shared_settings(config).items() if section != "data"
    }
    return dict(
        run_id=config.swarm.run_id,
        preset=config.preset,
        mode=training_mode(config),
        data=shown,
        authorized=bool(config.swarm.auth_server),
        join_line=line if addresses else None,
        poll_every=poll_every,
        settings=settings,
    )


def _finite(value) -> float | None:
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def peer_rows(history: RunHistory, gone: set[str], now: float) -> list[dict]:
    """Each training peer seen within a metrics record's life: its state now, and the device it names."""
    devices = {row.name: row.device for row in history.leaderboard()}
    rows = []
    for peer in history.peer_averaging(since=now - DEFAULT_EXPIRATION):
        if peer.peer_id in gone:
            state, detail = "gone", "gone: no longer answers the monitor (it left, died, or its link is down)"
        elif peer.alone:  # a lone peer that downloads the state is still alone: its detail says both
            state, detail = "alone", peer.describe()
        elif peer.activity == "downloading_state":
            state, detail = "downloading", peer.describe()
        elif peer.averaged_with:
            state, detail = "averaging", peer.describe()
        else:
            state, detail = (
                "training",
                "training, no round with others yet" if peer.averaged_with is None else "alone in the swarm",
            )
        rows.append(
            dict(name=peer.name, state=state, detail=detail, last_seen=peer.last_seen, device=devices.get(peer.name))
        )
    order = {"averaging": 0, "training": 1, "downloading": 2, "alone": 3, "gone": 4}
    return sorted(rows, key=lambda row: (order[row["state"]], row["name"]))


def series_columns(history: RunHistory) -> dict:
    """The polls as columns (time, epoch, loss, volunteers, anchors, samples/s, samples), thinned past
    MAX_SERIES_POINTS with the newest kept."""
    points = history.series()
    if len(points) > MAX_SERIES_POINTS:
        stride = math.ceil(len(points) / MAX_SERIES_POINTS)
        points = points[-1::-stride][::-1]
    return dict(
        time=[p.time for p in points],
        epoch=[p.epoch for p in points],
        loss=[_finite(p.loss) for p in points],
        volunteers=[p.alive_peers for p in points],
        anchors=[p.anchors for p in points],
        samples_per_second=[p.samples_per_second for p in points],
        samples=[p.samples for p in points],
    )


def hub_url(repository: str | None) -> str | None:
    if not repository:
        return None
    return f"{os.environ.get('HF_ENDPOINT', 'https://huggingface.co').rstrip('/')}/{repository}"


def page_document(history: RunHistory, run: dict, gone: set[str], poll: int, now: float | None = None) -> dict:
    """Both documents of the page after poll number ``poll``: ``{"status": ..., "series": ...}``."""
    now = time.time() if now is None else now
    series = history.series(since=now - 10 * run["poll_every"])
    latest = series[-1] if series else None
    board = history.leaderboard()
    total = sum(row.samples for row in board)
    leaderboard = [
        dict(
            rank=rank,
            name=row.name,
            samples=row.samples,
            share=row.samples / total if total else 0.0,
            compute_seconds=row.compute_seconds,
            first_seen=row.first_seen,
            last_seen=row.last_seen,
            device=row.device,
        )
        for rank, row in enumerate(board, start=1)
    ]
    checkpoints = [
        dict(
            epoch=row.epoch,
            time=row.time,
            name=os.path.basename(row.path.rstrip("/")),
            hub=row.pushed_to,
            hub_url=hub_url(row.pushed_to),
        )
        for row in history.checkpoints()
    ]
    peers = peer_rows(history, gone, now)
    status = dict(
        updated=now,
        poll=poll,
        run=run,
        peers=peers,
        leaderboard=leaderboard,
        checkpoints=checkpoints[::-1],
        now=dict(
            epoch=latest.epoch if latest else 0,
            loss=_finite(latest.loss) if latest else None,
            volunteers=sum(peer["state"] != "gone" for peer in peers),
            anchors=latest.anchors if latest else None,
            samples_per_second=latest.samples_per_second if latest else 0.0,
            samples=total,
            contributors=len(board),
        ),
    )
    return dict(status=status, series=series_columns(history))


def write_document(path: str, document: dict) -> None:
    """Replace the file whole (a reader never sees half of it)."""
    staging = f"{path}.{os.getpid()}.tmp"
    with open(staging, "w") as file:
        json.dump(document, file, separators=(",", ":"), allow_nan=False)
    os.replace(staging, path)
