"""The coordinator: the swarm's first peer, which stays up while volunteers come and go.

It trains nothing. It gives volunteers a stable address to join through, and reads the progress
that every training peer publishes in the DHT, so that one place can tell how the run is going.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import hivemind
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.optim.progress_tracker import LocalTrainingProgress, TrainingProgressSchema

from collab_kit.config import SwarmConfig
from collab_kit.swarm import join_addresses, join_instructions, start_dht

logger = logging.getLogger(__name__)


@dataclass
class SwarmProgress:
    """The run as the DHT sees it now."""

    epoch: int  # the highest global epoch any training peer reports
    samples_accumulated: int  # samples toward the next global step, at that epoch
    num_peers: int  # training peers with a live record
    samples_per_second: float  # the whole swarm's throughput


def progress_validators(run_id: str) -> list:
    """The record validators hivemind.Optimizer peers use for ``run_id``'s progress records.

    Progress records are signed: a DHT without these validators cannot even decode them.
    """
    return [SchemaValidator(TrainingProgressSchema, prefix=run_id), RSASignatureValidator()]


def read_swarm_progress(dht: hivemind.DHT, run_id: str) -> SwarmProgress:
    """Read the progress records that hivemind.Optimizer peers publish under ``<run_id>_progress``.

    :param dht: a DHT started with ``record_validators=progress_validators(run_id)``
    """
    found = dht.get(f"{run_id}_progress", latest=True)
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
        num_peers=len(records),
        samples_per_second=sum(r.samples_per_second for r in records),
    )


def write_address_file(path: str, dht: hivemind.DHT) -> None:
    """Write the join addresses, one a line, atomically (a reader never sees half a file)."""
    tmp_path = path + ".tmp"
    with open(tmp_path, "w") as f:
        f.write("\n".join(join_addresses(dht)) + "\n")
    os.replace(tmp_path, path)


def run_coordinator(swarm: SwarmConfig, address_file: Optional[str] = None, report_every: float = 10.0,
                    stop: Optional[threading.Event] = None,
                    on_ready: Optional[Callable[[hivemind.DHT], None]] = None) -> None:
    """Start the first peer and report the swarm's progress until ``stop`` is set or Ctrl-C.

    :param swarm: where to listen and the run to watch
    :param address_file: also write the join addresses to this file (for scripts that start volunteers)
    :param report_every: seconds between progress lines
    :param stop: an event that ends the loop (None: run until interrupted)
    :param on_ready: called with the DHT once the peer is reachable
    """
    stop = stop or threading.Event()
    from collab_kit.volunteer import authorize

    authorizer = authorize(swarm)  # None for an open run
    dht = start_dht(swarm, record_validators=progress_validators(swarm.run_id),
                    **({"authorizer": authorizer} if authorizer else {}))
    binding_keeper = None
    try:
        if authorizer is not None:
            from collab_kit.auth import BindingKeeper

            binding_keeper = BindingKeeper(dht, authorizer, swarm.run_id)
        print(join_instructions(dht, swarm.run_id), flush=True)
        if address_file:
            write_address_file(address_file, dht)
        if on_ready is not None:
            on_ready(dht)
        while not stop.wait(report_every):
            progress = read_swarm_progress(dht, swarm.run_id)
            logger.info(f"epoch {progress.epoch}, {progress.num_peers} training peers, "
                        f"{progress.samples_accumulated} samples toward the next step, "
                        f"{progress.samples_per_second:.1f} samples/s")
    except KeyboardInterrupt:
        pass
    finally:
        if binding_keeper is not None:
            binding_keeper.stop()
        dht.shutdown()
