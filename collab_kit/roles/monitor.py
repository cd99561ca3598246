"""The monitor: the swarm's first peer, which watches the run, keeps its history and saves its checkpoints.

    with Monitor(get_preset("small"), MonitorSettings(db_path="monitor/run.sqlite")) as monitor:
        monitor.run()                                    # until Ctrl-C (or ``stop.set()``)

It trains nothing. It gives volunteers a stable address to join through; on a machine others can dial it
also runs the run's anchor (collab_kit.swarm.anchor: the peer that volunteers behind NAT average through and
load the swarm's state from); and every ``poll_every`` seconds it reads what the training peers publish
in the DHT:

- their metrics records (collab_kit.swarm.metrics: signed, schema-checked), aggregated into one point of the
  run's time series (loss, alive peers, throughput, global epoch), and their growing sample and
  compute counters, credited to the contributors' table; both go to SQLite in one transaction
  (collab_kit.roles.run_history, the file the dashboard reads);
- hivemind's own progress records, for the global epoch, the peers alive and the throughput (they expire
  within a minute of a peer leaving; metrics records last five minutes).

A contributor is credited under a Hugging Face username only when the run is authorized and the peer's
binding record (collab_kit.auth.client) proves that the key that signed the metrics record holds that user's
access token; otherwise under its peer id.

Every ``checkpoint_every`` global epochs, a background thread takes the swarm's parameters from the anchor
(which holds them), or, without an anchor, downloads them from a training peer (a hivemind
TrainingStateAverager with the volunteers' prefix and parameter layout, which neither serves its state
nor joins averaging groups: the monitor never counts as a training peer), and writes them as
``<checkpoints>/epoch-000042/`` (collab_kit.model.checkpoint: staged, then
renamed into place), keeps the newest ``keep_last``, records them in the database, and optionally pushes
them to a Hugging Face Hub model repository. A download that fails (no peer shares its state, a timeout,
a state that does not fit) is logged and retried with exponential backoff; polling goes on meanwhile.

A monitor killed at any moment and started again with the same database and checkpoint folder goes on
where it was: it keeps its peer id and port (a key file and the port beside the database: ``lasting_address``),
so every join line it printed stays valid; its anchor starts from the newest checkpoint and takes the volunteers'
state when they are ahead; every poll is one transaction, the per-peer counters make sure nothing is credited
twice, the run's epoch never goes back, and the checkpoint series continues from the newest one on disk or in
the database.

Its checkpoints are collab_kit.roles.checkpointer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress, TrainingProgressSchema
from hivemind.p2p import PeerID

from collab_kit.auth.tokens import binding_problem
from collab_kit.config import RunConfig
from collab_kit.model.checkpoint import list_checkpoints, load_latest_checkpoint
from collab_kit.roles.checkpointer import Checkpointer
from collab_kit.roles.live_page import LivePage
from collab_kit.roles.live_status import PeerPresence, page_document, page_document_path, run_facts, write_document
from collab_kit.roles.monitor_address import lasting_address, note_port, write_address_file
from collab_kit.roles.monitor_settings import MonitorError, MonitorSettings
from collab_kit.roles.run_history import RunHistory
from collab_kit.roles.wandb_log import WandbLogger, require_wandb
from collab_kit.swarm.anchor import Anchor
from collab_kit.swarm.anchor_records import anchor_validators, publish_anchor, read_anchor_addresses
from collab_kit.swarm.bindings import read_binding
from collab_kit.swarm.dht import join_addresses, join_instructions
from collab_kit.swarm.keys import peer_tokens_key, progress_key
from collab_kit.swarm.membership import SwarmMembership
from collab_kit.swarm.metrics import MetricsSchema, PeerMetrics, SwarmSnapshot, read_metrics, summarize
from collab_kit.swarm.progress import is_anchor_record
from collab_kit.swarm.run_card import check_data_fits

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# reading the swarm


@dataclass
class SwarmProgress:
    """The run as hivemind's progress records show it now."""

    epoch: int  # the highest global epoch any training peer reports
    samples_accumulated: int  # samples toward the next global step, at that epoch
    num_peers: int  # training peers with a live record
    samples_per_second: float  # the whole swarm's throughput


def progress_validators(run_id: str) -> list:
    """The record validators hivemind.Optimizer peers use for ``run_id``'s progress records.

    Progress records are signed: a DHT without these validators cannot even decode them.
    """
    return [SchemaValidator(TrainingProgressSchema, prefix=run_id), RSASignatureValidator()]


