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
nor joins averaging groups: the monitor never counts as a training peer), and writes them as ``<checkpoints>/epoch-000042/`` (collab_kit.model.checkpoint: staged, then
renamed into place), keeps the newest ``keep_last``, records them in the database, and optionally pushes
them to a Hugging Face Hub model repository. A download that fails (no peer shares its state, a timeout,
a state that does not fit) is logged and retried with exponential backoff; polling goes on meanwhile.

A monitor killed at any moment and started again with the same database and checkpoint folder goes on
where it was: every poll is one transaction, the per-peer counters make sure nothing is credited twice,
and the checkpoint series continues from the newest one on disk or in the database.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress, TrainingProgressSchema
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from collab_kit.auth.tokens import binding_problem
from collab_kit.config import RunConfig
from collab_kit.errors import CollabKitError
from collab_kit.model.checkpoint import (CONFIG_NAME, checkpoint_name, list_checkpoints, load_latest_checkpoint,
                                         rotate_checkpoints, save_checkpoint)
from collab_kit.model.transformer import TextToImageTransformer, non_finite_parameters
from collab_kit.roles.run_history import RunHistory
from collab_kit.swarm.anchor import Anchor
from collab_kit.swarm.averagers import STATE_DOWNLOAD_PART_TIMEOUT, recording_state_averager_class
from collab_kit.swarm.bindings import read_binding
from collab_kit.swarm.dht import join_addresses, join_instructions
from collab_kit.swarm.keys import peer_tokens_key, progress_key, state_averager_prefix
from collab_kit.swarm.lamb import make_lamb8bit, make_scheduler_factory, parameter_groups
from collab_kit.swarm.membership import SwarmMembership
from collab_kit.swarm.metrics import MetricsSchema, PeerMetrics, SwarmSnapshot, read_metrics, summarize
from collab_kit.swarm.optimizer import is_anchor_record

logger = logging.getLogger(__name__)


class MonitorError(CollabKitError, RuntimeError):
    """A setting the monitor cannot work with; the message says what to do."""


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
    """The validators of the monitor's DHT: hivemind's progress records and collab_kit's metrics records."""
    return [SchemaValidator(TrainingProgressSchema, prefix=run_id), SchemaValidator(MetricsSchema, prefix=run_id),
            RSASignatureValidator()]


def read_swarm_progress(dht: hivemind.DHT, run_id: str) -> SwarmProgress:
    """Read the progress records that hivemind.Optimizer peers publish under ``<run_id>_progress``.

    Anchors' records (no throughput: collab_kit.swarm.optimizer.is_anchor_record) set the epoch but are no training peers.

    :param dht: a DHT started with ``record_validators=progress_validators(run_id)``
    """
    found = dht.get(progress_key(run_id), latest=True)
    records = []
    if found is not None and isinstance(found.value, dict):
        for entry in found.value.values():
            try:
                records.append(LocalTrainingProgress.parse_obj(entry.value))
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


def write_address_file(path: str, dht: hivemind.DHT) -> None:
    """Write the join addresses, one a line, atomically (a reader never sees half a file)."""
    tmp_path = path + ".tmp"
    with open(tmp_path, "w") as f:
        f.write("\n".join(join_addresses(dht)) + "\n")
    os.replace(tmp_path, path)


