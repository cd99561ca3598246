"""The monitor's checkpoints: the swarm's state every K global epochs, downloaded (or taken from the anchor in this
process), saved as a series of folders, the newest kept, and pushed to the Hub when asked.

A download that fails is tried again after a wait that doubles, up to a ceiling; a state that does not fit the
run's model says which settings to start the monitor with. The state averager it downloads with has the
volunteers' prefix, parameter groups, optimizer and schedule, so the tensors land where they belong.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable

import hivemind
from hivemind.utils.timed_storage import get_dht_time
from huggingface_hub import HfApi

from collab_kit.config import RunConfig
from collab_kit.model.checkpoint import (
    CONFIG_NAME,
    checkpoint_name,
    list_checkpoints,
    rotate_checkpoints,
    save_checkpoint,
)
from collab_kit.model.transformer import TextToImageTransformer, non_finite_parameters
from collab_kit.roles.monitor_settings import MonitorSettings
from collab_kit.swarm.anchor import Anchor
from collab_kit.swarm.averagers import STATE_DOWNLOAD_PART_TIMEOUT, recording_state_averager_class
from collab_kit.swarm.keys import state_averager_prefix
from collab_kit.swarm.lamb import parameter_groups
from collab_kit.swarm.local_updates import mode_averager_class, swarm_optimizer_factory, swarm_scheduler_factory

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# checkpoints


class StateUnavailable(RuntimeError):
    """No usable state came from the swarm this time (the message says why); the checkpointer tries again later."""


def push_checkpoint(folder: str, repo_id: str, epoch: int) -> str:
    """Upload a checkpoint folder to the root of a Hub model repository (created if missing); returns the commit id.

    The repository's main branch then holds the newest checkpoint (what ``load_checkpoint(repo_id)`` reads);
    its history holds every pushed one, a commit each.
    """

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id,
        repo_type="model",
        folder_path=folder,
        commit_message=f"collab_kit checkpoint of global epoch {epoch}",
    )
    return info.oid


def _checkpoint_run_id(path: str) -> str | None:
    """The run id a checkpoint's metadata names (None: unreadable, or none named)."""

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
    :param anchor: the run's anchor in this process (collab_kit.swarm.anchor.Anchor), whose state is saved; None:
      download
    """

    def __init__(
        self,
        config: RunConfig,
        dht: hivemind.DHT,
        settings: MonitorSettings,
        emit: Callable[..., None] = lambda kind, **fields: None,
        anchor: Anchor | None = None,
    ):
        self.config, self.settings, self.emit, self.anchor = config, settings, emit, anchor
        self.model = TextToImageTransformer(config.model)
        # building it forks the averager's process: done before the monitor opens its database (an SQLite
        # connection must not cross a fork)
        averager_class = mode_averager_class(recording_state_averager_class(), config.optimizer)
        self.averager = (
            None
            if anchor is not None
            else averager_class(
                dht=dht,
                prefix=state_averager_prefix(config.swarm.run_id),
                optimizer=swarm_optimizer_factory(config.optimizer),
                params=parameter_groups(self.model, config.optimizer.weight_decay),
                scheduler=swarm_scheduler_factory(config.optimizer),
                offload_optimizer=False,
                client_mode=True,
                allow_state_sharing=False,
                next_chunk_timeout=min(STATE_DOWNLOAD_PART_TIMEOUT, settings.download_timeout),
                start=True,
            )
        )
        if self.averager is not None:
            # hivemind catches a loaded state's schedule up with scheduler.step() alone: this optimizer holds the state
            # and never steps, which torch would warn about at each download (a warning filter would act on the whole
            # process); marked as torch marks an optimizer that has stepped
            self.averager.optimizer._opt_called = True
        self.history = None
        self.last_epoch: int | None = None  # the newest checkpoint's global epoch
        self.swarm_epoch = 0  # the highest global epoch the polls have seen
        self.attempts = 0  # failed downloads in a row
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

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
            logger.warning(
                f"{folder} holds checkpoints of another run ({_checkpoint_run_id(series[-1][1])!r}); "
                f"this run's series goes on after them. Pass --checkpoints FOLDER (and --db PATH) to give "
                f"run {self.config.swarm.run_id!r} files of its own"
            )
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
                logger.warning(
                    f"could not save the checkpoint of epoch {wanted} (attempt {self.attempts}): {reason}; "
                    f"trying again in {delay:.0f} s"
                )
                if not isinstance(e, StateUnavailable):
                    logger.debug("the failed checkpoint", exc_info=True)
                self.emit("state_download_failed", epoch=wanted, reason=reason, attempt=self.attempts, retry_in=delay)
                self._stop.wait(delay)
                delay = min(2 * delay, self.settings.backoff_max)

    def download(self) -> int:
        """Load the newest state (the anchor's, else the one a peer gives) into ``self.model``; returns its global
        epoch.

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
            raise StateUnavailable(
                f"no peer sent its whole state within {self.settings.download_timeout:.0f} s"
            ) from None
        finally:
            applied = averager.local_epoch >= 0
            if not applied:
                averager.local_epoch = epoch_before
        if averager.last_downloaded_epoch is None:
            raise StateUnavailable("no peer gave its state (no training peer shares it yet, or every download failed)")
        if not applied:
            raise StateUnavailable(
                f"a peer sent a state (epoch {averager.last_downloaded_epoch}) that does not fit "
                f"this run's model and optimizer: start the monitor with the volunteers' --preset "
                f"and --set options"
            )
        return averager.local_epoch

    def save_from_swarm(self) -> str:
        """Download the swarm's state, save it as the next checkpoint, rotate, record and push it; returns its path.

        :raises StateUnavailable: (or anything else) when no checkpoint was written
        """

        wanted = self.next_epoch
        epoch = self.download()
        if epoch < wanted and self.anchor is not None:
            # the anchor took no round up to that epoch and could download no newer state
            raise StateUnavailable(
                f"no peer gave its state of epoch {wanted} or later (the anchor holds epoch {epoch}; "
                f"no training peer shares a newer state yet)"
            )
        if epoch < wanted:
            raise StateUnavailable(f"the newest state a peer gave is of epoch {epoch}, before epoch {wanted}")

        bad = non_finite_parameters(self.model)
        if bad:
            raise StateUnavailable(f"the state of epoch {epoch} has non-finite parameters ({', '.join(bad[:3])})")
        metadata = dict(
            global_epoch=epoch, run_id=self.config.swarm.run_id, saved_by="collab-kit monitor", time=time.time()
        )
        path = save_checkpoint(
            self.model,
            self.config,
            os.path.join(self.settings.checkpoint_dir, checkpoint_name(epoch)),
            metadata=metadata,
        )
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
        self.emit(
            "checkpoint", epoch=epoch, path=path, pushed_to=pushed_to, removed=[os.path.basename(p) for p in removed]
        )
        return path

    def stop(self) -> None:
        """Stop the thread and the averager; a download under way is abandoned (a save is atomic: whole or none)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)  # a daemon thread: one stuck in a download does not hold up the exit
        if self.averager is not None:
            self.averager.shutdown()