def monitor_validators(run_id: str) -> list:
    """The validators of the monitor's DHT: hivemind's progress records, collab_kit's metrics records and the anchors'
    addresses."""
    return [
        SchemaValidator(TrainingProgressSchema, prefix=run_id),
        SchemaValidator(MetricsSchema, prefix=run_id),
        *anchor_validators(run_id),
        RSASignatureValidator(),
    ]


def read_swarm_progress(dht: hivemind.DHT, run_id: str, gone: Collection[str] = ()) -> SwarmProgress:
    """Read the progress records that hivemind.Optimizer peers publish under ``<run_id>_progress``.

    Anchors' records (no throughput: collab_kit.swarm.progress.is_anchor_record) set the epoch but are no training
    peers.

    :param dht: a DHT started with ``record_validators=progress_validators(run_id)``
    :param gone: peer ids (base58) known to be gone, whose records are left out while they last
    """
    found = dht.get(progress_key(run_id), latest=True)
    records = []
    if found is not None and isinstance(found.value, dict):
        for entry in found.value.values():
            try:
                record = LocalTrainingProgress.parse_obj(entry.value)
                if not gone or PeerID(record.peer_id).to_base58() not in gone:
                    records.append(record)
            except Exception:  # a malformed record from a broken peer does not stop the monitor
                logger.debug("skipped a malformed progress record", exc_info=True)
    if not records:
        return SwarmProgress(epoch=0, samples_accumulated=0, num_peers=0, samples_per_second=0.0)
    epoch = max(record.epoch for record in records)
    return SwarmProgress(
        epoch=epoch,
        samples_accumulated=sum(r.samples_accumulated for r in records if r.epoch == epoch),
        num_peers=sum(not is_anchor_record(record) for record in records),
        samples_per_second=sum(r.samples_per_second for r in records),
    )


def verified_username(subkey: bytes, record: PeerMetrics, binding_value, server_public_key) -> str | None:
    """The Hugging Face username a metrics record may be credited to, or None when nothing proves one.

    The proof has three links: the record was signed by the key in its ``subkey`` (the DHT's
    RSASignatureValidator checked that), the access token in the peer's binding record was issued by the
    run's server for that same key, and the binding (signed with that key) names the record's peer id.
    The username the record itself claims counts for nothing.

    :param subkey: the record's subkey, ``[owner:<the signer's public key>]``
    :param binding_value: the value under the record's peer id in ``<run_id>_peer_tokens`` (None: no binding)
    :param server_public_key: the run's authentication server's key (hivemind RSAPublicKey)
    """

    if binding_value is None:
        return None
    try:
        token, signature = read_binding(binding_value)
        peer_id = PeerID.from_base58(record.peer_id).to_bytes()
    except Exception:  # MalformedToken, or a peer id that is not base58 (base58 and multihash raise their own kinds)
        return None
    if binding_problem(token, peer_id, signature, server_public_key) is not None:
        return None
    if RSASignatureValidator.PUBLIC_KEY_FORMAT.replace(b"_key_", token.public_key) != bytes(subkey):
        return None  # a valid token and binding, but the record was signed by another key
    return token.username


# ---------------------------------------------------------------------------------------------
# the monitor