def verified_username(subkey: bytes, record: PeerMetrics, binding_value, server_public_key) -> Optional[str]:
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
    :param anchor: run the swarm's anchor (collab_kit.swarm.anchor) in this process: None (default) when this peer accepts
      connections, True always (an error in client mode), False never
    """

    db_path: Optional[str] = "monitor/run.sqlite"
    checkpoint_dir: str = "monitor/checkpoints"
    checkpoint_every: int = 10
    keep_last: int = 3
    push_to: Optional[str] = None
    poll_every: float = 10.0
    wandb_project: Optional[str] = None
    backoff_initial: float = 5.0
    backoff_max: float = 300.0
    download_timeout: float = 300.0
    address_file: Optional[str] = None
    anchor: Optional[bool] = None

    def __post_init__(self):
        def require(condition: bool, what: str):
            if not condition:
                raise ValueError(what)

        require(isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0,
                f"checkpoint_every={self.checkpoint_every!r}: expected a number of global epochs >= 0 "
                f"(0: no checkpoints)")
        require(isinstance(self.keep_last, int) and self.keep_last >= 1,
                f"keep_last={self.keep_last!r}: keep at least 1 checkpoint")
        for name in ("poll_every", "backoff_initial", "backoff_max", "download_timeout"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and 0 < value < math.inf,
                    f"{name}={value!r}: expected a positive number of seconds")
        require(self.backoff_max >= self.backoff_initial,
                f"backoff_max={self.backoff_max} is below backoff_initial={self.backoff_initial}")
        require(self.anchor in (None, True, False), f"anchor={self.anchor!r}: expected None, True or False")
        require(self.push_to is None or (self.push_to.count("/") == 1 and all(self.push_to.split("/"))),
                f"push_to={self.push_to!r}: expected a Hub model repository id such as 'user/model'")


# ---------------------------------------------------------------------------------------------
# checkpoints


class StateUnavailable(RuntimeError):
    """No usable state came from the swarm this time (the message says why); the checkpointer tries again later."""


def push_checkpoint(folder: str, repo_id: str, epoch: int) -> str:
    """Upload a checkpoint folder to the root of a Hub model repository (created if missing); returns the commit id.

    The repository's main branch then holds the newest checkpoint (what ``load_checkpoint(repo_id)`` reads);
    its history holds every pushed one, a commit each.
    """
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=folder,
                             commit_message=f"collab_kit checkpoint of global epoch {epoch}")
    return info.oid


def _checkpoint_run_id(path: str) -> Optional[str]:
    """The run id a checkpoint's metadata names (None: unreadable, or none named)."""
    import json

    try:
        with open(os.path.join(path, CONFIG_NAME)) as f:
            return json.load(f).get("metadata", {}).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


