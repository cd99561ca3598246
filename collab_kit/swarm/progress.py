"""The swarm's progress as each peer reads it: hivemind's ProgressTracker, counting training peers and anchors.

hivemind's tracker reads every peer's progress record from the DHT and says when the next global step is due; the
kit's also tells anchors (collab_kit.swarm.anchor, training nothing) from training peers.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from hivemind.optim.progress_tracker import LocalTrainingProgress, ProgressTracker
from hivemind.utils import ValueWithExpiration, get_dht_time

logger = logging.getLogger(__name__)


def is_anchor_record(record: LocalTrainingProgress) -> bool:
    """Whether a hivemind progress record is an anchor's: it reports a throughput of exactly 0, which a peer that
    trains never does (hivemind publishes a trainer's record only after its first samples)."""
    return record.samples_per_second == 0.0


class SwarmProgressTracker(ProgressTracker):
    """hivemind's ProgressTracker that also counts, at each reading, the peers that train and the anchors.

    hivemind's ``global_progress.num_peers`` counts both: an anchor publishes a record so that its epoch is
    the swarm's (peers behind NAT, in client mode, do not set the global epoch), with no throughput.
    """

    training_peers: int = 0  # peers with a progress record that contribute samples (this one included)
    anchor_peers: int = 0  # peers with a progress record and no throughput (collab_kit.swarm.anchor)
    trainer_records: tuple = ()  # (peer id as bytes, local epoch) of each training peer's record
    other_anchor_records: tuple = ()  # (peer id as bytes, local epoch) of each anchor's record but this peer's own
    client_mode_trainers: int = 0  # training peers in client mode (they average only through a peer that leads)

    def __init__(self, *args, min_report_period: float = 0.0, **kwargs):
        # set before hivemind's __init__, which starts the thread that reads them
        self.min_report_period = min_report_period
        self.urgent_report = threading.Event()  # a report that waits for no period: a new epoch, a reset, the shutdown
        super().__init__(*args, **kwargs)

    def report_local_progress(self, local_epoch: int, samples_accumulated: int, update_global_samples: bool = True):
        previous = self.local_progress
        super().report_local_progress(local_epoch, samples_accumulated, update_global_samples)
        if local_epoch != previous.epoch or samples_accumulated < previous.samples_accumulated:
            self.urgent_report.set()

    def shutdown(self, timeout: float | None = None):
        self.urgent_report.set()
        super().shutdown(timeout)

    async def _progress_reporter(self):
        """hivemind's reporter (1.1.12), which stores the record at every local step, publishing at most once per
        ``min_report_period`` within an epoch (a store per step fills a thin link); a new epoch or a reset goes out at
        once. Shown by tests/swarm/test_optim.py::
        test_the_progress_tracker_publishes_a_burst_of_steps_once_per_period_and_a_new_epoch_at_once."""
        loop = asyncio.get_event_loop()
        # the period runs from the last store: a look at the progress that published nothing (at the start, before the
        # first step) holds nothing back
        last_report_time = last_store_time = last_report_epoch = -float("inf")
        store_task = None
        try:
            while not self.shutdown_triggered.is_set():
                wait_timeout = max(0.0, last_report_time - get_dht_time() + self.metadata_expiration / 2)
                await loop.run_in_executor(None, self.should_report_progress.wait, wait_timeout)
                hold = last_store_time + self.min_report_period - get_dht_time()
                if hold > 0 and self.should_report_progress.is_set() and not self.urgent_report.is_set():
                    await loop.run_in_executor(None, self.urgent_report.wait, hold)  # the steps of the wait go along
                if self.shutdown_triggered.is_set():
                    break
                self.should_report_progress.clear()
                self.urgent_report.clear()
                local_progress = self.local_progress
                last_report_time = get_dht_time()
                if local_progress.samples_accumulated > 0:
                    last_report_epoch = self.global_epoch
                if last_report_epoch >= self.global_epoch - 1:  # as hivemind: a peer in sync and contributing
                    last_store_time = last_report_time
                    store_task = asyncio.create_task(
                        asyncio.wait_for(
                            self.dht.store(
                                key=self.training_progress_key,
                                subkey=self._local_public_key,
                                value=local_progress.dict(),
                                expiration_time=last_report_time + self.metadata_expiration,
                                return_future=True,
                            ),
                            timeout=self.metadata_expiration,
                        )
                    )
        finally:
            logger.debug(f"No longer reporting progress for {self.prefix}")
            if store_task is not None:
                store_task.cancel()

    def _parse_swarm_progress_data(self, metadata):
        own_entry = metadata.get(self._local_public_key) if isinstance(metadata, dict) else None
        if own_entry is not None and own_entry.value is not None:
            # this peer's own record, as the DHT holds it, is up to min_report_period old: hivemind would take its
            # samples for the swarm's count and drop the steps taken since, so a lone peer's epoch ran 1-3 micro-
            # batches past the target; its progress as it is now stands in for that copy
            metadata = dict(metadata)
            metadata[self._local_public_key] = ValueWithExpiration(
                self.local_progress.dict(), own_entry.expiration_time
            )
        progress = super()._parse_swarm_progress_data(metadata)
        trainers, anchors, other_anchors, clients = [], 0, [], 0
        if isinstance(metadata, dict):
            for key, entry in metadata.items():
                if entry.value is None:
                    continue
                record = LocalTrainingProgress.parse_obj(entry.value)  # valid: super() parsed it already
                if is_anchor_record(record):
                    anchors += 1
                    if key != self._local_public_key:
                        other_anchors.append((record.peer_id, record.epoch))
                else:
                    trainers.append((record.peer_id, record.epoch))
                    clients += record.client_mode
        self.trainer_records, self.training_peers, self.anchor_peers = tuple(trainers), len(trainers), anchors
        self.client_mode_trainers, self.other_anchor_records = clients, tuple(other_anchors)
        return progress

    def run(self):
        # hivemind's ProgressTracker.run (1.1.12), ended the way asyncio.run ends a loop: the tasks its fetcher leaves
        # behind are cancelled, not logged as "Task was destroyed but it is pending!" (tests/swarm/test_optim.py::
        # test_the_progress_tracker_leaves_no_task_of_its_loop_pending_when_it_stops)
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(asyncio.gather(self._progress_reporter(), self._progress_fetcher()))
        finally:
            leftovers = asyncio.all_tasks(loop)
            for task in leftovers:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            asyncio.set_event_loop(None)
            loop.close()
            self.shutdown_complete.set()