class Monitor:
    """The swarm's first peer: polls the DHT, keeps the run's history in SQLite, saves checkpoints.

    Everything starts here (the DHT, the anchor or the state averager of the checkpoints, the database); ``run``
    polls until stopped; ``close`` (or leaving a ``with`` block) stops it all.

    :param config: the run's configuration (its swarm section says where to listen; its model and optimizer
      must be the volunteers' for checkpoints)
    :param settings: what to keep and how often (MonitorSettings)
    :param on_event: called as ``on_event(kind, **fields)`` for "ready", "join_line" (printed again when the run's
      anchors change), "poll", "anchor_round", "anchor_resumed"
      (the state the anchor goes on from after a restart: its checkpoint, or the swarm's when newer), "checkpoint",
      "state_download_failed" and "push_failed" (``collab-kit monitor --events`` prints them); calls are serialized
    :raises MonitorError: W&B asked for but not installed, or an anchor asked for in client mode
    :raises collab_kit.auth.client.AuthorizationError: an authorized run refused this peer
    """

    def __init__(
        self, config: RunConfig, settings: MonitorSettings | None = None, on_event: Callable[..., None] | None = None
    ):
        self.config, self.settings = config, settings or MonitorSettings()
        self.run_id = config.swarm.run_id
        self._on_event, self._event_lock = on_event, threading.Lock()
        self.wandb = None
        if self.settings.wandb_project:
            require_wandb(self.settings.wandb_project)  # a missing package fails before anything starts
        config = lasting_address(config, self.settings)
        # the first peer of a swarm accepts connections; a monitor started again through a volunteer asks the swarm
        self.membership = SwarmMembership(config, record_validators=monitor_validators(self.run_id))
        self.config = config = self.membership.config
        self.dht, self.authorizer, self.reachability = (
            self.membership.dht,
            self.membership.authorizer,
            self.membership.reachability,
        )
        peer_gate = self.membership.peer_gate
        self.checkpointer, self.history, self.anchor = None, None, None
        self._verified: dict[bytes, str] = {}  # record subkey -> the username a binding proved for it
        # the highest global epoch seen: after a restart the DHT holds no record until the peers publish again, and
        # the run's epoch does not go back meanwhile
        self._last_epoch = 0
        self._other_anchors: list[str] = []  # the addresses of the run's other anchors, on the join line printed last
        self._page_run: dict | None = None  # the run as the live page shows it (live_status.run_facts)
        try:
            if self.settings.port_file and not self.dht.client_mode and not config.swarm.announce_maddrs:
                note_port(self.settings.port_file, self.dht)
            self._announce_run()
            if self.settings.anchor and self.dht.client_mode:
                raise MonitorError(
                    "an anchor must accept connections, and this monitor is in client mode: run it on "
                    "a machine others can dial, or without --anchor"
                )
            if self.settings.anchor is not False and not self.dht.client_mode:
                self.anchor = Anchor(
                    config,
                    self.dht,
                    peer_gate=peer_gate,
                    on_round=self._on_anchor_round,
                    on_state=self._on_anchor_state,
                )
            elif not self.settings.anchor:
                logger.warning(
                    "this monitor runs no anchor: volunteers behind NAT can average only through "
                    "another peer that accepts connections"
                )
            if self.anchor is not None and self.settings.checkpoint_every:
                self._resume_anchor()
            if self.settings.checkpoint_every:
                self.checkpointer = Checkpointer(config, self.dht, self.settings, emit=self._emit, anchor=self.anchor)
            if self.settings.db_path:
                self.history = RunHistory(self.settings.db_path, run_id=self.run_id)
                self._last_epoch = self.history.last_epoch()
            if self.checkpointer is not None:
                self.checkpointer.start(self.history)
            if self.settings.wandb_project:
                self.wandb = WandbLogger(self.settings.wandb_project, config)
            if self.anchor is not None:
                self.anchor.start()
            self.presence, self.live_page, self._polls = None, None, 0
            if self.settings.dashboard_port is not None:
                self.presence = PeerPresence(self.dht, timeout=min(3.0, self.settings.poll_every / 2))
                self.live_page = LivePage(
                    page_document_path(self.settings.db_path),
                    self.settings.dashboard_host,
                    self.settings.dashboard_port,
                )
        except BaseException:
            self.close()
            raise
        self.last_snapshot: SwarmSnapshot | None = None

    def _announce_run(self) -> None:
        """Publish the run's card (collab_kit.swarm.run_card) with the run's data, checked first: the data named here
        (``--data``), else the data of the card the swarm already holds (a monitor started again through a
        volunteer). Volunteers who name no data of their own stream it; the join line carries it."""
        card = self.membership.run_card
        data = self.config.data.shards or (card.data if card is not None else None)
        if data:
            check_data_fits(data, self.config, f"--data {data!r}")
        else:
            logger.warning(
                "this run names no data: every volunteer must pass --data with shards made for it; start "
                "the monitor with --data SHARDS (a Hub dataset id, or a folder) and its join line carries "
                "them"
            )
        self.membership.announce_run(data)

    def _resume_anchor(self) -> None:
        """A monitor started again goes on from its newest checkpoint of this run: its anchor starts from it (the
        volunteers behind NAT, who train on meanwhile, cannot give their state)."""

        folder = self.settings.checkpoint_dir
        if not os.path.isdir(folder) or not list_checkpoints(folder):
            return
        try:
            model, _, metadata, path = load_latest_checkpoint(folder)
            if metadata.get("run_id") != self.run_id:
                return  # another run's series (the checkpointer says so)
            self.anchor.resume_from(dict(model.named_parameters()), int(metadata["global_epoch"]))
            self._emit("anchor_resumed", epoch=int(metadata["global_epoch"]), source="checkpoint", path=path)
        except Exception as e:  # a series that does not fit this run's model: the anchor starts afresh
            logger.warning(
                f"the anchor could not resume from the checkpoints in {folder} ({type(e).__name__}: {e}); "
                f"it starts from the run's initial parameters"
            )

    def _on_anchor_state(self, held_epoch: int, epoch: int) -> None:
        self._emit("anchor_resumed", epoch=epoch, source="swarm", held_epoch=held_epoch)

    def _on_anchor_round(self, epoch: int, training_peers: int, problem: str | None) -> None:
        # what the anchor's averagers have sent so far (its rounds and the states it served) and of that the states
        # served, whether the round only reduced, and whether it holds the swarm's state (not while another anchor
        # shares the rounds), called in its thread
        optimizer = self.anchor.optimizer
        sent, served = optimizer.sent_bytes()
        self._emit(
            "anchor_round",
            epoch=epoch,
            training_peers=training_peers,
            problem=problem,
            other_anchors=optimizer.last_anchors_in_group,
            averagers_sent=sent,
            averagers_served=served,
            reduced_only=optimizer.last_round_reduced_only,
            holds_state=optimizer.state_is_swarms,
        )

    def _emit(self, kind: str, **fields) -> None:
        if self._on_event is not None:
            with self._event_lock:  # the checkpointer's thread and the poll loop both report
                self._on_event(kind, **fields)

    # -- polling --------------------------------------------------------------------------------

    def _credited_names(self, records: list[tuple[bytes, PeerMetrics]]) -> dict[bytes, str]:
        """The name each record is credited to: a proven username in an authorized run, else the peer id."""
        names = {bytes(key): record.peer_id for key, record in records}
        if self.authorizer is None:
            return names
        if all(bytes(key) in self._verified for key, _ in records):  # nothing new to prove: no DHT request
            return {key: self._verified[key] for key in names}

        found = self.dht.get(peer_tokens_key(self.run_id), latest=True)
        bindings = found.value if found is not None and isinstance(found.value, dict) else {}
        server_key = self.authorizer.server_public_key
        for key, record in records:
            key = bytes(key)
            if key not in self._verified:
                try:
                    peer_id = PeerID.from_base58(record.peer_id).to_bytes()
                except Exception:  # not a base58 peer id: nothing can be proven for it
                    continue
                entry = bindings.get(peer_id)
                username = verified_username(key, record, entry.value if entry is not None else None, server_key)
                if username is None:
                    continue
                # the key that signs this peer's records is bound to that user: later records of the same key
                # are the same user's, even in the moment between an expired token and its renewal
                self._verified[key] = username
            names[key] = self._verified[key]
        return names

    def _update_anchors(self) -> int:
        """Publish this monitor's anchor, and print the join line again when the run's other anchors change: every line
        lists them all, so a volunteer who joins through it reaches the run while any one of them lives. Returns how
        many anchors the run has now."""
        own = join_addresses(self.dht)
        if self.anchor is not None:
            publish_anchor(self.dht, self.run_id, own, ttl=max(60.0, 3 * self.settings.poll_every))
        anchors = read_anchor_addresses(self.dht, self.run_id)
        if self.anchor is not None:
            self.anchor.set_other_anchors(sum(not set(addresses) & set(own) for addresses in anchors))
            if self.anchor.lost_the_swarms_state:  # it only reduced, and every volunteer left: the newest checkpoint
                self._resume_anchor()
        if self.history is not None:  # the dashboard shows each anchor, this one's included
            self.history.record_anchors([own, *anchors] if self.anchor is not None else anchors, time.time())
        others = sorted({address for addresses in anchors for address in addresses if address not in own})
        if others != self._other_anchors:
            self._other_anchors = others
            self._print_join_line()
        return len(anchors) + (self.anchor is not None and not any(set(a) & set(own) for a in anchors))

    def _print_join_line(self) -> None:
        print(
            join_instructions(
                self.dht, self.config, data=self.membership.run_card.data, other_anchors=self._other_anchors
            ),
            flush=True,
        )
        own = join_addresses(self.dht)
        addresses = own + [address for address in self._other_anchors if address not in own]
        self._page_run = run_facts(self.config, self.membership.run_card.data, addresses, self.settings.poll_every)
        if self.settings.address_file:
            write_address_file(self.settings.address_file, addresses)
        self._emit("join_line", addresses=addresses)

    def poll(self) -> SwarmSnapshot:
        """Read the swarm once, store the point and the contributors' growth, and wake the checkpointer."""
        anchors = None
        try:
            anchors = self._update_anchors()
        except Exception as e:  # the DHT busy: the next poll tries again
            logger.debug(f"could not read or publish the run's anchors: {e!r}")
        records = read_metrics(self.dht, self.run_id)
        presence_checked_at = time.time()  # a peer that died before this moment is in `gone`
        gone = self.presence.gone([record for _, record in records]) if self.presence is not None else set()
        progress = read_swarm_progress(self.dht, self.run_id, gone=gone)
        names = self._credited_names(records)
        snapshot = summarize([record for key, record in records if record.peer_id not in gone])
        snapshot.anchors = anchors
        snapshot.epoch = self._last_epoch = max(snapshot.epoch, progress.epoch, self._last_epoch)
        if progress.num_peers:  # hivemind's records expire sooner after a peer leaves: the better "alive" count
            snapshot.alive_peers, snapshot.samples_per_second = progress.num_peers, progress.samples_per_second
        contributors = 0
        if self.history is not None:
            self.history.record(snapshot, [(key, record, names[bytes(key)]) for key, record in records])
            contributors = len(self.history.leaderboard())
        if self.wandb is not None:
            self.wandb.log(snapshot, contributors)
        self._polls += 1
        if self.live_page is not None:
            if self._page_run is None:  # polled before run() printed the join line
                self._page_run = run_facts(
                    self.config, self.membership.run_card.data, join_addresses(self.dht), self.settings.poll_every
                )
            write_document(
                page_document_path(self.settings.db_path),
                page_document(self.history, self._page_run, gone, poll=self._polls),
            )
        if self.checkpointer is not None:
            self.checkpointer.notify(snapshot.epoch)
        loss = "-" if snapshot.loss is None else f"{snapshot.loss:.4f}"
        logger.info(
            f"epoch {snapshot.epoch}, {snapshot.alive_peers} training peers, loss {loss}, "
            f"{snapshot.samples_per_second:.1f} samples/s, {progress.samples_accumulated} samples toward "
            f"the next step"
        )
        self._emit(
            "poll",
            epoch=snapshot.epoch,
            alive_peers=snapshot.alive_peers,
            loss=snapshot.loss,
            samples_per_second=snapshot.samples_per_second,
            records=len(records),
            contributors=contributors,
            gone=sorted(gone),
            presence_checked_at=presence_checked_at,
        )
        self.last_snapshot = snapshot
        return snapshot

    def run(self, stop: threading.Event | None = None, on_ready: Callable[[hivemind.DHT], None] | None = None) -> None:
        """Print how to join, then poll every ``poll_every`` seconds until ``stop`` is set or Ctrl-C.

        A poll that fails (the DHT busy, a database error) is logged; the next one comes as usual.

        :param stop: an event that ends the loop (None: run until interrupted)
        :param on_ready: called with the DHT once the peer is reachable
        """
        stop = stop or threading.Event()
        try:
            self._print_join_line()
            if self.live_page is not None:
                print(f"The run's live page: {self.live_page.url}", flush=True)
                self._emit("live_page", url=self.live_page.url)
            self._emit("ready", peer_id=str(self.dht.peer_id), addresses=join_addresses(self.dht))
            if on_ready is not None:
                on_ready(self.dht)
            while True:
                try:
                    self.poll()
                except Exception as e:
                    logger.warning(
                        f"this poll of the swarm failed ({type(e).__name__}: {e}); the next one comes "
                        f"in {self.settings.poll_every:g} s",
                        exc_info=logger.isEnabledFor(logging.DEBUG),
                    )
                if stop.wait(self.settings.poll_every):
                    break
        except KeyboardInterrupt:
            pass

    # -- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the checkpointer, leave the swarm, close the database (safe to call twice)."""
        try:
            if getattr(self, "live_page", None) is not None:
                self.live_page.stop()
                self.live_page = None
            if self.checkpointer is not None:
                self.checkpointer.stop()
                self.checkpointer = None
            if self.anchor is not None:
                self.anchor.shutdown()
                self.anchor = None
            if self.wandb is not None:
                self.wandb.close()
                self.wandb = None
        finally:
            self.membership.close()
            if self.history is not None:
                self.history.close()
                self.history = None

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