class Checkpointer:
    """Saves the swarm's state as a checkpoint every ``checkpoint_every`` global epochs, in a thread of its own.

    With an anchor in this process, the state is the anchor's (it holds the swarm's parameters). Without, it
    comes from a training peer through a hivemind TrainingStateAverager built like the volunteers'
    (collab_kit.swarm.optimizer: the same prefix, parameter groups, optimizer and schedule, so the downloaded tensors
    fall into place). It holds the parameters in the model itself (no offloaded copy), does not share its
    state (``allow_state_sharing=False``) and is in client mode: it is never asked to join an averaging group.

    :param config: the run's configuration (the model and optimizer must match the volunteers')
    :param dht: the monitor's DHT
    :param settings: the monitor's settings (folder, K, N, push_to, backoff, download timeout)
    :param emit: called as ``emit(kind, **fields)`` for "checkpoint", "state_download_failed" and "push_failed"
    :param anchor: the run's anchor in this process (collab_kit.swarm.anchor.Anchor), whose state is saved; None: download
    """

    def __init__(self, config: RunConfig, dht: hivemind.DHT, settings: MonitorSettings,
                 emit: Callable[..., None] = lambda kind, **fields: None, anchor: Optional[Anchor] = None):
        self.config, self.settings, self.emit, self.anchor = config, settings, emit, anchor
        self.model = TextToImageTransformer(config.model)
        # building it forks the averager's process: done before the monitor opens its database (an SQLite
        # connection must not cross a fork)
        self.averager = None if anchor is not None else recording_state_averager_class()(
            dht=dht, prefix=state_averager_prefix(config.swarm.run_id),
            optimizer=partial(make_lamb8bit, config=config.optimizer),
            params=parameter_groups(self.model, config.optimizer.weight_decay),
            scheduler=make_scheduler_factory(config.optimizer), offload_optimizer=False,
            client_mode=True, allow_state_sharing=False,
            next_chunk_timeout=min(STATE_DOWNLOAD_PART_TIMEOUT, settings.download_timeout), start=True)
        if self.averager is not None:
            # hivemind catches a loaded state's schedule up with scheduler.step() alone: this optimizer holds the state
            # and never steps, which torch would warn about at each download (a warning filter would act on the whole
            # process); marked as torch marks an optimizer that has stepped
            self.averager.optimizer._opt_called = True
        self.history = None
        self.last_epoch: Optional[int] = None  # the newest checkpoint's global epoch
        self.swarm_epoch = 0  # the highest global epoch the polls have seen
        self.attempts = 0  # failed downloads in a row
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, history=None) -> None:
        """Continue the series on disk (and in ``history``, a RunHistory) and start the thread."""
        self.history = history
        folder = self.settings.checkpoint_dir
        os.makedirs(folder, exist_ok=True)

        for path in rotate_checkpoints(folder, self.settings.keep_last):
            logger.info(f"removed {path} (an old checkpoint, or one a crash left half written)")
        series = list_checkpoints(folder)
        epochs = [epoch for epoch, _ in series]
        other_run = series and _checkpoint_run_id(series[-1][1]) not in (None, self.config.swarm.run_id)
        if other_run:
            logger.warning(f"{folder} holds checkpoints of another run ({_checkpoint_run_id(series[-1][1])!r}); "
                           f"this run's series goes on after them. Pass --checkpoints FOLDER (and --db PATH) to give "
                           f"run {self.config.swarm.run_id!r} files of its own")
        if history is not None and history.last_checkpoint_epoch() is not None:
            epochs.append(history.last_checkpoint_epoch())
        self.last_epoch = max(epochs) if epochs else None
        if self.last_epoch is not None:
            logger.info(f"the newest checkpoint is of epoch {self.last_epoch}: the next at epoch {self.next_epoch}")
        self._thread = threading.Thread(target=self._run, daemon=True, name="collab_kit-checkpointer")
        self._thread.start()

    @property
    def next_epoch(self) -> int:
        """The global epoch of the next checkpoint: the next multiple of ``checkpoint_every``."""
        every = self.settings.checkpoint_every
        return every if self.last_epoch is None else (self.last_epoch // every + 1) * every

    def notify(self, swarm_epoch: int) -> None:
        """Tell the checkpointer the swarm's global epoch (each poll does)."""
        self.swarm_epoch = max(self.swarm_epoch, swarm_epoch)
        if self.swarm_epoch >= self.next_epoch:
            self._wake.set()

    def _run(self) -> None:
        delay = self.settings.backoff_initial
        while not self._stop.is_set():
            if self.swarm_epoch < self.next_epoch:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            wanted = self.next_epoch
            try:
                self.save_from_swarm()
                delay, self.attempts = self.settings.backoff_initial, 0
            except Exception as e:  # whatever went wrong, the monitor goes on and tries again later
                self.attempts += 1
                reason = str(e) if isinstance(e, StateUnavailable) else f"{type(e).__name__}: {e}"
                logger.warning(f"could not save the checkpoint of epoch {wanted} (attempt {self.attempts}): {reason}; "
                               f"trying again in {delay:.0f} s")
                if not isinstance(e, StateUnavailable):
                    logger.debug("the failed checkpoint", exc_info=True)
                self.emit("state_download_failed", epoch=wanted, reason=reason, attempt=self.attempts,
                          retry_in=delay)
                self._stop.wait(delay)
                delay = min(2 * delay, self.settings.backoff_max)

    def download(self) -> int:
        """Load the newest state (the anchor's, else the one a peer gives) into ``self.model``; returns its global epoch.

        :raises StateUnavailable: no peer gave its state, or the one given did not fit
        """
        if self.anchor is not None:
            epoch, parameters = self.anchor.snapshot()
            self.model.load_state_dict(parameters)
            return epoch
        averager = self.averager
        epoch_before, averager.last_downloaded_epoch = averager.local_epoch, None
        # hivemind refuses a state behind its local epoch; -1 accepts any, and tells a state applied from none
        averager.local_epoch = -1
        try:
            averager.load_state_from_peers(timeout=self.settings.download_timeout)
        except TimeoutError:
            raise StateUnavailable(f"no peer sent its whole state within {self.settings.download_timeout:.0f} s") \
                from None
        finally:
            applied = averager.local_epoch >= 0
            if not applied:
                averager.local_epoch = epoch_before
        if averager.last_downloaded_epoch is None:
            raise StateUnavailable("no peer gave its state (no training peer shares it yet, or every download failed)")
        if not applied:
            raise StateUnavailable(f"a peer sent a state (epoch {averager.last_downloaded_epoch}) that does not fit "
                                   f"this run's model and optimizer: start the monitor with the volunteers' --preset "
                                   f"and --set options")
        return averager.local_epoch

    def save_from_swarm(self) -> str:
        """Download the swarm's state, save it as the next checkpoint, rotate, record and push it; returns its path.

        :raises StateUnavailable: (or anything else) when no checkpoint was written
        """

        wanted = self.next_epoch
        epoch = self.download()
        if epoch < wanted and self.anchor is not None:
            # the anchor took no round up to that epoch and could download no newer state
            raise StateUnavailable(f"no peer gave its state of epoch {wanted} or later (the anchor holds epoch {epoch}; "
                                   f"no training peer shares a newer state yet)")
        if epoch < wanted:
            raise StateUnavailable(f"the newest state a peer gave is of epoch {epoch}, before epoch {wanted}")

        bad = non_finite_parameters(self.model)
        if bad:
            raise StateUnavailable(f"the state of epoch {epoch} has non-finite parameters ({', '.join(bad[:3])})")
        metadata = dict(global_epoch=epoch, run_id=self.config.swarm.run_id, saved_by="collab-kit monitor",
                        time=time.time())
        path = save_checkpoint(self.model, self.config,
                               os.path.join(self.settings.checkpoint_dir, checkpoint_name(epoch)), metadata=metadata)
        self.last_epoch = epoch
        if self.history is not None:
            self.history.record_checkpoint(epoch, path, get_dht_time())
        removed = rotate_checkpoints(self.settings.checkpoint_dir, self.settings.keep_last)
        pushed_to = None
        if self.settings.push_to:
            try:
                commit = push_checkpoint(path, self.settings.push_to, epoch)
                pushed_to = self.settings.push_to
                if self.history is not None:
                    self.history.record_checkpoint(epoch, path, get_dht_time(), pushed_to=pushed_to)
                logger.info(f"pushed the checkpoint of epoch {epoch} to {pushed_to} (commit {commit[:8]})")
            except Exception as e:  # the Hub may be away: the local checkpoint stands, the next one is pushed again
                logger.warning(f"could not push the checkpoint of epoch {epoch} to {self.settings.push_to}: {e}")
                self.emit("push_failed", epoch=epoch, repo=self.settings.push_to, reason=f"{type(e).__name__}: {e}")
        logger.info(f"saved the swarm's state of epoch {epoch} to {path}")
        self.emit("checkpoint", epoch=epoch, path=path, pushed_to=pushed_to,
                  removed=[os.path.basename(p) for p in removed])
        return path

    def stop(self) -> None:
        """Stop the thread and the averager; a download under way is abandoned (a save is atomic: whole or none)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)  # a daemon thread: one stuck in a download does not hold up the exit
        if self.averager is not None:
            self.averager.shutdown()


# ---------------------------------------------------------------------------------------------
# Weights & Biases


def require_wandb(project: str):
    """The ``wandb`` module; :raises MonitorError: saying how to install it, when it is not installed."""
    try:
        import wandb
    except ImportError:
        raise MonitorError(f"--wandb-project {project}: Weights & Biases is not installed. Install it with "
                           f"`pip install wandb` and log in with `wandb login`, or leave out --wandb-project "
                           f"(and unset WANDB_PROJECT)") from None
    return wandb


class WandbLogger:
    """Logs each poll to a Weights & Biases run named after the run id (resumed after a restart)."""

    def __init__(self, project: str, config: RunConfig):
        wandb = require_wandb(project)
        self.run = wandb.init(project=project, name=config.swarm.run_id, id=config.swarm.run_id, resume="allow",
                              job_type="monitor", config=config.to_dict())

    def log(self, snapshot: SwarmSnapshot, contributors: int) -> None:
        values = dict(epoch=snapshot.epoch, alive_peers=snapshot.alive_peers,
                      samples_per_second=snapshot.samples_per_second, contributors=contributors)
        if snapshot.loss is not None:
            values["loss"] = snapshot.loss
        self.run.log(values)

    def close(self) -> None:
        self.run.finish()


# ---------------------------------------------------------------------------------------------
# the monitor


class Monitor:
    """The swarm's first peer: polls the DHT, keeps the run's history in SQLite, saves checkpoints.

    Everything starts here (the DHT, the anchor or the state averager of the checkpoints, the database); ``run``
    polls until stopped; ``close`` (or leaving a ``with`` block) stops it all.

    :param config: the run's configuration (its swarm section says where to listen; its model and optimizer
      must be the volunteers' for checkpoints)
    :param settings: what to keep and how often (MonitorSettings)
    :param on_event: called as ``on_event(kind, **fields)`` for "ready", "poll", "anchor_round", "checkpoint",
      "state_download_failed" and "push_failed" (``collab-kit monitor --events`` prints them); calls are serialized
    :raises MonitorError: W&B asked for but not installed, or an anchor asked for in client mode
    :raises collab_kit.auth.client.AuthorizationError: an authorized run refused this peer
    """

    def __init__(self, config: RunConfig, settings: Optional[MonitorSettings] = None,
                 on_event: Optional[Callable[..., None]] = None):
        self.config, self.settings = config, settings or MonitorSettings()
        self.run_id = config.swarm.run_id
        self._on_event, self._event_lock = on_event, threading.Lock()
        self.wandb = None
        if self.settings.wandb_project:
            require_wandb(self.settings.wandb_project)  # a missing package fails before anything starts
        # the first peer of a swarm accepts connections; a monitor started again through a volunteer asks the swarm
        self.membership = SwarmMembership(config, record_validators=monitor_validators(self.run_id))
        self.config = config = self.membership.config
        self.dht, self.authorizer, self.reachability = (self.membership.dht, self.membership.authorizer,
                                                        self.membership.reachability)
        peer_gate = self.membership.peer_gate
        self.checkpointer, self.history, self.anchor = None, None, None
        self._verified: Dict[bytes, str] = {}  # record subkey -> the username a binding proved for it
        try:
            if self.settings.anchor and self.dht.client_mode:
                raise MonitorError("an anchor must accept connections, and this monitor is in client mode: run it on "
                                   "a machine others can dial, or without --anchor")
            if self.settings.anchor is not False and not self.dht.client_mode:
                self.anchor = Anchor(config, self.dht, peer_gate=peer_gate, on_round=self._on_anchor_round)
            elif not self.settings.anchor:
                logger.warning("this monitor runs no anchor: volunteers behind NAT can average only through "
                               "another peer that accepts connections")
            if self.anchor is not None and self.settings.checkpoint_every:
                self._resume_anchor()
            if self.settings.checkpoint_every:
                self.checkpointer = Checkpointer(config, self.dht, self.settings, emit=self._emit, anchor=self.anchor)
            if self.settings.db_path:
                self.history = RunHistory(self.settings.db_path, run_id=self.run_id)
            if self.checkpointer is not None:
                self.checkpointer.start(self.history)
            if self.settings.wandb_project:
                self.wandb = WandbLogger(self.settings.wandb_project, config)
            if self.anchor is not None:
                self.anchor.start()
        except BaseException:
            self.close()
            raise
        self.last_snapshot: Optional[SwarmSnapshot] = None

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
        except Exception as e:  # a series that does not fit this run's model: the anchor starts afresh
            logger.warning(f"the anchor could not resume from the checkpoints in {folder} ({type(e).__name__}: {e}); "
                           f"it starts from the run's initial parameters")

    def _on_anchor_round(self, epoch: int, training_peers: int, problem: Optional[str]) -> None:
        self._emit("anchor_round", epoch=epoch, training_peers=training_peers, problem=problem)

    def _emit(self, kind: str, **fields) -> None:
        if self._on_event is not None:
            with self._event_lock:  # the checkpointer's thread and the poll loop both report
                self._on_event(kind, **fields)

    # -- polling --------------------------------------------------------------------------------

    def _credited_names(self, records: List[Tuple[bytes, PeerMetrics]]) -> Dict[bytes, str]:
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

    def poll(self) -> SwarmSnapshot:
        """Read the swarm once, store the point and the contributors' growth, and wake the checkpointer."""
        records = read_metrics(self.dht, self.run_id)
        progress = read_swarm_progress(self.dht, self.run_id)
        names = self._credited_names(records)
        snapshot = summarize([record for _, record in records])
        snapshot.epoch = max(snapshot.epoch, progress.epoch)
        if progress.num_peers:  # hivemind's records expire sooner after a peer leaves: the better "alive" count
            snapshot.alive_peers, snapshot.samples_per_second = progress.num_peers, progress.samples_per_second
        contributors = 0
        if self.history is not None:
            self.history.record(snapshot, [(key, record, names[bytes(key)]) for key, record in records])
            contributors = len(self.history.leaderboard())
        if self.wandb is not None:
            self.wandb.log(snapshot, contributors)
        if self.checkpointer is not None:
            self.checkpointer.notify(snapshot.epoch)
        loss = "-" if snapshot.loss is None else f"{snapshot.loss:.4f}"
        logger.info(f"epoch {snapshot.epoch}, {snapshot.alive_peers} training peers, loss {loss}, "
                    f"{snapshot.samples_per_second:.1f} samples/s, {progress.samples_accumulated} samples toward "
                    f"the next step")
        self._emit("poll", epoch=snapshot.epoch, alive_peers=snapshot.alive_peers, loss=snapshot.loss,
                   samples_per_second=snapshot.samples_per_second, records=len(records), contributors=contributors)
        self.last_snapshot = snapshot
        return snapshot

    def run(self, stop: Optional[threading.Event] = None,
            on_ready: Optional[Callable[[hivemind.DHT], None]] = None) -> None:
        """Print how to join, then poll every ``poll_every`` seconds until ``stop`` is set or Ctrl-C.

        A poll that fails (the DHT busy, a database error) is logged; the next one comes as usual.

        :param stop: an event that ends the loop (None: run until interrupted)
        :param on_ready: called with the DHT once the peer is reachable
        """
        stop = stop or threading.Event()
        try:
            print(join_instructions(self.dht, self.config), flush=True)
            if self.settings.address_file:
                write_address_file(self.settings.address_file, self.dht)
            self._emit("ready", peer_id=str(self.dht.peer_id), addresses=join_addresses(self.dht))
            if on_ready is not None:
                on_ready(self.dht)
            while True:
                try:
                    self.poll()
                except Exception as e:
                    logger.warning(f"this poll of the swarm failed ({type(e).__name__}: {e}); the next one comes "
                                   f"in {self.settings.poll_every:g} s", exc_info=logger.isEnabledFor(logging.DEBUG))
                if stop.wait(self.settings.poll_every):
                    break
        except KeyboardInterrupt:
            pass

    # -- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the checkpointer, leave the swarm, close the database (safe to call twice)."""
        try:
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

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
